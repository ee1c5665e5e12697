"""Deployment optimizer: one model in (ONNX file/bytes/ModelProto or a torch module), one ONNX model out.

    model, report = automp.deploy.optimize("model.onnx", precision="fp16")

Graph passes (fold constants, dce, fold BN, fuse, reorder) run first, then the precision change (fp16 by the
training op lists, or int8 by the QDQ PTQ of automp.deploy.qdq), then the result is checked against the FP32 input in
onnxruntime. The output keeps the input's names and float32 I/O types and runs in onnxruntime's CPU provider.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import onnx

from automp.deploy import onnx_io, report, runtime
from automp.deploy.fp16 import Fp16Config, convert_fp16
from automp.deploy.passes.fuse import FuseConfig
from automp.deploy.passes.graph import op_counts
from automp.deploy.passes.pipeline import default_passes, run_pipeline
from automp.deploy.qdq.ptq import PTQConfig, quantize_onnx
from automp.quant.ptq.compare import compare_all

PRECISIONS = ("fp32", "fp16", "int8")
ERROR_SAMPLES = 256


def _signature(model: onnx.ModelProto) -> list[tuple[str, str, int]]:
    inits = {t.name for t in model.graph.initializer}
    return [(kind, v.name, v.type.tensor_type.elem_type) for kind, vals in (("in", model.graph.input),
            ("out", model.graph.output)) for v in vals if v.name not in inits]


def check_calib(model: onnx.ModelProto, calib: dict[str, np.ndarray], source: str = "calibration data"
                ) -> dict[str, np.ndarray]:
    """One batch-first array per model input, matching its name, rank, dtype family and fixed dims. A model with a
    fixed batch size B runs on whole batches of B only, so the samples are cut to a multiple of B (the left-over
    ones dropped; fewer than B is an error)."""
    specs = {name: (elem, dims) for name, elem, dims in runtime.input_specs(model)}
    missing, extra = set(specs) - set(calib), set(calib) - set(specs)
    if missing or extra:
        raise ValueError(f"{source}: arrays must be keyed by the model's input names {sorted(specs)}; "
                         f"missing {sorted(missing)}, unexpected {sorted(extra)}")
    out, batch = {}, None
    for name, (elem, dims) in specs.items():
        arr = np.asarray(calib[name])
        want = runtime.NP_DTYPE.get(elem)
        if arr.ndim != len(dims):
            raise ValueError(f"{source}: {name!r} has shape {arr.shape}, the model expects rank {len(dims)} {dims}")
        if any(isinstance(d, int) and d > 0 and d != got for d, got in zip(dims[1:], arr.shape[1:])):
            raise ValueError(f"{source}: {name!r} has shape {arr.shape}, the model expects {dims} (batch first)")
        if want is not None and np.issubdtype(want, np.floating) != np.issubdtype(arr.dtype, np.floating):
            raise TypeError(f"{source}: {name!r} is {arr.dtype}, the model input is {np.dtype(want).name}")
        if batch is not None and arr.shape[0] != batch:
            raise ValueError(f"{source}: inputs disagree on the batch size ({name!r} has {arr.shape[0]}, "
                             f"others {batch})")
        batch = arr.shape[0]
        out[name] = arr.astype(want) if want is not None else arr
    return _whole_batches(model, out, source)


def _samples(data: dict[str, np.ndarray]) -> int:
    return len(next(iter(data.values())))


def _whole_batches(model: onnx.ModelProto, calib: dict[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """calib cut to a whole number of the model's fixed batches (unchanged for a dynamic batch)."""
    fixed = runtime.fixed_batch(model)
    n = _samples(calib)
    if fixed is None or n % fixed == 0:
        return calib
    if n < fixed:
        name, _, dims = next(s for s in runtime.input_specs(model) if s[2] and s[2][0] == fixed)
        raise ValueError(f"{source}: {n} samples, but the model's batch size is fixed at {fixed} (input {name!r} "
                         f"has shape {dims}); give at least {fixed} samples")
    return {k: v[:n - n % fixed] for k, v in calib.items()}


def _error_data(model: onnx.ModelProto, calib: dict[str, np.ndarray] | None, dropped: int
                ) -> tuple[dict[str, np.ndarray], str]:
    """The inputs the error vs FP32 is measured on (a whole number of batches), and how the report names them."""
    fixed = runtime.fixed_batch(model)
    if calib is None:
        return runtime.random_feeds(model, batch=4, seed=0), "seeded random inputs (no --calib)"
    step = fixed or 1
    take = min(_samples(calib), max(step, ERROR_SAMPLES // step * step))
    note = f", run in batches of {fixed}, the model's fixed batch size" if fixed else ""
    if dropped:
        note += f"; {dropped} left-over calibration samples dropped"
    return {k: v[:take] for k, v in calib.items()}, f"calibration data ({take} samples{note})"


def optimize(model: Any, precision: str = "fp32", calib: dict[str, np.ndarray] | None = None,
             budget: float | None = None, example_inputs=None, input_names=None, output_names=None,
             progress: Callable[[int, int], None] | None = None, source: str | None = None
             ) -> tuple[onnx.ModelProto, dict]:
    """budget: max relative L2 error of any output vs the FP32 input, on calib (else seeded random inputs);
    for int8 the quantizer keeps layers in float to meet it, for fp16/fp32 a miss is an error."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if budget is not None and budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if isinstance(model, onnx.ModelProto):
        src = onnx_io.validate(model, source or "<model>", check_runtime=False)
    elif isinstance(model, (str, bytes, bytearray)) or hasattr(model, "__fspath__"):
        src = onnx_io.load(model, check_runtime=False)
    elif example_inputs is not None:
        src = onnx_io.export_torch(model, example_inputs, input_names, output_names)
    else:
        raise TypeError(f"optimize takes an ONNX model/path/bytes, or a torch module with example_inputs; got "
                        f"{type(model).__name__}")
    source = source or (str(model) if isinstance(model, str) else f"<{type(model).__name__}>")
    ref_session = onnx_io.checked_session(src, source)  # the runtime check of the input, reused for the error
    dropped = 0
    if calib is not None:
        checked = check_calib(src, calib)
        calib, dropped = checked, _samples(calib) - _samples(checked)
    elif precision == "int8":
        raise ValueError("int8 needs calibration data: pass --calib FILE.npz (one batch-first array per model input, "
                         f"keyed by {[n for n, _, _ in runtime.input_specs(src)]})")

    # FusedConv/FusedGemm are float32-only on ORT's CUDA provider and hide Conv/Gemm from the int8 quantizer
    passes = default_passes(FuseConfig(activations=precision == "fp32"))
    model_opt, records = run_pipeline(src, passes)
    fp16_rep = int8_rep = None
    if precision == "fp16":
        model_opt, rep = convert_fp16(model_opt, Fp16Config())
        fp16_rep = rep.to_dict()
    elif precision == "int8":
        model_opt, int8_rep = quantize_onnx(model_opt, calib, PTQConfig(), budget=budget, progress=progress)
    onnx_io.validate(model_opt, f"optimized {source}", check_runtime=False)
    if _signature(model_opt) != _signature(src):
        raise RuntimeError(f"{source}: optimization changed the model's inputs/outputs from {_signature(src)} to "
                           f"{_signature(model_opt)}; this is a bug")
    opt_session = onnx_io.checked_session(model_opt, f"optimized {source}")

    feeds, data = _error_data(src, calib, dropped)
    size = runtime.fixed_batch(src) or _samples(feeds)
    outs, refs = (runtime.run_batches(s, runtime.batches(feeds, size, drop_last=True))
                  for s in (opt_session, ref_session))
    errors = compare_all(outs, refs)
    worst = max(e.rel_l2 for e in errors.values())
    if budget is not None and precision != "int8" and not worst <= budget:
        raise RuntimeError(f"{source}: {precision} output error {worst:.3g} exceeds budget {budget}")
    rep = report.build(source, precision, records, op_counts(src), op_counts(model_opt), errors, data, budget,
                       fp16=fp16_rep, int8=int8_rep, sizes={"before": src.ByteSize(), "after": model_opt.ByteSize()})
    return model_opt, rep


__all__ = ["optimize", "check_calib", "onnx_io", "runtime", "PRECISIONS"]
