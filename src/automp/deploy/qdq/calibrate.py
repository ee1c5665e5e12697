"""Run an ONNX model in onnxruntime (CPU) over calibration batches.

Calibration needs the values of intermediate tensors; ORT only returns graph outputs, so we run a copy of the
model with those tensors appended as extra outputs. The same runner measures the error of a quantized model.
"""
from __future__ import annotations

import os
import tempfile
from collections import Counter
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort

from automp.deploy import runtime
from automp.quant.observers import Observer


def model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def check_calib(model: onnx.ModelProto, calib: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Calibration data must hold exactly the model inputs, batch first, all with the same batch size."""
    if not isinstance(calib, dict) or not calib:
        raise ValueError("calibration data must be a non-empty dict {input name: array (batch first)}")
    names = [i.name for i in model_inputs(model)]
    missing, extra = sorted(set(names) - set(calib)), sorted(set(calib) - set(names))
    if missing or extra:
        raise ValueError(f"calibration inputs do not match the model: missing {missing}, unexpected {extra} "
                         f"(model inputs: {names})")
    out = {}
    for vi in model_inputs(model):
        a, elem = np.asarray(calib[vi.name]), vi.type.tensor_type.elem_type
        want = onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else a.dtype
        if np.issubdtype(want, np.floating) != np.issubdtype(a.dtype, np.floating):
            raise TypeError(f"calibration input {vi.name!r} has dtype {a.dtype}; the model expects {want}")
        if a.ndim == 0 or a.shape[0] == 0:
            raise ValueError(f"calibration input {vi.name!r} has shape {a.shape}; expected batch-first samples")
        out[vi.name] = a.astype(want, copy=False)
    sizes = {a.shape[0] for a in out.values()}
    if len(sizes) != 1:
        raise ValueError(f"calibration inputs have different batch sizes: "
                         f"{ {k: v.shape[0] for k, v in out.items()} }")
    return out


def session(model: onnx.ModelProto, extra_outputs: list[str] = (), fuse: bool = True) -> ort.InferenceSession:
    """fuse=False disables ORT's graph optimizations: a QDQ model then runs op by op (DequantizeLinear, float
    Conv/Gemm/MatMul), i.e. the exact QDQ arithmetic instead of ORT's int8 kernels."""
    if extra_outputs:
        m = onnx.ModelProto()
        m.CopyFrom(model)
        have = {o.name for o in m.graph.output}
        m.graph.output.extend(onnx.helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None)
                              for t in extra_outputs if t not in have)
        model = m
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not fuse:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise RuntimeError(f"onnxruntime could not load the model: {e}") from e


def model_batches(model: onnx.ModelProto, calib: dict[str, np.ndarray],
                  wanted: int) -> list[dict[str, np.ndarray]]:
    """Batches of `wanted` samples, or of the model's fixed batch size (then a short last batch is left out)."""
    fixed = runtime.fixed_batch(model)
    n = next(iter(calib.values())).shape[0]
    if fixed and n < fixed:
        raise ValueError(f"model has fixed batch size {fixed} but calibration data has only {n} samples")
    return list(runtime.batches(calib, fixed or wanted, drop_last=fixed is not None))


def observe(model: onnx.ModelProto, calib: dict[str, np.ndarray], observers: dict[str, Observer],
            batch_size: int, progress: Callable[[int, int], None] | None = None) -> int:
    """Feed every calibration batch's value of each observed tensor to its observer; returns samples seen."""
    names = list(observers)
    sess = session(model, names)
    todo = model_batches(model, calib, batch_size)
    for k, feed in enumerate(todo):
        try:
            values = sess.run(names, feed)
        except Exception as e:
            raise RuntimeError(f"onnxruntime failed on calibration batch {k}: {e}") from e
        for name, v in zip(names, values):
            if v.dtype != np.float32:
                raise RuntimeError(f"tensor {name!r} chosen for int8 calibration is {v.dtype}, not float32")
            observers[name].update(v)
        if progress is not None:
            progress(k + 1, len(todo))
    return sum(next(iter(b.values())).shape[0] for b in todo)


def run(model: onnx.ModelProto, calib: dict[str, np.ndarray], batch_size: int) -> dict[str, np.ndarray]:
    """All graph outputs over the calibration samples, concatenated along the batch axis."""
    return runtime.run_batches(session(model), model_batches(model, calib, batch_size))


def rel_errors(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> dict[str, float]:
    """||got - ref|| / ||ref|| per output (float64)."""
    errs = {}
    for name, r in ref.items():
        r64, g64 = r.astype(np.float64), got[name].astype(np.float64)
        errs[name] = float(np.linalg.norm(g64 - r64) / max(np.linalg.norm(r64), 1e-30))
    return errs


def optimized_op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Op histogram of the graph ORT actually executes: shows whether Q/DQ patterns became int8 kernels.
    Informational only, so a model ORT cannot save (e.g. > 2 GB) gives {} rather than an error."""
    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        opts.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        try:
            ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            optimized = onnx.load(opts.optimized_model_filepath)
        except Exception:  # ORT/onnx raise assorted types here; the quantized model itself is unaffected
            return {}
    return dict(Counter(n.op_type for n in optimized.graph.node))
