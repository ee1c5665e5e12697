import numpy as np
import onnx
import pytest
from onnx import helper

from automp.protect.order import random_topological_order, shuffle

from ..deploy.util import f32, init, model, rand


def wide() -> onnx.ModelProto:
    """Eight independent Relu->Neg chains summed up: many valid orders."""
    nodes = []
    for k in range(8):
        nodes += [helper.make_node("Relu", ["x"], [f"r{k}"]), helper.make_node("Neg", [f"r{k}"], [f"n{k}"])]
    nodes.append(helper.make_node("Sum", [f"n{k}" for k in range(8)], ["y"]))
    return model(nodes, [f32("x", [3])], [f32("y", [3])])


def is_topological(graph: onnx.GraphProto) -> bool:
    seen = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    for n in graph.node:
        if not all(i in seen for i in n.input if i):
            return False
        seen.update(n.output)
    return True


def test_orders_are_valid_random_and_reproducible():
    orders = set()
    for seed in range(5):
        m = wide()
        moved = shuffle(m.graph, np.random.default_rng(seed))
        assert is_topological(m.graph) and moved > 0
        onnx.checker.check_model(m)
        orders.add(tuple(n.output[0] for n in m.graph.node))
    assert len(orders) == 5
    again = [random_topological_order(wide().graph, np.random.default_rng(3)) for _ in range(2)]
    assert again[0] == again[1]


def test_a_body_reading_an_outer_tensor_comes_after_its_producer():
    then_g = helper.make_graph([helper.make_node("Relu", ["h"], ["t"])], "then", [], [f32("t", [2])])
    else_g = helper.make_graph([helper.make_node("Neg", ["h"], ["e"])], "else", [], [f32("e", [2])])
    nodes = [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["x"], ["unrelated"]),
             helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    m = model(nodes, [f32("x", [2])], [f32("y", [2]), f32("unrelated", [2])], [init("c", np.array(True))])
    for seed in range(10):
        order = random_topological_order(m.graph, np.random.default_rng(seed))
        assert order.index(0) < order.index(2)


def test_a_cycle_is_reported_with_a_node_on_it():
    g = helper.make_graph([helper.make_node("Relu", ["b"], ["a"], name="first"),
                           helper.make_node("Relu", ["a"], ["b"], name="second")], "g", [], [f32("a", [1])])
    with pytest.raises(ValueError, match="cycle through node 'first'"):
        random_topological_order(g, np.random.default_rng(0))


def test_a_chain_has_only_its_own_order():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    m = model(nodes, [f32("x", [1, 2])], [f32("y", [1, 2])], [init("w", rand(2, 2))])
    assert shuffle(m.graph, np.random.default_rng(0)) == 0.0
