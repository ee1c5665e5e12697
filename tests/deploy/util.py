"""Small ONNX model builders and the before/after check every pass test uses."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from automp.deploy import runtime

OPSET = 17


def f32(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def model(nodes, inputs, outputs, inits=(), opset: int = OPSET, ms: bool = False) -> onnx.ModelProto:
    ops = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)), opset_imports=ops)
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def rand(*shape, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, tol: float = 1e-5, seed: int = 1,
                        batch: int = 3, **feed_kw) -> dict:
    """Run both models in ORT CPU with its own rewrites off (so we test our graph, not ORT's) and compare."""
    feeds = runtime.random_feeds(before, batch=batch, seed=seed, **feed_kw)
    ref = runtime.run(before, feeds, optimize=False)
    out = runtime.run(after, feeds, optimize=False)
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    errs = runtime.compare_all(out, ref)
    for name, e in errs.items():
        assert e.nonfinite == 0 and e.rel_l2 <= tol, f"{name}: {e}"
    return errs


def ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]
