import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from automp.deploy import runtime
from automp.deploy.passes.graph import copy_model
from automp.protect.scale import _reshaped, random_scales, scale_weights
from automp.quant.ptq.compare import compare

from ..deploy.util import f32, init, model, rand


def scaled(src: onnx.ModelProto, seed: int = 0, allow_mul: bool = True, tol: float = 1e-6, **feed_kw):
    """scale_weights on a copy; checks the result is valid and computes what src computes (relative L2 <= tol)."""
    out = copy_model(src)
    res = scale_weights(out, np.random.default_rng(seed), 4.0, allow_mul)
    onnx.checker.check_model(out, full_check=True)
    feeds = runtime.random_feeds(src, batch=3, seed=seed + 1, **feed_kw)
    ref, got = runtime.run(src, feeds, optimize=False), runtime.run(out, feeds, optimize=False)
    for k in ref:
        assert np.abs(ref[k]).max() > 0
        assert compare(got[k], ref[k]).rel_l2 <= tol, k
    return out, res


def weight_of(m: onnx.ModelProto, op: str, k: int = 1, nth: int = 0) -> np.ndarray:
    node = [n for n in m.graph.node if n.op_type == op][nth]
    return numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == node.input[k]))


def mlp() -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["y"])]
    return model(nodes, [f32("x", ["n", 5])], [f32("y", ["n", 3])],
                 [init("w1", rand(5, 7)), init("b1", rand(7, seed=1)), init("w2", rand(7, 3, seed=2)),
                  init("b2", rand(3, seed=3))])


def test_a_hidden_layer_scale_is_absorbed_by_the_next_layer():
    src = mlp()
    out, res = scaled(src)
    assert res.layers == 2 and res.absorbed == 1 and res.compensation_muls == 1  # the output layer needs its Mul
    ratio = weight_of(out, "MatMul", nth=0) / rand(5, 7)
    s = ratio[0]
    np.testing.assert_allclose(ratio, np.broadcast_to(s, ratio.shape), rtol=1e-6)  # one factor per column
    assert np.all((s >= 0.25) & (s <= 4) & (np.abs(np.log2(s)) >= 0.5))
    bias = numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == out.graph.node[1].input[1]))
    np.testing.assert_allclose(bias, rand(7, seed=1) * s, rtol=1e-6)  # the bias Add carried the scale


def test_allow_mul_false_scales_only_layers_absorbed_everywhere():
    out, res = scaled(mlp(), allow_mul=False)
    assert res.layers == 1 and res.compensation_muls == 0 and not any(n.op_type == "Mul" for n in out.graph.node)
    assert res.skipped == {"Add": 1}  # the output bias: the output layer was left for the constant split


@pytest.mark.parametrize("group", [1, 2, 4])
def test_grouped_and_depthwise_convs_absorb_the_previous_scale(group):
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w2"], ["y"], group=group)]
    src = model(nodes, [f32("x", ["n", 3, 8, 8])], [f32("y", ["n", 8, 2, 2])],
                [init("w1", rand(4, 3, 3, 3)), init("b1", rand(4, seed=1)), init("w2", rand(8, 4 // group, 3, 3))])
    _, res = scaled(src)
    assert res.by_op == {"Conv": 2} and res.absorbed == 1 and res.compensation_muls == 1


def bn_net(var: np.ndarray) -> onnx.ModelProto:
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "g", "b", "mu", "var"], ["bn"]),
             helper.make_node("Relu", ["bn"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["gap"]),
             helper.make_node("Flatten", ["gap"], ["f"]), helper.make_node("Gemm", ["f", "wf"], ["y"], transB=1)]
    return model(nodes, [f32("x", ["n", 3, 5, 5])], [f32("y", ["n", 2])],
                 [init("w", rand(4, 3, 3, 3)), init("g", rand(4, seed=1) + 2), init("b", rand(4, seed=2)),
                  init("mu", rand(4, seed=3)), init("var", var.astype(np.float32)), init("wf", rand(2, 4, seed=4))])


def test_batchnorm_absorbs_the_conv_scale_and_its_own_flows_through_pool_and_flatten():
    out, res = scaled(bn_net(np.array([0.5, 1.0, 2.0, 1.5])))
    assert res.by_op == {"Conv": 1, "BatchNormalization": 1, "Gemm": 1} and res.absorbed == 2
    assert res.compensation_muls == 1  # only the Gemm feeding the graph output


def test_a_batchnorm_with_near_zero_variance_gets_a_mul_instead():
    """var' = s^2 (var + eps) - eps goes to zero or below for a dead channel when s < sqrt(2); the conv's scale is
    then undone by a Mul before the BN rather than folded into it, and the output is still right."""
    var = np.array([1e-9, 1.0, 2.0, 1e-9])
    paths = set()
    for seed in range(6):
        out, res = scaled(bn_net(var), seed=seed, tol=1e-5)
        s = weight_of(out, "Conv")[:, 0, 0, 0] / rand(4, 3, 3, 3)[:, 0, 0, 0]
        folds = bool(np.all(s ** 2 * (var + 1e-5) - 1e-5 > 1e-5))
        assert (res.absorbed, res.compensation_muls) == ((2, 1) if folds else (1, 2))
        paths.add(folds)
    assert paths == {True, False}


def test_channels_are_followed_through_transpose_and_reduce():
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("ReduceMean", ["c"], ["m"], axes=[3], keepdims=0),
             helper.make_node("Transpose", ["m"], ["t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "w2"], ["y"])]
    src = model(nodes, [f32("x", ["n", 3, 6, 6])], [f32("y", ["n", 4, 2])],
                [init("w", rand(5, 3, 3, 3)), init("w2", rand(5, 2, seed=1))], opset=17)
    _, res = scaled(src)
    assert res.absorbed == 1 and res.compensation_muls == 1


def test_embedding_and_layernorm_are_scaled_too():
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"]),
             helper.make_node("LayerNormalization", ["e", "gamma", "beta"], ["ln"], axis=-1),
             helper.make_node("MatMul", ["ln", "w"], ["y"])]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 5])
    src = model(nodes, [ids], [f32("y", ["n", 5, 3])],
                [init("emb", rand(10, 8)), init("gamma", rand(8, seed=1) + 1), init("beta", rand(8, seed=2)),
                 init("w", rand(8, 3, seed=3))])
    _, res = scaled(src, int_high=10)
    assert res.by_op == {"Gather": 1, "LayerNormalization": 1, "MatMul": 1}
    assert res.absorbed == 1  # LayerNorm's scale goes into the MatMul; the embedding's stops at the LayerNorm


def test_a_weight_shared_by_two_layers_gets_one_copy_per_layer():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w"], ["y"])]
    src = model(nodes, [f32("x", ["n", 6])], [f32("y", ["n", 6])], [init("w", rand(6, 6))])
    out, res = scaled(src)
    a, b = (n.input[1] for n in out.graph.node if n.op_type == "MatMul")
    assert a != b and "w" not in {t.name for t in out.graph.initializer}
    assert res.weights == 2 and res.absorbed == 1


def test_reshape_rule_keeps_a_channel_only_when_the_dims_behind_it_match():
    assert _reshaped(["b", 16, 1, 1], ["unk", 16], -3, 16) == -1  # dims before the channel do not matter
    assert _reshaped(["b", 6, 32], ["b", 6, 1, 32], -1, 32) == -1
    assert _reshaped(["b", 16, 4, 4], ["b", 16, 16], -3, 16) == -2
    assert _reshaped(["b", 4, 8], ["b", 32], -1, 8) is None  # channels merged with another axis
    assert _reshaped(["b", 32], ["b", 4, 8], -1, 32) is None  # channel axis split
    assert _reshaped(["b", 16, "h"], ["b", 16, None], -2, 16) is None  # unknown dims prove nothing
    assert _reshaped(None, ["b", 16], -1, 16) is None


def test_random_scales_are_positive_bounded_and_never_near_one():
    s = random_scales(np.random.default_rng(0), 20000, 4.0)
    assert s.min() >= 0.25 and s.max() <= 4.0 and np.abs(np.log2(s)).min() >= 0.5
    assert (s < 1).mean() == pytest.approx(0.5, abs=0.02)
