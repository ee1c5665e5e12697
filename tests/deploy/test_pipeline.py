import numpy as np
from onnx import helper

from automp.deploy.passes.pipeline import run_pipeline

from .util import assert_same_outputs, f32, init, model, rand


def test_pipeline_records_every_pass_and_preserves_outputs():
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Constant", [], ["perm_w"], value=helper.make_tensor("t", 1, [8, 3, 3, 3],
                                                                                    rand(8 * 3 * 9, seed=1))),
             helper.make_node("Conv", ["x", "perm_w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "g", "b", "m", "v"], ["bn"]),
             helper.make_node("Relu", ["bn"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t1"], perm=[0, 2, 3, 1]),
             helper.make_node("Transpose", ["t1"], ["t2"], perm=[0, 3, 1, 2]),
             helper.make_node("Sigmoid", ["t2"], ["y"]),
             helper.make_node("Neg", ["x"], ["dead"])]
    inits = [init("g", rng.uniform(0.5, 1.5, 8).astype(np.float32)), init("b", rand(8, seed=2)),
             init("m", rand(8, seed=3)), init("v", rng.uniform(0.5, 2, 8).astype(np.float32))]
    before = model(nodes, [f32("x", ["n", 3, 5, 5])], [f32("y", ["n", 8, 5, 5])], inits)
    after, records = run_pipeline(before)
    assert [r.name for r in records] == ["fold_constants", "dce", "fold_bn", "fuse", "reorder", "fold_constants",
                                         "dce"]
    for a, b in zip(records, records[1:]):
        assert a.nodes_after == b.nodes_before
    by = {}
    for r in records:
        by.setdefault(r.name, r)  # first run of each pass
    assert by["dce"].ops_removed == {"Neg": 1}
    assert by["fold_bn"].ops_removed == {"BatchNormalization": 1}
    assert by["fuse"].ops_added == {"FusedConv": 1}
    assert by["reorder"].ops_removed == {"Transpose": 2}
    assert [n.op_type for n in after.graph.node] == ["FusedConv", "Sigmoid"]
    assert_same_outputs(before, after, tol=1e-5)
