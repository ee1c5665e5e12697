"""Decide each node's compute dtype.

Low precision is seeded at Tensor Core ops (ALLOW) where the cost model says it pays, flows downstream through
elementwise (INFER) and data-movement (CLEAR) ops, and stops at DENY ops and at the unscale marker, after which
(optimizer math) nothing is ever low precision. Decisions are kept in a typed table keyed by node — nothing is
patched onto the fx nodes — so the report can say why every node ended where it did.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from automp.precision import cost, lists
from automp.precision.lists import Category

CAST_OPS = ("convert_element_type", "_to_copy", "to")


@dataclass
class PrecisionConfig:
    """What the pass aims for. `fp32_ops` names aten ops (e.g. "gelu") the user wants kept FP32 whatever the lists
    say; `small_operand_ratio` is how much smaller than the output an FP32 operand must be (bias, scale) for an
    elementwise op to cast it down rather than promote the whole op to FP32 (a residual stream stays FP32)."""

    dtype: torch.dtype = torch.bfloat16
    spec: cost.DeviceSpec = cost.CPU
    fp32_ops: frozenset[str] = frozenset()
    small_operand_ratio: int = 8


@dataclass
class Decision:
    op: str
    dtype: torch.dtype
    reason: str
    category: Category
    part: str = "inference"


@dataclass
class Plan:
    decisions: dict[fx.Node, Decision] = field(default_factory=dict)

    def is_low(self, node: fx.Node, low: torch.dtype) -> bool:
        d = self.decisions.get(node)
        return d is not None and d.dtype == low


def float_inputs(node: fx.Node) -> list[fx.Node]:
    """Tensor inputs (incl. those inside list args such as cat's) that carry floating point data."""
    found: list[fx.Node] = []

    def visit(a):
        if isinstance(a, fx.Node):
            v = cost.val(a)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and a not in found:
                found.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)

    visit(node.args)
    visit(list(node.kwargs.values()))
    return found


def _out_is_float(node: fx.Node) -> bool:
    v = cost.val(node)
    vs = v if isinstance(v, (tuple, list)) else [v]
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in vs)


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that depend on a tangent: its backward half."""
    bwd: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            bwd.add(n)
        elif n.op == "call_function" and any(a in bwd for a in n.all_input_nodes):
            bwd.add(n)
    return bwd


def paint(gm: fx.GraphModule, config: PrecisionConfig) -> Plan:
    """One topological sweep: each node's dtype depends only on its inputs' decisions and the cost model."""
    low = config.dtype
    plan = Plan()
    is_joint = any(n.op == "placeholder" and n.name.startswith("tangents") for n in gm.graph.nodes)
    bwd = backward_nodes(gm.graph) if is_joint else set()
    after_unscale: set[fx.Node] = set()
    shared = _SharedCasts()

    def part(n: fx.Node) -> str:
        return ("backward" if n in bwd else "forward") if is_joint else "inference"

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = lists.op_name(n.target)
        cat = lists.classify(n.target)
        ins = float_inputs(n)
        low_ins = [a for a in ins if plan.is_low(a, low)]

        def decide(dtype: torch.dtype, why: str) -> None:
            plan.decisions[n] = Decision(name, dtype, why, cat, part(n))

        out_val = cost.val(n)
        if n.target is operator.getitem:
            src = n.args[0]
            elem = out_val.dtype if isinstance(out_val, torch.Tensor) else None
            parent = plan.decisions.get(src)
            if parent is not None and parent.dtype == low and elem == torch.float32:
                decide(low, "element of a low-precision result")
            elif elem is not None:
                decide(elem, "element of a tuple result")
            if src in after_unscale:
                after_unscale.add(n)
            continue
        if any(a in after_unscale for a in n.all_input_nodes) or name == "unscale_marker":
            after_unscale.add(n)
            decide(torch.float32, "after gradient unscaling: optimizer math stays FP32")
            continue
        if not _out_is_float(n) and not ins:
            continue  # integer/bool bookkeeping: nothing to decide
        if name in CAST_OPS:
            target = n.kwargs.get("dtype", n.args[1] if len(n.args) > 1 else None)
            decide(target if isinstance(target, torch.dtype) else out_val.dtype, "explicit cast in the model")
            continue
        if any(cost.val(a).dtype == torch.float64 for a in ins):
            decide(torch.float64, "float64 input: the model asked for double precision")
            continue
        if name in config.fp32_ops:
            decide(torch.float32, "kept FP32 by user configuration (fp32_ops)")
            continue
        if cat is Category.ALLOW:
            fp32_ins = [cost.numel(a) / shared.uses(a) for a in ins if a not in low_ins]
            v = cost.matmul_verdict(n, low, fp32_ins, config.spec)
            decide(low if v.low else torch.float32, v.reason)
        elif cat is Category.GATHER:
            table = n.args[0]
            if plan.is_low(table, low):
                decide(low, "table already low precision")
            else:
                v = cost.gather_verdict(cost.numel(table), cost.numel(n), low, config.spec)
                decide(low if v.low else torch.float32, v.reason)
        elif cat is Category.DENY:
            decide(torch.float32, lists.reason(n.target))
        elif cat in (Category.INFER, Category.CLEAR):
            _follow(n, ins, low_ins, config, decide)
        else:
            decide(torch.float32, lists.reason(n.target))
    return plan


VIEW_OPS = frozenset({"t", "transpose", "permute", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze",
                    "expand"})


class _SharedCasts:
    """A weight's cast is made once and shared by every Tensor Core op that reads it (forward matmul, backward
    grad-input matmul, ...; casts.py hoists it through views), so each op pays only its share of that cast."""

    def __init__(self) -> None:
        self._count: dict[fx.Node, int] = {}

    def uses(self, a: fx.Node) -> int:
        root = a
        while root.op == "call_function" and lists.op_name(root.target) in VIEW_OPS:
            root = root.args[0]
        if root.op != "placeholder":
            return 1
        if root not in self._count:
            self._count[root] = max(1, self._allow_users(root))
        return self._count[root]

    def _allow_users(self, node: fx.Node) -> int:
        n = 0
        for u in node.users:
            if u.op != "call_function":
                continue
            name = lists.op_name(u.target)
            if name in VIEW_OPS:
                n += self._allow_users(u)
            elif lists.classify(u.target) is Category.ALLOW:
                n += 1
        return n


def _follow(n: fx.Node, ins: list[fx.Node], low_ins: list[fx.Node], config: PrecisionConfig, decide) -> None:
    """Elementwise and movement ops take their inputs' precision. When low and FP32 inputs meet, small FP32 operands
    (bias, scales, 0-d tensors) are cast down; a full-size FP32 operand (a residual stream) keeps the op in FP32,
    which is autocast's type promotion and keeps accumulated sums accurate."""
    low = config.dtype
    if not low_ins:
        decide(torch.float32, "inputs are FP32")
        return
    fp32_ins = [a for a in ins if a not in low_ins]
    if not fp32_ins:
        decide(low, "follows its low-precision inputs")
        return
    out = max(cost.numel(n), 1)
    big = [a for a in fp32_ins if cost.numel(a) * config.small_operand_ratio > out]
    if big:
        decide(torch.float32, f"meets full-size FP32 input {big[0].name}: promoted to FP32")
    else:
        decide(low, "follows low-precision inputs; small FP32 operands cast down")
