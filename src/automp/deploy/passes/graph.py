"""A read-mostly view of an ONNX graph that the passes share: who produces and who consumes each tensor, which
tensors are constants, and a few edits (rename a tensor's uses, add an initializer under a fresh name).

Passes work on a copy (`copy_model`) so the caller's ModelProto is never mutated. Tensors used inside subgraphs
(If/Loop bodies) count as used, so a pass never deletes something a body still reads.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterable

import numpy as np
import onnx
from onnx import numpy_helper


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    return dict(Counter(n.op_type for n in model.graph.node))


def subgraph_inputs(graph: onnx.GraphProto) -> set[str]:
    """Names read by nodes of nested subgraphs (their outer-scope captures, over-approximated)."""
    names: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                for n in sub.node:
                    names.update(n.input)
                names.update(o.name for o in sub.output)
                names |= subgraph_inputs(sub)
    return names


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


class Graph:
    """Index over `model.graph`; rebuild (cheap) after structural edits."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.g = model.graph
        self.inits = {t.name: t for t in self.g.initializer}
        self.graph_inputs = {i.name for i in self.g.input}
        self.graph_outputs = {o.name for o in self.g.output}
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in self.g.node:
            for o in node.output:
                if o:
                    self.producer[o] = node
            for i in node.input:
                if i:
                    self.consumers[i].append(node)
        self.nested = subgraph_inputs(self.g)
        self._taken = set(self.producer) | set(self.inits) | self.graph_inputs | {n.name for n in self.g.node}

    # ---- constants
    def is_const(self, name: str) -> bool:
        """Initializer that is not overridable by a graph input, or output of a Constant node."""
        if name in self.inits and name not in self.graph_inputs:
            return True
        p = self.producer.get(name)
        return p is not None and p.op_type == "Constant" and p.domain in ("", "ai.onnx")

    def const(self, name: str) -> np.ndarray | None:
        if name in self.inits and name not in self.graph_inputs:
            return numpy_helper.to_array(self.inits[name])
        p = self.producer.get(name)
        if p is not None and p.op_type == "Constant":
            return _constant_node_value(p)
        return None

    # ---- uses
    def uses(self, name: str) -> int:
        """Readers of `name`: consumer nodes, graph outputs and subgraph captures."""
        return len(self.consumers.get(name, ())) + (name in self.graph_outputs) + (name in self.nested)

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        cons = self.consumers.get(name, [])
        if len(cons) == 1 and name not in self.graph_outputs and name not in self.nested:
            return cons[0]
        return None

    # ---- edits
    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self._taken:
            k += 1
            name = f"{base}_{k}"
        self._taken.add(name)
        return name

    def add_initializer(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        self.inits[name] = self.g.initializer[-1]
        return name

    def rename_uses(self, old: str, new: str) -> None:
        """Point every reader of `old` at `new` (graph outputs excluded: callers keep output names)."""
        for node in self.consumers.get(old, []):
            for k, i in enumerate(node.input):
                if i == old:
                    node.input[k] = new
            self.consumers[new].append(node)
        self.consumers.pop(old, None)


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name in ("value_float", "value_int"):
            return np.asarray(onnx.helper.get_attribute_value(a),
                              dtype=np.float32 if a.name == "value_float" else np.int64)
        if a.name in ("value_floats", "value_ints"):
            return np.asarray(onnx.helper.get_attribute_value(a),
                              dtype=np.float32 if a.name == "value_floats" else np.int64)
    return None


def remove_nodes(model: onnx.ModelProto, dead: Iterable[onnx.NodeProto]) -> None:
    dead_ids = {id(n) for n in dead}
    keep = [n for n in model.graph.node if id(n) not in dead_ids]
    del model.graph.node[:]
    model.graph.node.extend(keep)


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Shape inference that never raises: a pass that needs ranks simply skips what stays unknown."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 — inference is advisory; passes check for missing info
        return model


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Known types of every tensor (after shape inference), keyed by name."""
    types: dict[str, onnx.TypeProto] = {}
    g = model.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type"):
            types[vi.name] = vi.type
    for t in g.initializer:
        types[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims))
    return types


def rank_of(types: dict[str, onnx.TypeProto], name: str) -> int | None:
    t = types.get(name)
    if t is None or not t.tensor_type.HasField("shape"):
        return None
    return len(t.tensor_type.shape.dim)


def static_shape(types: dict[str, onnx.TypeProto], name: str) -> list[int | None] | None:
    t = types.get(name)
    if t is None or not t.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim]
