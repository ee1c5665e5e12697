import numpy as np
from onnx import TensorProto, helper

from automp.deploy.passes.fold_constants import fold_constants

from .util import assert_same_outputs, f32, init, model, ops, rand


def _model():
    # y = x @ (W^T * 2) + reshape(b, shape-of-constant) : everything but the MatMul/Add is constant
    w, b = rand(6, 4, seed=2), rand(6, seed=3)
    nodes = [
        helper.make_node("Constant", [], ["two"], value=helper.make_tensor("t", 1, [], [2.0])),
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("Mul", ["wt", "two"], ["w2"]),
        helper.make_node("Shape", ["b"], ["bshape"]),
        helper.make_node("Reshape", ["b", "bshape"], ["b2"]),
        helper.make_node("MatMul", ["x", "w2"], ["h"]),
        helper.make_node("Add", ["h", "b2"], ["y"]),
        helper.make_node("RandomNormal", [], ["noise"], shape=[1], dtype=1),
        helper.make_node("Mul", ["noise", "two"], ["z"]),
    ]
    return model(nodes, [f32("x", ["n", 4])], [f32("y", ["n", 6]), f32("z", [1])], [init("w", w), init("b", b)])


def test_fold_constants_replaces_constant_subgraph_and_keeps_outputs():
    before = _model()
    after = fold_constants(before)
    assert ops(before).count("Constant") == 1 and "Transpose" in ops(before)
    # Constant, Transpose, Mul(w), Shape, Reshape folded; MatMul, Add, RandomNormal and its Mul stay
    assert sorted(ops(after)) == sorted(["MatMul", "Add", "RandomNormal", "Mul"])
    assert len(before.graph.node) == 9  # the pass returned a copy; the input is untouched
    feeds_model = before
    # the random branch differs run to run, so compare only the deterministic output
    del feeds_model.graph.output[1:]
    del after.graph.output[1:]
    assert_same_outputs(feeds_model, after, tol=1e-6)


def test_fold_constants_values_match_numpy():
    after = fold_constants(_model())
    inits = {t.name: np.frombuffer(t.raw_data, np.float32) if t.raw_data else None for t in after.graph.initializer}
    w = rand(6, 4, seed=2)
    np.testing.assert_allclose(inits["w2"].reshape(4, 6), w.T * 2, rtol=1e-6)


def test_static_entries_of_a_dynamic_shape_fold():
    # the exporter pattern: reshape target = concat(-1, shape(x)[2]); dim 2 is declared static (6), dim 0 is not
    i64 = lambda name, v: init(name, np.asarray(v, np.int64))  # noqa: E731
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "two"], ["d2"], axis=0),
             helper.make_node("Unsqueeze", ["d2", "zero"], ["d2u"]),
             helper.make_node("Concat", ["minus1", "d2u"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["flat"]),
             helper.make_node("Gather", ["s", "zero_s"], ["batch"], axis=0),  # dynamic: must stay
             helper.make_node("Relu", ["flat"], ["y"])]
    before = model(nodes, [f32("x", ["n", 4, 6])],
                   [f32("y", ["m", 6]), helper.make_tensor_value_info("batch", TensorProto.INT64, [])],
                   [i64("two", 2), i64("zero", [0]), i64("minus1", [-1]), i64("zero_s", 0)])
    after = fold_constants(before)
    assert sorted(ops(after)) == ["Gather", "Relu", "Reshape", "Shape"]  # Gather(2)+Unsqueeze+Concat folded
    target = next(t for t in after.graph.initializer if t.name == "target")
    np.testing.assert_array_equal(np.frombuffer(target.raw_data, np.int64), [-1, 6])
    assert_same_outputs(before, after, tol=0)
