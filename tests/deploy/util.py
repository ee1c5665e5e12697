"""Small ONNX model builders and the before/after check every pass test uses."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from automp.deploy import onnx_io, runtime
from automp.quant.ptq.compare import compare_all

OPSET = 17


def f32(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def model(nodes, inputs, outputs, inits=(), opset: int = OPSET, ms: bool = False) -> onnx.ModelProto:
    ops = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    m = onnx_io.fit_ir_version(helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(inits)),
                                                 opset_imports=ops))
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
    errs = compare_all(out, ref)
    for name, e in errs.items():
        assert e.nonfinite == 0 and e.rel_l2 <= tol, f"{name}: {e}"
    return errs


def ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def convnet(batch: int | str = "n") -> onnx.ModelProto:
    """Conv -> BN -> ReLU -> global pool -> linear head on [batch, 3, 8, 8] images: every pass has work to do."""
    rng = np.random.default_rng(0)
    bn = [init("g", rng.uniform(0.5, 1.5, 8).astype(np.float32)), init("be", rand(8, seed=7, scale=0.1)),
          init("mu", rand(8, seed=8, scale=0.1)), init("var", rng.uniform(0.5, 2, 8).astype(np.float32))]
    nodes = [helper.make_node("Conv", ["image", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("BatchNormalization", ["c1", "g", "be", "mu", "var"], ["b1"], name="bn1"),
             helper.make_node("Relu", ["b1"], ["r1"], name="relu1"),
             helper.make_node("GlobalAveragePool", ["r1"], ["gap"], name="gap"),
             helper.make_node("Flatten", ["gap"], ["flat"], name="flat"),
             helper.make_node("MatMul", ["flat", "wf"], ["mm"], name="fc"),
             helper.make_node("Add", ["mm", "bf"], ["logits"], name="fc_bias")]
    inits = [init("w1", rand(8, 3, 3, 3, seed=1, scale=0.3)), init("wf", rand(8, 5, seed=2, scale=0.5)),
             init("bf", rand(5, seed=3, scale=0.1))] + bn
    return model(nodes, [f32("image", [batch, 3, 8, 8])], [f32("logits", [batch, 5])], inits, opset=17)
