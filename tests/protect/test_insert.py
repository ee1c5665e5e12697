import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from automp.deploy import runtime
from automp.deploy.passes.graph import copy_model
from automp.protect.insert import IDENTITY_KINDS, _Builder, _predicate, insert
from automp.quant.ptq.compare import compare

from ..deploy.util import model


def inserted(src: onnx.ModelProto, ratio: float, seed: int = 0):
    m = copy_model(src)
    res = insert(m, np.random.default_rng(seed), ratio)
    onnx.checker.check_model(m, full_check=True)
    return m, res


@pytest.mark.parametrize("name", ["cnn", "encoder"])
def test_identity_ops_and_branches_change_no_output_bit(exported, name):
    src = exported(name)
    m, res = inserted(src, 1.0)
    assert res.identity_spots == res.identity_eligible > 0 and res.branches == res.branch_eligible > 0
    feeds = runtime.random_feeds(src, batch=3, seed=5)
    ref, got = runtime.run(src, feeds, optimize=False), runtime.run(m, feeds, optimize=False)
    for k in ref:
        assert np.abs(ref[k]).max() > 0 and np.array_equal(got[k], ref[k]), k


def test_all_identity_kinds_are_used(exported):
    _, res = inserted(exported("encoder"), 1.0, seed=1)
    assert set(res.identity_kinds) == set(IDENTITY_KINDS)
    assert res.identity_ops == 2 * res.identity_spots


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_ratio_is_the_fraction_of_eligible_spots(exported, ratio):
    _, res = inserted(exported("cnn"), ratio)
    assert res.identity_spots == round(ratio * res.identity_eligible)
    assert res.branches == round(ratio * res.branch_eligible)


@pytest.mark.parametrize("kind", [0, 1, 2])
def test_every_opaque_predicate_is_true(kind):
    for seed in range(8):
        b = _Builder(onnx.ModelProto(), np.random.default_rng(seed))
        nodes = _predicate(b, kind)
        out = helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.BOOL, [])
        m = model(nodes, [], [out], b.inits)
        assert runtime.run(m, {}, optimize=False)[nodes[-1].output[0]].item() is True


def test_else_branches_are_decoys_with_the_same_type_and_shape(exported):
    """Feed the If conditions from an input: true reproduces the model, false runs the decoys (other values, same
    shapes). So the else-branches are real computations, not copies."""
    src = exported("convnet_bn")
    m, res = inserted(src, 1.0)
    ifs = [n for n in m.graph.node if n.op_type == "If"]
    assert len(ifs) == res.branches > 0
    for n in ifs:
        n.input[0] = "flip"
    m.graph.input.append(helper.make_tensor_value_info("flip", TensorProto.BOOL, []))
    feeds = runtime.random_feeds(src, batch=3, seed=2)
    ref = runtime.run(src, feeds, optimize=False)["logits"]
    real = runtime.run(m, {**feeds, "flip": np.array(True)}, optimize=False)["logits"]
    decoy = runtime.run(m, {**feeds, "flip": np.array(False)}, optimize=False)["logits"]
    assert np.array_equal(real, ref)
    assert decoy.shape == ref.shape and compare(decoy, ref).rel_l2 > 1e-2


def test_ratio_zero_changes_nothing(exported):
    src = exported("cnn")
    m, res = inserted(src, 0.0)
    assert m.SerializeToString() == src.SerializeToString()
    assert res.identity_spots == res.branches == 0 and res.identity_eligible > 0
