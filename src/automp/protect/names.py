"""Walking every graph of a model (the main graph and the If/Loop/Scan bodies nested in it) and making names that
collide with nothing in any of them.

ONNX scoping is lexical and a body may read any outer name, so a name is unique across the whole model, not per
graph; the transforms rely on that (a rename is one global map) and keep it true (every name they add is fresh).
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import onnx

FLOAT_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64}


def graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every body nested in it, outer first."""
    yield graph
    for node in graph.node:
        for a in node.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            for sub in subs:
                yield from graphs(sub)


def tensor_names(graph: onnx.GraphProto) -> list[str]:
    """Every tensor name defined or read in `graph` and its bodies, in a fixed order (first appearance)."""
    seen: dict[str, None] = {}
    for g in graphs(graph):
        for v in list(g.input) + list(g.initializer) + list(g.output) + list(g.value_info):
            seen.setdefault(v.name, None)
        for s in g.sparse_initializer:
            seen.setdefault(s.values.name, None)
        for n in g.node:
            for t in list(n.input) + list(n.output):
                if t:
                    seen.setdefault(t, None)
    return list(seen)


def implicit_inputs(node: onnx.NodeProto) -> list[str]:
    """Outer names a node's bodies read (defined neither in the body nor by the body's own nodes)."""
    found: dict[str, None] = {}
    for a in node.attribute:
        for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            local = {v.name for v in list(sub.input) + list(sub.initializer)} | {o for n in sub.node for o in n.output}
            for n in sub.node:
                for t in list(n.input) + implicit_inputs(n):
                    if t and t not in local:
                        found.setdefault(t, None)
            for o in sub.output:
                if o.name not in local:
                    found.setdefault(o.name, None)
    return list(found)


class Fresh:
    """Hands out names unused anywhere in the model (temporary ones: the rename step replaces them all)."""

    def __init__(self, model: onnx.ModelProto):
        self.taken = set(tensor_names(model.graph)) | {n.name for g in graphs(model.graph) for n in g.node}
        self.count = 0

    def __call__(self, base: str = "p") -> str:
        while True:
            self.count += 1
            name = f"{base}__{self.count}"
            if name not in self.taken:
                self.taken.add(name)
                return name


def elem_type(types: dict[str, onnx.TypeProto], name: str) -> int | None:
    t = types.get(name)
    if t is None or not t.HasField("tensor_type"):
        return None
    return t.tensor_type.elem_type or None


def dims(types: dict[str, onnx.TypeProto], name: str) -> list[int | str | None] | None:
    """A tensor's shape as ints (fixed), strings (named symbolic dims) or None (unknown); None without a rank."""
    t = types.get(name)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.tensor_type.shape.dim]
