from onnx import helper

from automp.deploy.passes.dce import dce

from .util import assert_same_outputs, f32, init, model, ops, rand


def test_dce_removes_unreachable_nodes_and_initializers_but_keeps_inputs():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Add", ["r", "b"], ["y"]),
        helper.make_node("Mul", ["x", "unused_w"], ["dead1"]),
        helper.make_node("Sigmoid", ["dead1"], ["dead2"]),
    ]
    before = model(nodes, [f32("x", ["n", 3]), f32("extra", [2])], [f32("y", ["n", 3])],
                   [init("b", rand(3)), init("unused_w", rand(3)), init("orphan", rand(5))])
    after = dce(before)
    assert ops(after) == ["Relu", "Add"]
    assert {t.name for t in after.graph.initializer} == {"b"}
    assert [i.name for i in after.graph.input] == ["x", "extra"]
    assert len(before.graph.node) == 4
    assert_same_outputs(before, after, tol=0)
