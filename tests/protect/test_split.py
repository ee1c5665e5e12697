import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from automp.deploy import runtime
from automp.protect.split import constants_to_initializers, split_constants, split_parts

from ..deploy.util import f32, init, model, rand


def awkward(dtype) -> np.ndarray:
    """Normal values plus every edge case: zeros of both signs, infinities, the largest and subnormal values."""
    fi = np.finfo(dtype)
    special = np.array([0.0, -0.0, np.inf, -np.inf, fi.max, -fi.max, fi.tiny, fi.tiny / 8, -fi.tiny / 4, 1.0, -3.5],
                       dtype=dtype)
    return np.concatenate([special, (np.random.default_rng(0).standard_normal(500) * 10).astype(dtype)])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_parts_add_up_to_the_constant_bit_for_bit(dtype):
    c = awkward(dtype)
    a, b = split_parts(c, np.random.default_rng(1))
    assert a.dtype == b.dtype == dtype
    with np.errstate(over="ignore"):
        total = (a + b).astype(dtype)
    assert np.array_equal(total, c)  # +0 == -0, inf == inf
    finite = np.isfinite(c) & (np.abs(c) >= np.finfo(dtype).tiny) & (c != 0)
    assert np.all(np.abs(a - c)[finite] >= 0.04 * np.abs(c[finite]))  # neither part is close to the constant
    assert np.all(np.abs(b)[finite] >= 0.04 * np.abs(c[finite]))


def test_onnxruntime_adds_the_parts_back_exactly():
    c = awkward(np.float32)
    a, b = split_parts(c, np.random.default_rng(2))
    m = model([helper.make_node("Add", ["a", "b"], ["c"])], [], [f32("c", [len(c)])], [init("a", a), init("b", b)])
    assert np.array_equal(runtime.run(m, {}, optimize=False)["c"], c)


def test_nan_constants_stay_nan():
    c = np.array([np.nan, 1.0], np.float32)
    a, b = split_parts(c, np.random.default_rng(0))
    assert np.isnan(a[0] + b[0]) and a[1] + b[1] == 1.0


def test_constant_nodes_and_identity_aliases_become_initializers():
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(rand(3, seed=1), "k")),
             helper.make_node("Constant", [], ["half"], value_float=0.5),
             helper.make_node("Identity", ["w"], ["w_alias"]), helper.make_node("Identity", ["w_alias"], ["w_alias2"]),
             helper.make_node("MatMul", ["x", "w_alias2"], ["h"]), helper.make_node("Add", ["h", "k"], ["hk"]),
             helper.make_node("Mul", ["hk", "half"], ["y"]), helper.make_node("Identity", ["w"], ["w_out"])]
    src = model(nodes, [f32("x", ["n", 2])], [f32("y", ["n", 3]), f32("w_out", [2, 3])], [init("w", rand(2, 3))])
    m = onnx.ModelProto()
    m.CopyFrom(src)
    assert constants_to_initializers(m) == 4
    assert [n.op_type for n in m.graph.node] == ["MatMul", "Add", "Mul", "Identity"]  # the output alias stays
    assert m.graph.node[0].input[1] == "w" and {"k", "half"} <= {t.name for t in m.graph.initializer}
    feeds = runtime.random_feeds(src, seed=3)
    for k, v in runtime.run(src, feeds).items():
        assert np.array_equal(runtime.run(m, feeds)[k], v)


def test_split_leaves_integers_io_and_custom_domain_readers_alone():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Reshape", ["h", "shape"], ["r"]),
             helper.make_node("BiasGelu", ["r", "bias"], ["y"], domain="com.microsoft")]
    src = model(nodes, [f32("x", ["n", 2])], [f32("y", ["n", 3])],
                [init("w", rand(2, 3)), init("shape", np.array([-1, 3], np.int64)), init("bias", rand(3, seed=1))],
                ms=True)
    m = onnx.ModelProto()
    m.CopyFrom(src)
    res = split_constants(m, np.random.default_rng(0))
    assert res.split == 1 and res.skipped == {"integer (shapes, axes, indices)": 1, "read by a custom-domain op": 1}
    assert m.graph.node[0].op_type == "Add" and m.graph.node[0].output[0] == "w"  # readers keep the name
    assert {"shape", "bias"} <= {t.name for t in m.graph.initializer} and "w" not in {t.name for t in
                                                                                     m.graph.initializer}
    feeds = runtime.random_feeds(src, seed=4)
    assert np.array_equal(runtime.run(m, feeds, optimize=False)["y"], runtime.run(src, feeds, optimize=False)["y"])
    assert all(t.data_type != TensorProto.UNDEFINED for t in m.graph.initializer)
