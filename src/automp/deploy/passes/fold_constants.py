"""Constant folding: a node whose inputs are all constants computes the same thing on every run, so compute it
once now (with ONNX's reference evaluator) and store the result as an initializer.

Skipped on purpose: random ops (a fresh draw each run is their meaning), nodes with subgraphs, nodes that write a
graph output (the output name must stay a node output for every runtime), and results much larger than their
inputs (ConstantOfShape/Expand/Tile would bloat the file for a negligible runtime saving).

Shapes count as constants where the model declares them: Shape/Size of a tensor whose inferred shape is static,
and Gather of static entries of a partly dynamic shape (exporters compute Reshape targets this way), fold too.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from automp.deploy.passes.graph import (Graph, attr, copy_model, has_subgraph, infer_shapes, remove_nodes, static_shape,
                                        value_types)

NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                    "Bernoulli", "Dropout"}
MAX_GROWTH_ELEMS = 1 << 16  # fold a growing op only if its output stays this small


def _evaluate(node: onnx.NodeProto, values: dict[str, np.ndarray], opsets: dict[str, int]) -> list[np.ndarray]:
    inputs = [i for i in node.input if i]
    graph = helper.make_graph([node], "fold", [helper.make_empty_tensor_value_info(i) for i in dict.fromkeys(inputs)],
                              [helper.make_empty_tensor_value_info(o) for o in node.output if o])
    ev = ReferenceEvaluator(graph, opsets=opsets)
    return ev.run(None, {i: values[i] for i in inputs})


def _shape_value(node: onnx.NodeProto, types, partial: dict[str, list], g: Graph,
                 values: dict[str, np.ndarray]) -> np.ndarray | None:
    """Value of a Shape/Size/Gather-of-shape node from statically known dims; partly known Shapes go to `partial`."""
    if node.op_type in ("Shape", "Size"):
        dims = static_shape(types, node.input[0])
        if dims is None:
            return None
        if node.op_type == "Size":
            return np.asarray(np.prod(dims), np.int64) if None not in dims else None
        dims = dims[attr(node, "start", 0):attr(node, "end", len(dims))]
        if None in dims:
            partial[node.output[0]] = dims
            return None
        return np.asarray(dims, np.int64)
    if node.op_type == "Gather" and node.input[0] in partial and attr(node, "axis", 0) == 0:
        idx = values.get(node.input[1], g.const(node.input[1]))
        dims = partial[node.input[0]]
        if idx is None or not np.all((idx >= -len(dims)) & (idx < len(dims))):
            return None
        picked = np.asarray(dims, dtype=object)[idx]
        return None if np.any(picked == None) else np.asarray(picked, np.int64)  # noqa: E711 — elementwise
    return None


def fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    out = copy_model(model)
    g = Graph(out)
    shape_ops = any(n.op_type in ("Shape", "Size") for n in out.graph.node)
    types = value_types(infer_shapes(out)) if shape_ops else {}
    partial: dict[str, list] = {}
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
        shaped = _shape_value(node, types, partial, g, values) if shape_ops else None
        if shaped is not None:
            values[node.output[0]] = shaped
            new_inits.append(numpy_helper.from_array(shaped, node.output[0]))
            folded.append(node)
            continue
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
