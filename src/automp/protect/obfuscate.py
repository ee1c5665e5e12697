"""Make a deployed ONNX model hard to read while it computes the same outputs.

    model, report = automp.protect.obfuscate("model.onnx", ObfuscateConfig(seed=0, ratio=0.2, key=key))

The transforms, in order (each can be switched off in ObfuscateConfig):
  scale    every layer stores W·diag(s) for random s, undone by the next layer's constants or a Mul (scale.py)
  split    every other float constant is stored as two parts that add up to it, bit-exact (split.py)
  insert   exact identity ops and always-true opaque-predicate If branches at `ratio` of the spots (insert.py)
  rename   random names for every node, tensor and initializer; exporter metadata removed (rename.py)
  shuffle  a random valid topological order of the nodes (order.py)
  encrypt  with a key, the weights are stored encrypted and `automp.protect.load(path, key)` is needed (encrypt.py)
Then the result is run against the input in onnxruntime (CPU) on seeded random inputs; a difference above
`tolerance` is an error, never a silent change.

This is obfuscation: it raises the effort of reading the architecture and weights out of a file. It is not a
security boundary and has had no security audit -- constant folding undoes the splits and branches, the op types
and layer count stay visible (the report lists what still shows), and anyone who can run the model can query it.

Supported ops (any ONNX model onnx accepts is processed; what a transform cannot prove safe it leaves alone):
  scale    float32/float64 weights of MatMul, Gemm, Conv (any group), BatchNormalization, LayerNormalization (last
           axis) and Gather (embeddings). The scale passes through Relu, LeakyRelu, PRelu, Identity, Dropout,
           pooling, Add/Sub/Mul/Div with a constant, Transpose, Reshape/Flatten/Squeeze/Unsqueeze that keep the
           channel axis whole and Reduce{Mean,Sum,Max,Min} over other axes, and is absorbed by MatMul, Gemm, Conv
           and BatchNormalization. Float weights of other ops (ConvTranspose, custom domains, ...) are not scaled
           and are counted in report.scaled["skipped"].
  split    float16/32/64 constants whose readers are all standard-domain ops (a custom op may need an initializer).
  insert   float32/float64 tensors, and standard-domain nodes without bodies whose outputs are all float32/float64.
  rename, shuffle, encrypt: every op, custom domains and existing If/Loop/Scan bodies included.
Integer constants (shapes, and the int8 weights of quantized models) are renamed and encrypted, not changed.
Refused with a clear error: corrupt files, external data not loaded, sparse initializers, already-encrypted models,
training_info (renaming would break it), and inserting ops into models older than opset 11.
"""
from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from automp.deploy import onnx_io, runtime
from automp.deploy.passes.graph import copy_model
from automp.protect import encrypt as enc
from automp.protect.insert import insert
from automp.protect.names import graphs
from automp.protect.order import shuffle
from automp.protect.rename import RenameResult, rename, strip_metadata
from automp.protect.report import ProtectReport, op_histogram, still_visible
from automp.protect.scale import ScaleResult, scale_weights
from automp.protect.split import SplitResult, constants_to_initializers, split_constants
from automp.quant.ptq.compare import compare_all

ModelLike = onnx.ModelProto | bytes | str | os.PathLike


@dataclass
class ObfuscateConfig:
    """seed: draws every random choice (scales, names, order, spots, salt); None draws one from the OS and records
    nothing. With the seed and the input model the scaling can be undone: keep it as secret as the key.
    ratio: fraction of the eligible spots that get an identity op, and of eligible nodes wrapped in a branch (each
    branch is an If node at run time, so 1.0 slows inference unless onnxruntime folds them at load).
    rename_io: also rename graph inputs/outputs (the report maps old to new); off by default, callers use them.
    max_scale: channel scales are within [1/max_scale, max_scale] and never within sqrt(2) of 1.
    allow_mul: scale layers whose scale cannot be absorbed by the next layer too, undone by an inserted Mul (a
    little run time). False leaves those weights to the constant split: no Mul, but the file holds both parts.
    key: encrypt the weights (64 hex characters in a string or a file, or 32 raw bytes: see encrypt.read_key).
    tolerance: largest accepted relative L2 output error vs the input model on the verification inputs.
    """
    seed: int | None = None
    ratio: float = 0.2
    rename: bool = True
    rename_io: bool = False
    scale: bool = True
    max_scale: float = 4.0
    allow_mul: bool = True
    split: bool = True
    shuffle: bool = True
    strip_metadata: bool = True
    key: bytes | str | os.PathLike | None = None
    verify: bool = True
    tolerance: float = 1e-4

    def __post_init__(self):
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
                                      or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float, np.floating)) or \
                not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio must be a number in [0, 1], got {self.ratio!r}")
        if not isinstance(self.max_scale, (int, float)) or not 2 <= self.max_scale < math.inf:
            raise ValueError(f"max_scale must be a finite number >= 2, got {self.max_scale!r}")
        if not isinstance(self.tolerance, (int, float)) or not self.tolerance > 0:
            raise ValueError(f"tolerance must be > 0, got {self.tolerance!r}")
        if self.key is not None:
            enc.read_key(self.key)  # a bad key fails here, before any work


def _check_external(model: onnx.ModelProto, source: str) -> None:
    for g in graphs(model.graph):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                raise ValueError(f"{source}: initializer {t.name!r} is stored as external data that was not loaded; "
                                 "load the model with onnx.load(path) (external data next to it) first")


def _load(model: Any) -> tuple[onnx.ModelProto, str]:
    if isinstance(model, onnx.ModelProto):
        _check_external(model, "<model>")  # before the checker, whose message would be about a missing file
        return onnx_io.validate(model, "<model>", check_runtime=False), "<model>"
    if isinstance(model, (str, bytes, bytearray, os.PathLike)):
        name = os.fspath(model) if isinstance(model, (str, os.PathLike)) else "<bytes>"
        return onnx_io.load(model, check_runtime=False), name
    raise TypeError(f"obfuscate takes an onnx.ModelProto, ONNX bytes or a path, got {type(model).__name__}")


def _check_supported(model: onnx.ModelProto, config: ObfuscateConfig, source: str) -> None:
    if enc.is_encrypted(model):
        raise ValueError(f"{source} is already protected with encrypted weights; decrypt it first with "
                         "automp.protect.load(path, key)")
    _check_external(model, source)
    for g in graphs(model.graph):
        if len(g.sparse_initializer):
            raise ValueError(f"{source}: sparse initializers ({g.sparse_initializer[0].values.name!r}) are not "
                             "supported; convert them to dense initializers first")
    if len(model.training_info) and config.rename:
        raise ValueError(f"{source}: the model has training_info, which refers to tensors by name; renaming would "
                         "break it (use rename=False, or remove training_info)")


INT_HIGH = 2  # integer inputs are drawn from [0, INT_HIGH): valid token ids and mask values for any model


def _describe_feeds(feeds: dict[str, np.ndarray], int_high: int) -> str:
    """How runtime.random_feeds drew `feeds`, by what each input really is: "seeded random inputs, batch 2 (standard
    normal: image)", with "integers in [0, 2)" only for integer inputs and "random booleans" for bool ones."""
    kinds: dict[str, list[str]] = {}
    for name, arr in feeds.items():
        if arr.dtype == np.bool_:
            kind = "random booleans"
        elif np.issubdtype(arr.dtype, np.integer):
            kind = f"integers in [0, {int_high})"
        else:
            kind = "standard normal"
        kinds.setdefault(kind, []).append(name)
    batch = next((len(a) for a in feeds.values() if a.ndim), None)
    parts = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in kinds.items())
    return "seeded random inputs" + (f", batch {batch}" if batch is not None else "") + (f" ({parts})" if parts else "")


def _verify(src: onnx.ModelProto, out: onnx.ModelProto, io_map: dict[str, str], tolerance: float,
            source: str) -> dict[str, Any]:
    """Run both models on the same seeded inputs; a difference above tolerance is a bug, raised as one."""
    try:
        feeds = runtime.random_feeds(src, batch=2, seed=0, int_high=INT_HIGH)
        ref = runtime.run(src, feeds, optimize=False)
    except Exception as e:  # noqa: BLE001 -- the input itself does not run here (custom ops, integer ranges)
        return {"skipped": f"the input model does not run in onnxruntime (CPU) on random inputs: "
                           f"{type(e).__name__}: {str(e)[:300]}"}
    try:
        got = runtime.run(out, {io_map.get(k, k): v for k, v in feeds.items()}, optimize=False)
    except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own exception types
        raise RuntimeError(f"{source}: the protected model does not run in onnxruntime although the input does "
                           f"({type(e).__name__}: {e}); this is a bug in automp.protect") from None
    back = {v: k for k, v in io_map.items()}
    errors = compare_all({back.get(k, k): v for k, v in got.items()}, ref)
    worst = max((e.rel_l2 for e in errors.values()), default=0.0)
    if not worst <= tolerance or any(e.nonfinite for e in errors.values()):
        raise RuntimeError(f"{source}: the protected model's outputs differ from the input's by {worst:.3g} "
                           f"(relative L2; tolerance {tolerance}); this is a bug in automp.protect")
    return {"rel_l2": {k: e.rel_l2 for k, e in errors.items()}, "max_abs": {k: e.max_abs for k, e in errors.items()},
            "inputs": _describe_feeds(feeds, INT_HIGH), "tolerance": tolerance}


def obfuscate(model: ModelLike, config: ObfuscateConfig | None = None) -> tuple[onnx.ModelProto, ProtectReport]:
    """The protected model and what was done. The input is not modified."""
    config = config if config is not None else ObfuscateConfig()
    if not isinstance(config, ObfuscateConfig):
        raise TypeError(f"config must be an ObfuscateConfig, got {type(config).__name__}")
    src, source = _load(model)
    _check_supported(src, config, source)
    rng = np.random.default_rng(config.seed if config.seed is not None else secrets.randbits(64))
    m = copy_model(src)
    done = []
    moved = constants_to_initializers(m)
    if config.strip_metadata:
        strip_metadata(m, rng)
        done.append("strip_metadata")
    sc = scale_weights(m, rng, config.max_scale, config.allow_mul) if config.scale else ScaleResult()
    sp = split_constants(m, rng, set(sc.scaled_names)) if config.split else SplitResult()
    sp.constants_to_initializers = moved
    ins = insert(m, rng, config.ratio)
    ren = rename(m, rng, config.rename_io) if config.rename else RenameResult()
    moved_fraction = shuffle(m.graph, rng) if config.shuffle else 0.0
    done += [name for name, on in (("scale", config.scale), ("split", config.split), ("insert", config.ratio > 0),
                                   ("rename", config.rename), ("shuffle", config.shuffle)) if on]
    try:
        onnx.checker.check_model(m)
    except onnx.checker.ValidationError as e:
        raise RuntimeError(f"{source}: the protected model fails the ONNX checker ({e}); this is a bug in "
                           "automp.protect") from None
    error = _verify(src, m, ren.io_renamed, config.tolerance, source) if config.verify else \
        {"skipped": "verify=False"}
    visible = still_visible(m, config.key is not None, ins.branches + ins.identity_spots > 0)
    ops_after = op_histogram(m)
    encrypted: dict[str, Any] = {}
    if config.key is not None:
        encrypted = enc.encrypt(m, config.key, rng)
        done.append("encrypt")
    notes = []
    if sc.skipped:
        notes.append(f"float weights read by these ops were not scaled: {sc.skipped} (scaled: float32/float64 "
                     "weights of MatMul, Gemm, Conv, BatchNormalization, LayerNormalization, Gather, and what they "
                     "flow into; see automp.protect.scale); split['skipped'] says which constants were not split")
    if any(k.startswith("type ") for k in sp.skipped):
        notes.append(f"constants of these types are stored as they were (renamed, encrypted with a key): "
                     f"{[k[5:] for k in sp.skipped if k.startswith('type ')]}")
    custom = sorted({f"{n.domain}:{n.op_type}" for g in graphs(m.graph) for n in g.node
                     if n.domain not in ("", "ai.onnx")})
    if custom:
        notes.append(f"custom-domain ops were renamed and reordered only: {custom}")
    overridable = {i.name for i in src.graph.input} & {t.name for t in src.graph.initializer}
    if overridable:
        notes.append(f"{len(overridable)} initializers are also graph inputs (overridable defaults): renamed, but not "
                     "scaled, split or encrypted; export without keep_initializers_as_inputs to protect them")
    if len(m.functions):
        notes.append(f"{len(m.functions)} model-local functions are kept as they are")
    report = ProtectReport(
        source=source,
        nodes={"before": len(src.graph.node), "after": len(m.graph.node),
               "in_branches": sum(len(g.node) for g in graphs(m.graph)) - len(m.graph.node)},
        ops_before=op_histogram(src), ops_after=ops_after,
        renamed={"tensors": ren.tensors, "initializers": ren.initializers, "nodes": ren.nodes,
                 "io_kept": ren.io_kept, "io_renamed": ren.io_renamed},
        scaled={"layers": sc.layers, "weights": sc.weights, "absorbed": sc.absorbed,
                "compensation_muls": sc.compensation_muls, "by_op": sc.by_op, "skipped": sc.skipped},
        split={"split": sp.split, "constants_to_initializers": sp.constants_to_initializers, "skipped": sp.skipped},
        inserted={"identity_spots": ins.identity_spots, "identity_eligible": ins.identity_eligible,
                  "identity_ops": ins.identity_ops, "identity_kinds": ins.identity_kinds,
                  "branches": ins.branches, "branch_eligible": ins.branch_eligible,
                  "predicate_nodes": ins.predicate_nodes},
        shuffled={"moved": moved_fraction, "order_changed": moved_fraction > 0},
        encrypted=encrypted, metadata_stripped=config.strip_metadata, error_vs_original=error,
        still_visible=visible, bytes={"before": src.ByteSize(), "after": m.ByteSize()},
        deterministic=config.seed is not None, transforms=done, notes=notes)
    return m, report
