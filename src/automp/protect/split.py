"""Constants that the channel scaling does not reach are stored as two random-looking parts that add up to them.

Every float constant C becomes initializers A and B and a node Add(A, B) -> C, with A = C·u for a random u in
[0.55, 0.95] per element and B = C - A. By Sterbenz's lemma (C/2 <= A <= 2C) the subtraction is exact, so A + B
gives C back bit for bit at run time, in any binary float format; zeros are split as (r, -r) and infinities as two
halves that overflow back to the same infinity. Neither part resembles C, but the split is undone by anyone who
folds constants (onnxruntime does so when it loads the model), which is why the scaling goes first.

Constant nodes are turned into initializers first, so they are split (and encrypted) like any other weight.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from automp.deploy.passes.graph import _constant_node_value
from automp.protect.names import Fresh, graphs

SPLIT_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64,
               onnx.TensorProto.FLOAT16: np.float16}


@dataclass
class SplitResult:
    constants_to_initializers: int = 0
    split: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count


def constants_to_initializers(model: onnx.ModelProto) -> int:
    """Main-graph Constant nodes holding a tensor become initializers of the same name (same value, same type), and
    readers of Identity(initializer) read the initializer itself (the TorchScript exporter shares weights that way,
    which would hide them from the scaling). Returns the number of nodes removed."""
    g = model.graph
    inits = {t.name for t in g.initializer} - {i.name for i in g.input}
    outputs = {o.name for o in g.output}
    keep, alias, removed = [], {}, 0
    for node in g.node:
        standard = node.domain in ("", "ai.onnx")
        value = _constant_node_value(node) if standard and node.op_type == "Constant" else None
        if value is not None:
            tensor = next((a.t for a in node.attribute if a.name == "value"), None)
            init = onnx.TensorProto()
            if tensor is not None:
                init.CopyFrom(tensor)
                init.name = node.output[0]
            else:
                init = numpy_helper.from_array(value, node.output[0])
            g.initializer.append(init)
            inits.add(node.output[0])
            removed += 1
        elif standard and node.op_type == "Identity" and alias.get(node.input[0], node.input[0]) in inits \
                and node.output[0] not in outputs:
            alias[node.output[0]] = alias.get(node.input[0], node.input[0])
            removed += 1
        else:
            keep.append(node)
    del g.node[:]
    g.node.extend(keep)
    if alias:
        for sub in graphs(g):
            for node in sub.node:
                node.input[:] = [alias.get(i, i) for i in node.input]
    return removed


def split_parts(c: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) with a + b == c exactly in c's dtype, and a, b elementwise far from c where c is finite and nonzero."""
    dt = c.dtype
    u = rng.uniform(0.55, 0.95, c.shape)
    a = (c.astype(np.float64) * u).astype(dt)
    with np.errstate(over="ignore", invalid="ignore"):
        b = (c - a).astype(dt)
    zero = c == 0
    if zero.any():
        r = rng.standard_normal(c.shape).astype(dt)
        a, b = np.where(zero, r, a), np.where(zero, -r, b)
    inf = np.isinf(c)
    if inf.any():
        big = np.full(c.shape, np.finfo(dt).max, dt) * np.sign(c).astype(dt)
        a, b = np.where(inf, big, a), np.where(inf, big, b)
    nan = np.isnan(c)
    if nan.any():
        a, b = np.where(nan, c, a), np.where(nan, np.zeros_like(c), b)
    return a.astype(dt), b.astype(dt)


def split_constants(model: onnx.ModelProto, rng: np.random.Generator, leave: set[str] = frozenset()) -> SplitResult:
    """Split every float initializer of the main graph (but those in `leave`) whose readers are all standard ONNX
    ops: a custom-domain op may insist on an initializer, and an initializer that is also a graph input or output
    is the caller's to see or override."""
    res = SplitResult()
    g = model.graph
    readers: dict[str, list[onnx.NodeProto]] = {}
    for sub in graphs(g):
        for n in sub.node:
            for i in n.input:
                readers.setdefault(i, []).append(n)
    io = {v.name for v in list(g.input) + list(g.output)}
    fresh, keep, adds = Fresh(model), [], []
    for t in g.initializer:
        reason = None
        if t.name in leave or t.name in io:
            reason = "scaled" if t.name in leave else "graph input or output"
        elif t.data_type not in SPLIT_TYPES:
            reason = f"type {onnx.TensorProto.DataType.Name(t.data_type)}"
        elif any(n.domain not in ("", "ai.onnx") for n in readers.get(t.name, [])):
            reason = "read by a custom-domain op"
        if reason is not None:
            if reason.startswith("type") and t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32):
                reason = "integer (shapes, axes, indices)"
            res.skipped[reason] = res.skipped.get(reason, 0) + 1
            keep.append(t)
            continue
        c = numpy_helper.to_array(t)
        if c.size == 0:
            keep.append(t)
            continue
        a, b = split_parts(c, rng)
        na, nb = fresh("c"), fresh("c")
        keep += [numpy_helper.from_array(a, na), numpy_helper.from_array(b, nb)]
        adds.append(helper.make_node("Add", [na, nb], [t.name], name=fresh("n")))
        res.split += 1
    del g.initializer[:]
    g.initializer.extend(keep)
    nodes = adds + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    return res
