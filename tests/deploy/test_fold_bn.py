import numpy as np
import pytest
from onnx import helper

from automp.deploy.passes.fold_bn import fold_bn
from automp.deploy.passes.dce import dce

from .util import assert_same_outputs, f32, init, model, ops, rand


def _bn_inits(prefix, c, seed):
    rng = np.random.default_rng(seed)
    return [init(f"{prefix}_g", rng.uniform(0.5, 2, c).astype(np.float32)),
            init(f"{prefix}_b", rng.standard_normal(c).astype(np.float32)),
            init(f"{prefix}_m", rng.standard_normal(c).astype(np.float32)),
            init(f"{prefix}_v", rng.uniform(0.2, 3, c).astype(np.float32))]


def _bn(x, y, p, eps=1e-5):
    return helper.make_node("BatchNormalization", [x, f"{p}_g", f"{p}_b", f"{p}_m", f"{p}_v"], [y], epsilon=eps,
                            name=p)


@pytest.mark.parametrize("group", [1, 2])
def test_conv_bn_folds_into_conv(group):
    nodes = [helper.make_node("Conv", ["x", "w"] + (["cb"] if group == 1 else []), ["c"], pads=[1, 1, 1, 1],
                              group=group),
             _bn("c", "y", "bn")]
    before = model(nodes, [f32("x", ["n", 4, 5, 5])], [f32("y", ["n", 6, 5, 5])],
                   [init("w", rand(6, 4 // group, 3, 3, seed=1)), init("cb", rand(6, seed=2))] + _bn_inits("bn", 6, 3))
    after = dce(fold_bn(before))
    assert ops(after) == ["Conv"]
    assert_same_outputs(before, after, tol=1e-5)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_bn_folds_into_gemm(trans_b):
    w = rand(5, 7, seed=1) if trans_b == 0 else rand(7, 5, seed=1)
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["h"], transB=trans_b, alpha=0.5, beta=2.0), _bn("h", "y", "bn")]
    before = model(nodes, [f32("x", ["n", 5])], [f32("y", ["n", 7])],
                   [init("w", w), init("c", rand(7, seed=2))] + _bn_inits("bn", 7, 3))
    after = dce(fold_bn(before))
    assert ops(after) == ["Gemm"]
    assert_same_outputs(before, after, tol=1e-5)


@pytest.mark.parametrize("with_add", [False, True])
def test_matmul_bn_folds_into_matmul_add(with_add):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h" if with_add else "hb"])]
    inits = [init("w", rand(5, 7, seed=1))] + _bn_inits("bn", 7, 3)
    if with_add:
        nodes.append(helper.make_node("Add", ["b", "h"], ["hb"]))
        inits.append(init("b", rand(7, seed=2)))
    nodes.append(_bn("hb", "y", "bn"))
    before = model(nodes, [f32("x", ["n", 5])], [f32("y", ["n", 7])], inits)
    after = dce(fold_bn(before))
    assert ops(after) == ["MatMul", "Add"]
    assert_same_outputs(before, after, tol=1e-5)


def test_standalone_bn_becomes_mul_add_and_shared_conv_output_is_not_folded():
    # the conv output also feeds a second branch, so the BN must not be baked into the conv weights
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), _bn("c", "y", "bn"), helper.make_node("Relu", ["c"], ["z"])]
    before = model(nodes, [f32("x", ["n", 3, 4, 4])], [f32("y", ["n", 4, 4, 4]), f32("z", ["n", 4, 4, 4])],
                   [init("w", rand(4, 3, 1, 1, seed=1))] + _bn_inits("bn", 4, 3))
    after = dce(fold_bn(before))
    assert ops(after) == ["Conv", "Mul", "Add", "Relu"]
    assert_same_outputs(before, after, tol=1e-5)


def test_training_mode_bn_is_left_alone():
    nodes = [helper.make_node("BatchNormalization", ["x", "bn_g", "bn_b", "bn_m", "bn_v"], ["y"], training_mode=1)]
    before = model(nodes, [f32("x", ["n", 3, 2])], [f32("y", ["n", 3, 2])], _bn_inits("bn", 3, 1))
    assert ops(fold_bn(before)) == ["BatchNormalization"]
