"""Operator fusion: fewer, bigger kernels.

Standard ONNX rewrites (any runtime benefits):
- MatMul(x, W) + Add(b), x rank 2        -> Gemm(x, W, b): the bias add happens in the GEMM epilogue.
- Conv(x, W[, b]) + Add(per-channel c)   -> Conv(x, W, b + c).
onnxruntime contrib rewrites (com.microsoft domain, run by ORT's CPU provider; off with contrib=False):
- Conv/Gemm + Relu|Sigmoid|Tanh           -> FusedConv/FusedGemm: the activation runs in the epilogue.
- Add(a, b) + LayerNormalization(last axis), rank-3 inputs -> SkipLayerNormalization: the transformer residual
  and its normalisation in one pass over memory (its optional 4th output carries a + b when still needed).
FusedConv/FusedGemm exist only for float32 in ORT's CUDA provider, so the fp16 pipeline turns `activations` off.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from automp.deploy.passes.graph import Graph, attr, copy_model, infer_shapes, rank_of, static_shape, value_types

MS = "com.microsoft"
ACTIVATIONS = ("Relu", "Sigmoid", "Tanh")


@dataclass
class FuseConfig:
    """gemm: MatMul+Add -> Gemm. conv_bias: Conv+Add -> Conv. activations / skip_layernorm: ORT contrib ops."""
    gemm: bool = True
    conv_bias: bool = True
    activations: bool = True
    skip_layernorm: bool = True


def _other(node: onnx.NodeProto, name: str) -> str:
    return node.input[1] if node.input[0] == name else node.input[0]


def _matmul_add(g: Graph, types, mm: onnx.NodeProto, dead: set[int]) -> None:
    add = g.only_consumer(mm.output[0])
    w = g.const(mm.input[1])
    if add is None or add.op_type != "Add" or w is None or w.ndim != 2 or rank_of(types, mm.input[0]) != 2:
        return
    b = g.const(_other(add, mm.output[0]))
    if b is None or b.shape not in ((w.shape[1],), (1, w.shape[1])) or b.dtype != w.dtype:
        return
    mm.op_type = "Gemm"
    mm.input.append(_other(add, mm.output[0]))
    mm.output[0] = add.output[0]
    dead.add(id(add))


def _conv_add(g: Graph, conv: onnx.NodeProto, dead: set[int]) -> None:
    add = g.only_consumer(conv.output[0])
    w = g.const(conv.input[1])
    if add is None or add.op_type != "Add" or w is None:
        return
    c = g.const(_other(add, conv.output[0]))
    cout, rank = w.shape[0], w.ndim
    if c is None or c.dtype != w.dtype or c.size != cout or c.ndim > rank or \
            (c.ndim >= rank - 1 and c.shape[-(rank - 1)] != cout):
        return
    if c.ndim < rank - 1 and cout != 1:  # a [C]-shaped constant broadcasts over the last axis, not channels
        return
    b = g.const(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else np.zeros(cout, w.dtype)
    name = g.add_initializer((conv.name or "conv") + "_bias", (b + c.reshape(cout)).astype(w.dtype))
    if len(conv.input) > 2:
        conv.input[2] = name
    else:
        conv.input.append(name)
    conv.output[0] = add.output[0]
    dead.add(id(add))


def _activation(g: Graph, node: onnx.NodeProto, dead: set[int]) -> None:
    act = g.only_consumer(node.output[0])
    if act is None or act.op_type not in ACTIVATIONS or act.domain not in ("", "ai.onnx"):
        return
    node.op_type = "FusedConv" if node.op_type == "Conv" else "FusedGemm"
    node.domain = MS
    node.attribute.append(helper.make_attribute("activation", act.op_type))
    node.output[0] = act.output[0]
    dead.add(id(act))


def _skip_layernorm(g: Graph, types, add: onnx.NodeProto, dead: set[int]) -> None:
    cons = [c for c in g.consumers.get(add.output[0], []) if c.op_type == "LayerNormalization"]
    if len(cons) != 1 or any(g.is_const(i) for i in add.input):
        return
    ln = cons[0]
    a, b = add.input
    shape_a = static_shape(types, a)
    if rank_of(types, a) != 3 or rank_of(types, b) != 3 or shape_a[-1] is None:
        return
    if [d.dim_param or d.dim_value for d in types[a].tensor_type.shape.dim] != \
            [d.dim_param or d.dim_value for d in types[b].tensor_type.shape.dim]:
        return
    if attr(ln, "axis", -1) not in (-1, 2) or any(o for o in ln.output[1:]) or not g.is_const(ln.input[1]):
        return
    sum_out = add.output[0] if g.uses(add.output[0]) > 1 else ""
    ins = [a, b, ln.input[1]] + ([ln.input[2]] if len(ln.input) > 2 and ln.input[2] else [])
    add.op_type, add.domain = "SkipLayerNormalization", MS
    del add.attribute[:]
    add.attribute.append(helper.make_attribute("epsilon", attr(ln, "epsilon", 1e-5)))
    add.input[:] = ins
    add.output[:] = [ln.output[0], "", "", sum_out] if sum_out else [ln.output[0]]
    dead.add(id(ln))


def _uses_ms(model: onnx.ModelProto) -> None:
    if any(n.domain == MS for n in model.graph.node) and not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))


def fuse(model: onnx.ModelProto, config: FuseConfig | None = None) -> onnx.ModelProto:
    cfg = config or FuseConfig()
    out = copy_model(model)
    types = value_types(infer_shapes(out))
    # one rule family per sweep: each rule sees a fresh index, so chains (MatMul+Add+Relu) fuse step by step
    rules = [("MatMul", cfg.gemm, lambda g, n, d: _matmul_add(g, types, n, d)),
             ("Conv", cfg.conv_bias, _conv_add),
             ("Conv", cfg.activations, _activation), ("Gemm", cfg.activations, _activation),
             ("Add", cfg.skip_layernorm, lambda g, n, d: _skip_layernorm(g, types, n, d))]
    for op, enabled, rule in rules:
        if not enabled:
            continue
        g = Graph(out)
        dead: set[int] = set()
        for node in list(out.graph.node):
            if node.op_type == op and node.domain in ("", "ai.onnx") and id(node) not in dead:
                rule(g, node, dead)
        keep = [n for n in out.graph.node if id(n) not in dead]
        del out.graph.node[:]
        out.graph.node.extend(keep)
    _uses_ms(out)
    return out
