"""Reordering and cancellation of data-movement ops.

- unary(x) -> Slice   becomes  Slice(x) -> unary: elementwise work on only the kept part (exporters often apply an
  activation to a whole tensor and then take a slice of it, e.g. the CLS token).
- Transpose(p) -> Transpose(q): the composition permutes by p[q[i]]; identity -> both vanish, otherwise one
  Transpose remains.
- Reshape -> Reshape: only the last target shape matters (unless it copies dims with 0, which refer to the
  intermediate shape).
A rewrite happens only when the intermediate tensor has no other reader, so nothing is recomputed.
"""
from __future__ import annotations

import onnx
from onnx import helper

from automp.deploy.passes.graph import Graph, attr, copy_model

UNARY = {"Relu", "Sigmoid", "Tanh", "Exp", "Log", "Neg", "Abs", "Erf", "Sqrt", "Reciprocal", "Gelu", "Softplus",
         "Floor", "Ceil", "Round", "Sign", "Sin", "Cos", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "HardSwish",
         "Not", "IsNaN", "IsInf", "Identity", "Cast"}


def _slice_first(g: Graph, sl: onnx.NodeProto, dead: set[int], moves: list) -> bool:
    un = g.producer.get(sl.input[0])
    if un is None or un.op_type not in UNARY or un.domain not in ("", "ai.onnx") or \
            g.only_consumer(un.output[0]) is not sl:
        return False
    # Slice now reads the pre-unary tensor and the unary op writes the Slice's old output; the unary node moves to
    # just after the Slice (the Slice's starts/ends may be computed between the two).
    mid = g.fresh(un.output[0] + "_sliced")
    x, y = un.input[0], sl.output[0]
    sl.input[0], sl.output[0] = x, mid
    un.input[0], un.output[0] = mid, y
    moves.append((un, sl))
    return True


def _transpose_pair(g: Graph, t2: onnx.NodeProto, dead: set[int], moves: list) -> bool:
    t1 = g.producer.get(t2.input[0])
    if t1 is None or t1.op_type != "Transpose":
        return False
    p, q = attr(t1, "perm"), attr(t2, "perm")
    if p is None or q is None or len(p) != len(q):
        return False
    sole = g.only_consumer(t1.output[0]) is t2
    composed = [p[i] for i in q]
    if composed == sorted(composed) and t2.output[0] not in g.graph_outputs:
        g.rename_uses(t2.output[0], t1.input[0])
        dead.add(id(t2))
    elif sole:
        t2.input[0] = t1.input[0]
        del t2.attribute[:]
        t2.attribute.append(helper.make_attribute("perm", composed))
    else:
        return False
    if sole:
        dead.add(id(t1))
    return True


def _reshape_chain(g: Graph, r2: onnx.NodeProto, dead: set[int], moves: list) -> bool:
    r1 = g.producer.get(r2.input[0])
    if r1 is None or r1.op_type != "Reshape" or attr(r2, "allowzero", 0):
        return False
    shape = g.const(r2.input[1])
    if shape is None or (shape == 0).any():
        return False
    if g.only_consumer(r1.output[0]) is r2:
        dead.add(id(r1))
    r2.input[0] = r1.input[0]
    return True


def _sweep(out: onnx.ModelProto, op: str, rule) -> bool:
    """One pass over the graph with one index; a node next to one already rewritten waits for the next sweep."""
    g = Graph(out)
    dead: set[int] = set()
    touched: set[int] = set()
    moves: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []
    for node in list(out.graph.node):
        if node.op_type != op or node.domain not in ("", "ai.onnx"):
            continue
        producer = g.producer.get(node.input[0])
        if id(node) in touched or (producer is not None and id(producer) in touched):
            continue
        if rule(g, node, dead, moves):
            touched.update({id(node), id(producer)})
    nodes = [n for n in out.graph.node if id(n) not in dead]
    for un, sl in moves:
        del nodes[next(k for k, n in enumerate(nodes) if n is un)]
        nodes.insert(next(k for k, n in enumerate(nodes) if n is sl) + 1, un)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return bool(touched)


def reorder(model: onnx.ModelProto) -> onnx.ModelProto:
    out = copy_model(model)
    for op, rule in (("Slice", _slice_first), ("Transpose", _transpose_pair), ("Reshape", _reshape_chain)):
        while _sweep(out, op, rule):  # repeat so chains (T -> T -> T, unary -> unary -> Slice) collapse fully
            pass
    return out
