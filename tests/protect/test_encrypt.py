import numpy as np
import onnx
import pytest

from automp import protect
from automp.deploy import onnx_io, runtime
from automp.protect import ObfuscateConfig, WrongKeyError, obfuscate
from automp.protect import encrypt as encrypt_module
from automp.protect.encrypt import META_KEY, read_key
from automp.quant.ptq.compare import compare

KEY = bytes(range(32))


@pytest.fixture
def encrypted(exported, tmp_path):
    """(path of the encrypted file, the same run unencrypted, the original) for the transformer encoder."""
    src = exported("encoder")
    enc, rep = obfuscate(src, ObfuscateConfig(seed=9, ratio=0.3, key=KEY))
    plain, _ = obfuscate(src, ObfuscateConfig(seed=9, ratio=0.3))
    path = tmp_path / "enc.onnx"
    onnx_io.save(enc, path)
    assert rep.encrypted["tensors"] == len(plain.graph.initializer) and rep.encrypted["left_in_clear"] == 0
    return path, plain, src


def test_round_trip_restores_the_model_and_its_outputs(encrypted):
    path, plain, src = encrypted
    back = protect.load(path, KEY)
    assert back.SerializeToString() == plain.SerializeToString()  # bit-identical to the unencrypted run
    feeds = runtime.random_feeds(src, batch=3, seed=4)
    got = protect.session(path, KEY).run(None, feeds)[0]
    assert np.array_equal(got, runtime.run(plain, feeds)["hidden"])
    assert compare(got, runtime.run(src, feeds)["hidden"]).rel_l2 <= 1e-5


def test_a_wrong_or_missing_key_is_a_clear_error(encrypted):
    path, plain, _ = encrypted
    with pytest.raises(WrongKeyError, match="wrong key"):
        protect.load(path, bytes(32))
    with pytest.raises(ValueError, match="wrong key"):
        protect.session(path, KEY[::-1])
    with pytest.raises(ValueError, match="encrypted weights.*pass the key"):
        protect.load(path)
    plain_path = path.with_name("plain.onnx")
    onnx_io.save(plain, plain_path)
    with pytest.raises(ValueError, match="not encrypted"):
        protect.load(plain_path, KEY)
    assert protect.load(plain_path) == plain


def test_the_file_holds_no_weight_in_clear_and_stays_valid_onnx(encrypted):
    path, plain, _ = encrypted
    data = path.read_bytes()
    for t in plain.graph.initializer:
        if len(t.raw_data) >= 16:
            assert t.raw_data[:16] not in data, t.name
    m = onnx.load(path)
    onnx.checker.check_model(m, full_check=True)
    assert protect.is_encrypted(m) and not protect.is_encrypted(plain)
    with pytest.raises(Exception, match="input"):  # onnxruntime alone stops: the weights are missing inputs
        runtime.run(m, runtime.random_feeds(plain, seed=0))


def test_a_modified_file_fails_the_integrity_check(encrypted):
    path, _, _ = encrypted
    m = onnx.load(path)
    blob = m.graph.initializer[-1]
    raw = bytearray(blob.raw_data)
    raw[len(raw) // 2] ^= 1
    blob.raw_data = bytes(raw)
    with pytest.raises(ValueError, match="integrity check"):
        protect.load(m, KEY)
    m.graph.initializer.pop()
    with pytest.raises(ValueError, match="missing"):
        protect.load(m, KEY)


def test_same_seed_and_key_give_the_same_file(exported):
    src = exported("convnet_bn")
    a = obfuscate(src, ObfuscateConfig(seed=1, ratio=0.2, key=KEY))[0]
    b = obfuscate(src, ObfuscateConfig(seed=1, ratio=0.2, key=KEY))[0]
    c = obfuscate(src, ObfuscateConfig(seed=1, ratio=0.2, key=KEY[::-1]))[0]
    assert a.SerializeToString() == b.SerializeToString() != c.SerializeToString()
    with pytest.raises(ValueError, match="already protected"):
        obfuscate(a)


def test_read_key_accepts_bytes_hex_and_key_files(tmp_path):
    assert read_key(KEY) == KEY
    assert read_key(KEY.hex()) == KEY and read_key("0x" + KEY.hex().upper()) == KEY
    f = tmp_path / "key.bin"
    f.write_bytes(KEY.hex().encode() + b"\n")
    assert read_key(str(f)) == KEY and read_key(f) == KEY
    with pytest.raises(ValueError, match="expected a key of 64 hex characters"):
        read_key("00ff")
    with pytest.raises(ValueError, match="expected a key of 64 hex characters"):
        read_key("not-a-file-nor-hex")
    with pytest.raises(TypeError, match="key must be"):
        read_key(1234)


def test_a_key_file_and_the_same_hex_string_are_one_key(tmp_path):
    """`openssl rand -hex 32 > key.txt` writes 64 hex digits and a newline: the file, the file without the newline
    and the digits given directly are the same 32 bytes."""
    digits = KEY.hex()
    with_newline, without = tmp_path / "key.txt", tmp_path / "key-no-newline.txt"
    with_newline.write_text(digits + "\n")
    without.write_text(digits)
    assert read_key(str(with_newline)) == read_key(digits) == read_key(str(without)) == read_key(f"  {digits}\n") \
        == KEY


@pytest.mark.parametrize("content", [bytes(range(32)), b"ab" * 31 + b"\n", b"ab" * 33, b"zz" * 32],
                         ids=["binary", "62-digits", "66-digits", "not-hex"])
def test_a_key_file_in_another_format_says_what_is_expected(tmp_path, content):
    f = tmp_path / "key.bin"
    f.write_bytes(content)
    with pytest.raises(ValueError, match=f"key file {f}: expected a key of 64 hex characters .32 bytes"):
        read_key(str(f))
    with pytest.raises(ValueError, match="raw key must be 32 bytes"):
        read_key(content[:20])


def test_models_encrypted_with_a_raw_key_file_still_open(exported, tmp_path, monkeypatch):
    """Before keys had one format a key file was used byte for byte (newline included): such models still load."""
    raw = KEY.hex().encode() + b"\n"
    enc, _ = obfuscate(exported("convnet_bn"), ObfuscateConfig(seed=2, ratio=0.2))
    with monkeypatch.context() as m:  # encrypt as the earlier reader did: with the file's bytes as they are
        m.setattr(encrypt_module, "read_key", bytes)
        encrypt_module.encrypt(enc, raw, np.random.default_rng(0))
    f = tmp_path / "key.txt"
    f.write_bytes(raw)
    assert not protect.is_encrypted(protect.load(enc, str(f)))
    with pytest.raises(WrongKeyError):
        protect.load(enc, bytes(32))


def test_the_header_names_the_scheme_and_no_secret(encrypted):
    path, _, _ = encrypted
    m = onnx.load(path)
    entry = next(p.value for p in m.metadata_props if p.key == META_KEY)
    assert "shake256-xor" in entry and "pbkdf2-hmac-sha256" in entry and KEY.hex() not in entry
