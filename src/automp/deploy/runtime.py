"""Run an ONNX model in onnxruntime: sessions, batched runs and seeded inputs. How far its outputs are from a
reference is automp.quant.ptq.compare's measure, the one every optimization is judged by.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

import numpy as np
import onnx
import onnxruntime as ort

ModelLike = onnx.ModelProto | bytes | str | os.PathLike

NP_DTYPE = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
               onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT64: np.int64,
               onnx.TensorProto.INT32: np.int32, onnx.TensorProto.BOOL: np.bool_, onnx.TensorProto.UINT8: np.uint8,
               onnx.TensorProto.INT8: np.int8}


def providers(device: str = "cpu") -> list[str]:
    """cpu: CPU only. cuda: CUDA (error if absent). auto: CUDA when this onnxruntime build has it, else CPU."""
    have = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda" and "CUDAExecutionProvider" not in have:
        raise RuntimeError(f"onnxruntime has no CUDAExecutionProvider (available: {have}); "
                           "install onnxruntime-gpu or use device='cpu'")
    if device in ("cuda", "auto"):
        return (["CUDAExecutionProvider"] if "CUDAExecutionProvider" in have else []) + ["CPUExecutionProvider"]
    raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")


def session(model: ModelLike, device: str = "cpu", optimize: bool = True) -> ort.InferenceSession:
    """optimize=False turns off onnxruntime's own graph rewrites, so a test sees exactly the graph we wrote."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    if isinstance(src, os.PathLike):
        src = os.fspath(src)
    return ort.InferenceSession(src, sess_options=opts, providers=providers(device))


def run(model: ModelLike | ort.InferenceSession, feeds: dict[str, np.ndarray], device: str = "cpu",
        optimize: bool = True) -> dict[str, np.ndarray]:
    sess = model if isinstance(model, ort.InferenceSession) else session(model, device, optimize)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def run_batches(sess: ort.InferenceSession, feeds: Iterable[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Every output over consecutive batches, concatenated along the batch axis (an output without one, a scalar,
    is taken from the first batch)."""
    try:
        outs = [run(sess, feed) for feed in feeds]
    except Exception as e:  # noqa: BLE001 — onnxruntime's own types (InvalidArgument, Fail) are no RuntimeError
        raise RuntimeError(f"onnxruntime could not run the model on these inputs: {e}") from e
    return {k: np.concatenate([o[k] for o in outs]) if outs[0][k].ndim else outs[0][k] for k in outs[0]}


def batches(data: dict[str, np.ndarray], size: int, drop_last: bool) -> Iterator[dict[str, np.ndarray]]:
    """Consecutive batches of `size` samples of batch-first arrays; drop_last leaves out a short last batch (a model
    with a fixed batch size takes no other)."""
    n = len(next(iter(data.values())))
    stop = n - size + 1 if drop_last else n
    for start in range(0, stop, size):
        yield {k: v[start:start + size] for k, v in data.items()}


def fixed_batch(model: onnx.ModelProto) -> int | None:
    """The batch size baked into the model (the first input whose first dim is a number), else None."""
    return next((dims[0] for _, _, dims in input_specs(model) if dims and isinstance(dims[0], int) and dims[0] > 0),
                None)


def input_specs(model: onnx.ModelProto) -> list[tuple[str, int, list[int | str]]]:
    """(name, onnx elem type, dims) of each real graph input (initializers listed as inputs are skipped)."""
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]
        specs.append((vi.name, tt.elem_type, dims))
    return specs


def random_feeds(model: onnx.ModelProto, batch: int = 2, dim: int = 4, seed: int = 0,
                 int_high: int = 2) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input: symbolic first dim = batch, other symbolic dims = dim; floats are
    standard normal, integers uniform in [0, int_high) (token ids and masks need a model-specific range)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, elem, dims in input_specs(model):
        shape = [d if isinstance(d, int) and d > 0 else (batch if k == 0 else dim) for k, d in enumerate(dims)]
        np_type = NP_DTYPE.get(elem)
        if np_type is None:
            raise TypeError(f"input {name!r}: cannot make random data of ONNX type "
                            f"{onnx.TensorProto.DataType.Name(elem)}")
        if np.issubdtype(np_type, np.floating):
            feeds[name] = rng.standard_normal(shape).astype(np_type)
        elif np_type is np.bool_:
            feeds[name] = rng.integers(0, 2, shape).astype(np.bool_)
        else:
            feeds[name] = rng.integers(0, int_high, shape).astype(np_type)
    return feeds
