"""Fold inference BatchNormalization into the linear layer before it.

At inference BN is y = s * x + t per channel with s = gamma / sqrt(var + eps), t = beta - mean * s: an affine
map, so after a Conv/Gemm/MatMul it can be baked into that layer's weight and bias and costs nothing. A BN with
no foldable producer becomes Mul + Add (two cheap elementwise ops instead of a normalisation kernel).

Folded weights are written under new initializer names (the old ones may be shared); dce removes the orphans.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from automp.deploy.passes.graph import Graph, attr, copy_model, infer_shapes, rank_of, value_types


def _bn_affine(g: Graph, bn: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray] | None:
    if attr(bn, "training_mode", 0) or len([o for o in bn.output if o]) != 1:
        return None
    params = [g.const(n) for n in bn.input[1:5]]
    if any(p is None for p in params):
        return None
    gamma, beta, mean, var = (p.astype(np.float64) for p in params)
    s = gamma / np.sqrt(var + attr(bn, "epsilon", 1e-5))
    return s, beta - mean * s


def _fold_conv(g: Graph, conv: onnx.NodeProto, s: np.ndarray, t: np.ndarray) -> bool:
    w = g.const(conv.input[1])
    if w is None:
        return False
    b = g.const(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else np.zeros(w.shape[0], w.dtype)
    if b is None:
        return False
    w2 = w * s.reshape(-1, *[1] * (w.ndim - 1))
    b2 = b * s + t
    conv.input[1] = g.add_initializer(conv.input[1] + "_bn", w2.astype(w.dtype))
    _set_bias(conv, g.add_initializer((conv.name or "conv") + "_bias_bn", b2.astype(w.dtype)))
    return True


def _set_bias(node: onnx.NodeProto, name: str) -> None:
    """Conv and Gemm take their bias as the optional third input."""
    if len(node.input) > 2:
        node.input[2] = name
    else:
        node.input.append(name)


def _fold_gemm(g: Graph, gemm: onnx.NodeProto, s: np.ndarray, t: np.ndarray) -> bool:
    w = g.const(gemm.input[1])
    c = g.const(gemm.input[2]) if len(gemm.input) > 2 and gemm.input[2] else np.zeros(len(s), np.float32)
    if w is None or c is None or w.ndim != 2 or c.size not in (1, len(s)) or attr(gemm, "transA", 0) not in (0,):
        return False
    alpha, beta, trans_b = attr(gemm, "alpha", 1.0), attr(gemm, "beta", 1.0), attr(gemm, "transB", 0)
    w2 = alpha * (w * s[:, None] if trans_b else w * s[None, :])
    c2 = (beta * c.reshape(-1) * np.ones(len(s))) * s + t
    gemm.input[1] = g.add_initializer(gemm.input[1] + "_bn", w2.astype(w.dtype))
    _set_bias(gemm, g.add_initializer((gemm.name or "gemm") + "_bias_bn", c2.astype(w.dtype)))
    for a in list(gemm.attribute):
        if a.name in ("alpha", "beta"):
            gemm.attribute.remove(a)
    return True


def _fold_matmul(g: Graph, mm: onnx.NodeProto, add: onnx.NodeProto | None, bn: onnx.NodeProto,
                 s: np.ndarray, t: np.ndarray, nodes: list[onnx.NodeProto]) -> bool:
    """MatMul(x, W)[+b] -> BN over dim 1 of a rank-2 result: scale W's columns, fold into (or create) the Add."""
    w = g.const(mm.input[1])
    if w is None or w.ndim != 2 or w.shape[1] != len(s):
        return False
    b = np.zeros(len(s), w.dtype)
    if add is not None:
        b = g.const(add.input[1]) if add.input[0] == mm.output[0] else g.const(add.input[0])
        if b is None or b.size not in (1, len(s)):
            return False
    mm.input[1] = g.add_initializer(mm.input[1] + "_bn", (w * s[None, :]).astype(w.dtype))
    bias = g.add_initializer((mm.name or "matmul") + "_bias_bn", (b.reshape(-1) * s + t).astype(w.dtype))
    if add is not None:
        add.input[:] = [add.input[0] if add.input[0] == mm.output[0] else add.input[1], bias]
        add.output[0] = bn.output[0]
    else:
        nodes.append(helper.make_node("Add", [mm.output[0], bias], [bn.output[0]], name=g.fresh(bn.name + "_add")))
    return True


def _to_mul_add(g: Graph, bn: onnx.NodeProto, rank: int, s: np.ndarray, t: np.ndarray, dtype) -> list:
    shape = (-1,) + (1,) * (rank - 2)
    sn = g.add_initializer(bn.name + "_scale" if bn.name else "bn_scale", s.reshape(shape).astype(dtype))
    tn = g.add_initializer(bn.name + "_shift" if bn.name else "bn_shift", t.reshape(shape).astype(dtype))
    mid = g.fresh(bn.output[0] + "_scaled")
    return [helper.make_node("Mul", [bn.input[0], sn], [mid], name=g.fresh((bn.name or "bn") + "_mul")),
            helper.make_node("Add", [mid, tn], [bn.output[0]], name=g.fresh((bn.name or "bn") + "_add"))]


def fold_bn(model: onnx.ModelProto) -> onnx.ModelProto:
    out = copy_model(model)
    if not any(n.op_type == "BatchNormalization" for n in out.graph.node):
        return out
    types = value_types(infer_shapes(out))
    g = Graph(out)
    dead: list[onnx.NodeProto] = []
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for bn in [n for n in out.graph.node if n.op_type == "BatchNormalization" and n.domain in ("", "ai.onnx")]:
        affine = _bn_affine(g, bn)
        if affine is None:
            continue
        s, t = affine
        x = bn.input[0]
        prod = g.producer.get(x)
        single = prod is not None and g.only_consumer(x) is bn
        added: list[onnx.NodeProto] = []
        done = False
        if single and prod.op_type == "Conv" and len(prod.output) == 1:
            done = _fold_conv(g, prod, s, t)
            if done:
                prod.output[0] = bn.output[0]
        elif single and prod.op_type == "Gemm" and rank_of(types, x) == 2:
            done = _fold_gemm(g, prod, s, t)
            if done:
                prod.output[0] = bn.output[0]
        elif single and rank_of(types, x) == 2 and prod.op_type in ("MatMul", "Add"):
            mm, add = prod, None
            if prod.op_type == "Add":
                add = prod
                mm = next((g.producer.get(i) for i in prod.input if g.producer.get(i) is not None
                           and g.producer[i].op_type == "MatMul" and g.only_consumer(i) is prod), None)
                if mm is None or not any(g.is_const(i) for i in prod.input):
                    mm = None
            if mm is not None and mm.op_type == "MatMul":
                done = _fold_matmul(g, mm, add, bn, s, t, added)
        if not done:
            rank = rank_of(types, x)
            w = g.const(bn.input[1])
            if rank is None or rank < 2:
                continue
            added = _to_mul_add(g, bn, rank, s, t, w.dtype)
        dead.append(bn)
        if added:
            replacements[id(bn)] = added
    dead_ids = {id(n) for n in dead}
    nodes = []
    for n in out.graph.node:
        nodes.extend(replacements.get(id(n), []) if id(n) in dead_ids else [n])
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out

