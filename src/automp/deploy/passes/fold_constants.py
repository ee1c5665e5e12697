"""Constant folding: a node whose inputs are all constants computes the same thing on every run, so compute it
once now (with ONNX's reference evaluator) and store the result as an initializer.

Skipped on purpose: random ops (a fresh draw each run is their meaning), nodes with subgraphs, nodes that write a
graph output (the output name must stay a node output for every runtime), and results much larger than their
inputs (ConstantOfShape/Expand/Tile would bloat the file for a negligible runtime saving).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from automp.deploy.passes.graph import Graph, copy_model, has_subgraph, remove_nodes

NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                    "Bernoulli", "Dropout"}
MAX_GROWTH_ELEMS = 1 << 16  # fold a growing op only if its output stays this small


def _evaluate(node: onnx.NodeProto, values: dict[str, np.ndarray], opsets: dict[str, int]) -> list[np.ndarray]:
    inputs = [i for i in node.input if i]
    graph = helper.make_graph([node], "fold", [helper.make_empty_tensor_value_info(i) for i in dict.fromkeys(inputs)],
                              [helper.make_empty_tensor_value_info(o) for o in node.output if o])
    ev = ReferenceEvaluator(graph, opsets=opsets)
    return ev.run(None, {i: values[i] for i in inputs})


def fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    out = copy_model(model)
    g = Graph(out)
    opsets = {o.domain: o.version for o in out.opset_import}
    values: dict[str, np.ndarray] = {}
    folded: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []
    for node in out.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in NONDETERMINISTIC or has_subgraph(node):
            continue
        if any(o in g.graph_outputs for o in node.output):
            continue
        ins = [i for i in node.input if i]
        if not all(i in values or g.is_const(i) for i in ins):
            continue
        for i in ins:
            if i not in values:
                values[i] = g.const(i)
        if any(values[i] is None for i in ins):
            continue
        try:
            results = _evaluate(node, values, opsets)
        except Exception:  # noqa: BLE001 — an op the evaluator lacks simply stays a node
            continue
        in_size = sum(values[i].size for i in ins)
        grown = sum(np.asarray(r).size for r in results) > max(in_size, MAX_GROWTH_ELEMS)
        if grown and node.op_type != "Constant":
            continue
        for name, val in zip([o for o in node.output if o], results):
            values[name] = np.asarray(val)
            new_inits.append(numpy_helper.from_array(values[name], name))
        folded.append(node)
    remove_nodes(out, folded)
    out.graph.initializer.extend(new_inits)
    return out
