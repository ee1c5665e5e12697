import numpy as np
import pytest
from onnx import helper

from automp.deploy.passes.fuse import FuseConfig, fuse

from .util import assert_same_outputs, f32, init, model, ops, rand


def test_matmul_add_relu_becomes_fused_gemm():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["y"])]
    before = model(nodes, [f32("x", ["n", 5])], [f32("y", ["n", 7])], [init("w", rand(5, 7, seed=1)),
                                                                       init("b", rand(7, seed=2))])
    assert ops(fuse(before, FuseConfig(activations=False))) == ["Gemm", "Relu"]
    after = fuse(before)
    assert ops(after) == ["FusedGemm"] and after.graph.node[0].domain == "com.microsoft"
    assert_same_outputs(before, after, tol=1e-6)


def test_matmul_add_on_rank3_input_is_not_turned_into_gemm():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    before = model(nodes, [f32("x", ["n", 3, 5])], [f32("y", ["n", 3, 7])],
                   [init("w", rand(5, 7, seed=1)), init("b", rand(7, seed=2))])
    assert ops(fuse(before)) == ["MatMul", "Add"]


@pytest.mark.parametrize("bias_shape", [(1, 6, 1, 1), (6, 1, 1)])
def test_conv_add_sigmoid_fuses_bias_and_activation(bias_shape):
    nodes = [helper.make_node("Conv", ["x", "w", "cb"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "b"], ["cb2"]), helper.make_node("Sigmoid", ["cb2"], ["y"])]
    before = model(nodes, [f32("x", ["n", 3, 6, 6])], [f32("y", ["n", 6, 6, 6])],
                   [init("w", rand(6, 3, 3, 3, seed=1)), init("cb", rand(6, seed=2)),
                    init("b", rand(*bias_shape, seed=3))])
    after = fuse(before)
    assert ops(after) == ["FusedConv"]
    assert_same_outputs(before, after, tol=1e-6)


def test_conv_add_with_last_axis_bias_is_not_folded():
    # a [W]-shaped constant broadcasts along the width axis, not the channels: must not become a conv bias
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Add", ["c", "b"], ["y"])]
    before = model(nodes, [f32("x", ["n", 3, 4, 4])], [f32("y", ["n", 4, 4, 4])],
                   [init("w", rand(4, 3, 1, 1, seed=1)), init("b", rand(4, seed=3))])
    assert ops(fuse(before)) == ["Conv", "Add"]


@pytest.mark.parametrize("residual_used_again", [False, True])
def test_residual_add_layernorm_becomes_skip_layernorm(residual_used_again):
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "g", "b"], ["y"], axis=-1, epsilon=1e-6)]
    outputs = [f32("y", ["n", 4, 8])]
    if residual_used_again:  # pre-LN transformers reuse the residual sum: SkipLayerNormalization's 4th output
        nodes.append(helper.make_node("Relu", ["s"], ["z"]))
        outputs.append(f32("z", ["n", 4, 8]))
    rng = np.random.default_rng(0)
    before = model(nodes, [f32("x", ["n", 4, 8]), f32("r", ["n", 4, 8])], outputs,
                   [init("g", rng.uniform(0.5, 1.5, 8).astype(np.float32)), init("b", rand(8, seed=4))])
    after = fuse(before)
    assert ops(after)[0] == "SkipLayerNormalization" and "LayerNormalization" not in ops(after)
    assert len(after.graph.node) == len(before.graph.node) - 1
    assert_same_outputs(before, after, tol=1e-5)
