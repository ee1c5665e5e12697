"""Decide where an FP32-computed tensor lives in memory: its storage dtype.

A DENY op (layer norm, softmax) or an elementwise op on FP32 inputs computes in FP32. If every forward consumer
reads its result in low precision, the FP32 tensor is only a staging area — each consumer rounds it anyway — yet
it is what the partitioner may save for the backward, at twice the bytes. Such a tensor is *stored* low: cast once
right after it is computed, and every use reads that low copy (the backward's through an FP32 copy made in the
backward, casts.py), so the partitioner can only save the low copy or recompute it. The forward's numerics do not
change (Inductor computes the op itself in fp32 registers either way); the backward reads the rounded values the
forward's consumers saw, as under autocast.

Never stored low: graph outputs (the user sees their dtypes), anything computed in the backward (gradients stay
FP32 like the master weights), statistics a kernel reads as fp32 (casts.fp32_args: a norm's mean/rstd), tensors
an op writes into, and under fp16 anything whose range fp16 may not hold (exp, pow, sums: lists.RANGE_SAFE).
"""
from __future__ import annotations

import operator
from dataclasses import replace

import torch
import torch.fx as fx

from automp.precision import cost, lists
from automp.precision.casts import fp32_args, written_args
from automp.precision.paint import VIEW_OPS, GraphInfo, Plan, Rule

# Decisions that make a tensor FP32 only because of how it is computed, not because the model or the user asked
# for an FP32 value (EXPLICIT_CAST, FLOAT64, USER_FP32) or because we do not know the op (UNKNOWN_OP, ...).
_COMPUTED_FP32 = frozenset({Rule.DENY_LIST, Rule.PROMOTED_BY_FP32_OPERAND, Rule.FOLLOW_FP32, Rule.TUPLE_ELEMENT})


def decide_storage(graph: fx.Graph, plan: Plan, low: torch.dtype, info: GraphInfo) -> None:
    """Mark forward FP32 tensors that only low-precision consumers read as STORED_LOW (storage = low), and the views
    between them and those consumers as low (a view of a low tensor is low). casts.insert_casts carries it out."""
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(low, str(low))
    for n in graph.nodes:
        d = plan.decisions.get(n)
        if d is None or not _candidate(n, plan, low, info):
            continue
        views = _views_read_low(n, plan, low, info)
        if views is None:
            continue
        plan.decisions[n] = replace(d, storage=low, rule=Rule.STORED_LOW,
                                    reason=f"{d.reason}; stored {name}: every forward consumer reads it in {name}")
        for v in views:
            plan.decisions[v] = replace(plan.decisions[v], compute=low, storage=low, rule=Rule.VIEW_OF_STORED,
                                        reason=f"view of a tensor stored {name}")


def _candidate(n: fx.Node, plan: Plan, low: torch.dtype, info: GraphInfo) -> bool:
    d = plan.decisions[n]
    if info.part(n) != "forward" or n in info.outputs or d.compute != torch.float32 or d.rule not in _COMPUTED_FP32:
        return False
    if d.op in VIEW_OPS:
        return False  # a view is stored as what it views: decided with that tensor (or hoisted with a weight's cast)
    v = cost.val(n)
    if not isinstance(v, torch.Tensor) or v.dtype != torch.float32 or v.dim() == 0:
        return False
    if d.rule is Rule.TUPLE_ELEMENT:  # the output of a multi-output DENY op (native_layer_norm's [0], not its stats)
        parent = plan.decisions.get(n.args[0])
        if parent is None or parent.rule is not Rule.DENY_LIST:
            return False
    if any(_pinned_fp32(u, n) for u in n.users):
        return False
    return low != torch.float16 or _source_op(n) in lists.RANGE_SAFE


def _pinned_fp32(user: fx.Node, arg: fx.Node) -> bool:
    """Whether `user` reads `arg` where the kernel needs the real FP32 buffer (fp32 statistics, written args)."""
    pos = fp32_args(user) | written_args(user)
    return any(i < len(user.args) and user.args[i] is arg for i in pos)


def _source_op(n: fx.Node) -> str:
    """The op a node computes part of: Inductor's decompositions record it (a softmax's div is `_softmax`), an
    element of a tuple belongs to the op that made the tuple."""
    orig = n.meta.get("original_aten")
    if orig is not None:
        return lists.op_name(orig)
    if n.target is operator.getitem:
        return _source_op(n.args[0])
    return lists.op_name(n.target)


def _views_read_low(n: fx.Node, plan: Plan, low: torch.dtype, info: GraphInfo) -> list[fx.Node] | None:
    """The FP32 views between n and its forward consumers if every one of those consumers computes in low
    precision (so rounds n anyway), else None. Backward consumers do not count: they get an up-cast."""
    views: list[fx.Node] = []
    readers = 0
    todo = [n]
    while todo:
        x = todo.pop()
        for u in x.users:
            if u.op == "output":
                return None  # the tensor (or a view of it) leaves the graph in its original dtype
            if info.part(u) == "backward":
                continue
            d = plan.decisions.get(u)
            if d is None:
                return None
            if lists.op_name(u.target) in VIEW_OPS and u.args[0] is x and d.compute == torch.float32:
                if u in info.outputs:
                    return None
                views.append(u)
                todo.append(u)
            elif d.compute == low and not _pinned_fp32(u, x):
                readers += 1
            else:
                return None
    return views if readers else None
