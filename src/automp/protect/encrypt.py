"""Weights encrypted with a key that is needed to load the model (stdlib only).

This is obfuscation-grade protection for a file at rest, not an audited cryptosystem: whoever can run the model
holds the key and the decrypted weights in memory, and nothing here has had a security review.

Scheme (version 1):
  key       32 bytes, written as 64 hex characters in a file or on the command line (encrypt.read_key)
  keys      enc_key | mac_key = PBKDF2-HMAC-SHA256(key, salt, 200000 iterations), 32 bytes each
  plaintext 8-byte manifest length | manifest (JSON: initializer names in order, byte length of each) |
            every main-graph initializer serialized as a TensorProto
  keystream SHAKE-256(enc_key | nonce), as long as the plaintext; ciphertext = plaintext XOR keystream
  tag       HMAC-SHA256(mac_key, header | ciphertext) (encrypt-then-MAC)
  key check HMAC-SHA256(mac_key, "automp.protect key check"): a wrong key fails before anything is decrypted

The ciphertext is one UINT8 initializer that no node reads; the header (JSON, without secrets) is the model's
metadata entry "automp.protect.encrypted". The encrypted weights become graph inputs (rank only, no sizes), so the file
is still a valid ONNX model, and onnxruntime refuses to run it without them instead of computing garbage.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct

import numpy as np
import onnx

META_KEY = "automp.protect.encrypted"
VERSION = 1
ITERATIONS = 200_000
KEY_BYTES = 32
KEY_FORMAT = f"{2 * KEY_BYTES} hex characters ({KEY_BYTES} bytes, e.g. from `openssl rand -hex {KEY_BYTES}`)"
_CHECK = b"automp.protect key check"


class WrongKeyError(ValueError):
    """The key is not the one the model was encrypted with."""


def _from_hex(text: str, where: str) -> bytes:
    digits = "".join(text.split())  # surrounding whitespace and a file's line breaks are not part of the key
    digits = digits[2:] if digits[:2].lower() == "0x" else digits
    if len(digits) != 2 * KEY_BYTES or any(c not in "0123456789abcdefABCDEF" for c in digits):
        shown = f"{len(digits)} characters" if len(digits) != 2 * KEY_BYTES else "characters that are not hex digits"
        raise ValueError(f"{where}: expected a key of {KEY_FORMAT}, got {shown}")
    return bytes.fromhex(digits)


def read_key(spec: bytes | str | os.PathLike) -> bytes:
    """The 32-byte key. One format for files and strings: 64 hex characters, whitespace around them ignored, so
    `openssl rand -hex 32 > key.txt` and the same digits given on the command line are the same key. bytes are the
    raw key itself (32 of them). The CLI's --key goes through here, so the Python API and the CLI agree."""
    if isinstance(spec, (bytes, bytearray)):
        if len(spec) != KEY_BYTES:
            raise ValueError(f"a raw key must be {KEY_BYTES} bytes, got {len(spec)} (or give {KEY_FORMAT})")
        return bytes(spec)
    if isinstance(spec, (str, os.PathLike)) and os.path.isfile(spec):
        with open(spec, "rb") as f:
            data = f.read(4096)
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            text = "\0"  # binary: not hex
        return _from_hex(text, f"key file {os.fspath(spec)}")
    if isinstance(spec, str):
        return _from_hex(spec, "key")
    raise TypeError(f"key must be bytes, a key file path or a hex string, got {type(spec).__name__}")


def _earlier_keys(spec: bytes | str | os.PathLike) -> list[bytes]:
    """What `spec` meant before keys had one format, for models encrypted then: a key file's bytes as they are
    (a trailing newline included), hex strings and raw keys of 16 bytes or more."""
    if isinstance(spec, (bytes, bytearray)):
        return [bytes(spec)] if len(spec) >= 16 and len(spec) != KEY_BYTES else []
    if isinstance(spec, (str, os.PathLike)) and os.path.isfile(spec):
        with open(spec, "rb") as f:
            return [f.read()]
    if isinstance(spec, str):
        try:
            key = bytes.fromhex(spec.strip().removeprefix("0x"))
        except ValueError:
            return []
        return [key] if len(key) >= 16 and len(key) != KEY_BYTES else []
    return []


def _derive(key: bytes, salt: bytes, iterations: int) -> tuple[bytes, bytes]:
    k = hashlib.pbkdf2_hmac("sha256", key, salt, iterations, 64)
    return k[:32], k[32:]


def _matching_key(key: bytes | str | os.PathLike, h: dict, source: str) -> tuple[bytes, bytes]:
    """(enc_key, mac_key) of the key the header's check accepts: `key` read as read_key reads it, else as it was
    read before keys had one format (so models encrypted with a raw key file still open)."""
    try:
        candidates, error = [read_key(key)], None
    except ValueError as e:
        candidates, error = [], e
    candidates += _earlier_keys(key)
    for candidate in candidates:
        enc_key, mac_key = _derive(candidate, bytes.fromhex(h["salt"]), int(h["iterations"]))
        if hmac.compare_digest(hmac.new(mac_key, _CHECK, hashlib.sha256).hexdigest(), h["key_check"]):
            return enc_key, mac_key
    if error is not None:
        raise error
    raise WrongKeyError(f"wrong key for {source}: it is not the key the model was encrypted with")


def _xor(data: bytes, enc_key: bytes, nonce: bytes) -> bytes:
    stream = hashlib.shake_256(enc_key + nonce).digest(len(data))
    return (np.frombuffer(data, np.uint8) ^ np.frombuffer(stream, np.uint8)).tobytes()


def _header_bytes(header: dict) -> bytes:
    return json.dumps({k: v for k, v in header.items() if k != "tag"}, sort_keys=True).encode()


def header(model: onnx.ModelProto) -> dict | None:
    """The encryption header, or None for a model this module did not encrypt."""
    entry = next((p.value for p in model.metadata_props if p.key == META_KEY), None)
    if entry is None:
        return None
    try:
        h = json.loads(entry)
    except json.JSONDecodeError:
        raise ValueError(f"metadata {META_KEY!r} is not valid JSON: the file is damaged") from None
    if h.get("version") != VERSION:
        raise ValueError(f"encrypted with format version {h.get('version')}; this automp reads version {VERSION}")
    return h


def is_encrypted(model: onnx.ModelProto) -> bool:
    return header(model) is not None


def encrypt(model: onnx.ModelProto, key: bytes | str, rng: np.random.Generator,
            iterations: int = ITERATIONS) -> dict:
    """Encrypt the main graph's initializers in place (those that are also graph inputs stay: callers may feed
    them). Returns {"tensors", "bytes", "left_in_clear"}. rng draws the salt and nonce (a seeded run is
    reproducible); the nonce also hashes the plaintext, so two different models never share a keystream."""
    key = read_key(key)
    if is_encrypted(model):
        raise ValueError("the model is already encrypted")
    g = model.graph
    inputs = {i.name for i in g.input}
    secret = [t for t in g.initializer if t.name not in inputs]
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in secret):
        raise ValueError("cannot encrypt initializers stored as external data; load the model with its data first")
    blobs = [t.SerializeToString() for t in secret]
    manifest = json.dumps({"order": [t.name for t in g.initializer],
                           "encrypted": [[t.name, len(b)] for t, b in zip(secret, blobs)]}).encode()
    plain = struct.pack("<Q", len(manifest)) + manifest + b"".join(blobs)
    salt = rng.bytes(16)
    nonce = hashlib.blake2b(rng.bytes(16) + hashlib.sha256(plain).digest(), digest_size=16).digest()
    enc_key, mac_key = _derive(key, salt, iterations)
    cipher = _xor(plain, enc_key, nonce)
    blob_name = "v" + rng.bytes(5).hex()
    h = {"version": VERSION, "cipher": "shake256-xor", "mac": "hmac-sha256", "kdf": "pbkdf2-hmac-sha256",
         "iterations": iterations, "salt": salt.hex(), "nonce": nonce.hex(), "blob": blob_name,
         "key_check": hmac.new(mac_key, _CHECK, hashlib.sha256).hexdigest()}
    h["tag"] = hmac.new(mac_key, _header_bytes(h) + cipher, hashlib.sha256).hexdigest()

    clear = [t for t in g.initializer if t.name in inputs]
    del g.initializer[:]
    g.initializer.extend(clear)
    blob = onnx.TensorProto(name=blob_name, data_type=onnx.TensorProto.UINT8, dims=[len(cipher)], raw_data=cipher)
    g.initializer.append(blob)
    for t in secret:  # inputs nobody feeds (onnxruntime stops instead of running garbage); rank only, no sizes
        g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, [None] * len(t.dims)))
    entry = model.metadata_props.add()
    entry.key, entry.value = META_KEY, json.dumps(h, sort_keys=True)
    return {"tensors": len(secret), "bytes": len(cipher), "left_in_clear": len(clear), "scheme": h["cipher"],
            "kdf": h["kdf"]}


def decrypt(model: onnx.ModelProto, key: bytes | str, source: str = "<model>") -> onnx.ModelProto:
    """A decrypted copy: the model exactly as it was before encrypt()."""
    h = header(model)
    if h is None:
        raise ValueError(f"{source} is not encrypted (it was written without --key); load it without a key")
    enc_key, mac_key = _matching_key(key, h, source)
    blob = next((t for t in model.graph.initializer if t.name == h["blob"]), None)
    if blob is None:
        raise ValueError(f"{source}: the encrypted weights ({h['blob']!r}) are missing from the file")
    cipher = blob.raw_data
    tag = hmac.new(mac_key, _header_bytes(h) + cipher, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(tag, h["tag"]):
        raise ValueError(f"{source}: the encrypted weights fail their integrity check (the file was modified or "
                         "damaged)")
    plain = _xor(cipher, enc_key, bytes.fromhex(h["nonce"]))
    (n,) = struct.unpack("<Q", plain[:8])
    manifest = json.loads(plain[8:8 + n])
    tensors, pos = {}, 8 + n
    for name, size in manifest["encrypted"]:
        t = onnx.TensorProto()
        t.ParseFromString(plain[pos:pos + size])
        tensors[name] = t
        pos += size

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    present = {t.name: t for t in g.initializer if t.name != h["blob"]}
    present.update(tensors)
    del g.initializer[:]
    g.initializer.extend(present[name] for name in manifest["order"])
    keep_inputs = [i for i in g.input if i.name not in tensors]
    del g.input[:]
    g.input.extend(keep_inputs)
    keep_meta = [p for p in out.metadata_props if p.key != META_KEY]
    del out.metadata_props[:]
    out.metadata_props.extend(keep_meta)
    return out


def load(src: onnx.ModelProto | bytes | str | os.PathLike, key: bytes | str | None = None) -> onnx.ModelProto:
    """A model written by `automp protect`, decrypted with `key` if it was written with --key. A key for a model
    that is not encrypted is an error too: it usually means the wrong file is about to be shipped."""
    from automp.deploy import onnx_io

    if isinstance(src, onnx.ModelProto):
        model, name = src, "<model>"
    else:
        model = onnx_io.load(src, check_runtime=False)
        name = os.fspath(src) if isinstance(src, (str, os.PathLike)) else "<bytes>"
    if is_encrypted(model):
        if key is None:
            raise ValueError(f"{name} has encrypted weights (automp protect --key): pass the key it was written "
                             "with, e.g. automp.protect.load(path, key)")
        return decrypt(model, key, name)
    if key is not None:
        raise ValueError(f"{name} is not encrypted (it was written without --key); load it without a key")
    return model


def session(src: onnx.ModelProto | bytes | str | os.PathLike, key: bytes | str | None = None, device: str = "cpu",
            optimize: bool = True):
    """An onnxruntime InferenceSession for a protected model (decrypted in memory, never written to disk)."""
    from automp.deploy import runtime

    return runtime.session(load(src, key), device, optimize)
