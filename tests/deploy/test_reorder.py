import numpy as np
from onnx import helper

from automp.deploy.passes.reorder import reorder

from .util import assert_same_outputs, f32, init, model, ops


def _i64(name, vals):
    return init(name, np.asarray(vals, np.int64))


def test_slice_moves_before_unary_ops():
    nodes = [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Relu", ["t"], ["r"]),
             helper.make_node("Slice", ["r", "st", "en", "ax"], ["y"])]
    before = model(nodes, [f32("x", ["n", 10, 6])], [f32("y", ["n", 1, 6])],
                   [_i64("st", [0]), _i64("en", [1]), _i64("ax", [1])])
    after = reorder(before)
    assert ops(after) == ["Slice", "Tanh", "Relu"]
    assert_same_outputs(before, after, tol=0)


def test_transpose_pairs_cancel_or_merge():
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[0, 2, 1, 3]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[0, 2, 1, 3]),   # cancels the first
             helper.make_node("Relu", ["b"], ["c"]),
             helper.make_node("Transpose", ["c"], ["d"], perm=[0, 3, 1, 2]),
             helper.make_node("Transpose", ["d"], ["y"], perm=[0, 2, 1, 3])]  # merges with the previous one
    before = model(nodes, [f32("x", ["n", 2, 3, 4])], [f32("y", ["n", 2, 4, 3])])
    after = reorder(before)
    assert ops(after) == ["Relu", "Transpose"]
    assert_same_outputs(before, after, tol=0)


def test_transpose_with_second_reader_is_kept():
    nodes = [helper.make_node("Transpose", ["x"], ["a"], perm=[1, 0]),
             helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0]),
             helper.make_node("Add", ["a", "a"], ["z"]), helper.make_node("Relu", ["b"], ["y"])]
    before = model(nodes, [f32("x", [3, 3])], [f32("y", [3, 3]), f32("z", [3, 3])])
    after = reorder(before)
    assert ops(after) == ["Transpose", "Add", "Relu"]
    assert_same_outputs(before, after, tol=0)


def test_reshape_chain_collapses_but_not_when_shape_copies_a_dim():
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["a"]), helper.make_node("Reshape", ["a", "s2"], ["b"]),
             helper.make_node("Reshape", ["b", "s3"], ["y"])]
    before = model(nodes, [f32("x", [4, 6])], [f32("y", [3, 8])],
                   [_i64("s1", [2, 12]), _i64("s2", [24, -1]), _i64("s3", [3, 8])])
    after = reorder(before)
    assert ops(after) == ["Reshape"]
    assert_same_outputs(before, after, tol=0)
    zero = model([helper.make_node("Reshape", ["x", "s1"], ["a"]), helper.make_node("Reshape", ["a", "s0"], ["y"])],
                 [f32("x", [4, 6])], [f32("y", [2, 12])], [_i64("s1", [2, 12]), _i64("s0", [0, -1])])
    assert ops(reorder(zero)) == ["Reshape", "Reshape"]
