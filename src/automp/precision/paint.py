"""Decide each node's compute dtype.

Low precision is seeded at Tensor Core ops (ALLOW) where the cost model says it pays, flows downstream through
elementwise (INFER) and data-movement (CLEAR) ops, and stops at DENY ops. Decisions are records in a table keyed
by node — nothing is patched onto the fx nodes — each naming the Rule that made it, so tests and the report can
say why every node ended where it did. Where a tensor is *stored* (storage.py) is decided after this pass, from
what its consumers read.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Callable

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


class Rule(enum.Enum):
    """Why a node got its decision; the report writes its name and tests assert on it."""

    TENSOR_CORE = enum.auto()  # matmul/conv/attention that pays for its casts: low
    TOO_SMALL = enum.auto()  # matmul/conv too small to pay for its casts: FP32
    GATHER_LOW_TABLE = enum.auto()  # lookup into a table that is already low precision
    GATHER_SMALL_TABLE = enum.auto()  # casting the table costs less than the lookup saves: low
    GATHER_HUGE_TABLE = enum.auto()  # casting the table costs more than the lookup saves: FP32
    DENY_LIST = enum.auto()  # needs FP32 numerics (lists.DENY)
    FOLLOW_LOW = enum.auto()  # elementwise/movement with low inputs (small FP32 operands cast down)
    FOLLOW_FP32 = enum.auto()  # elementwise/movement with FP32 inputs only
    PROMOTED_BY_FP32_OPERAND = enum.auto()  # a full-size FP32 operand (a residual stream) keeps it FP32
    EXPLICIT_CAST = enum.auto()  # the model's own cast: its target dtype
    FLOAT64 = enum.auto()  # the model asked for double precision
    USER_FP32 = enum.auto()  # PrecisionConfig.fp32_ops
    UNKNOWN_OP = enum.auto()  # on no list: FP32 until someone classifies it
    NO_LOW_KERNEL = enum.auto()  # the op's kernel refused the low dtype: FP32
    TUPLE_ELEMENT = enum.auto()  # an element of a multi-output op: that element's dtype
    STORED_LOW = enum.auto()  # computed FP32, stored low: every forward consumer reads it low (storage.py)
    VIEW_OF_STORED = enum.auto()  # a forward view of a STORED_LOW tensor: low like it


@dataclass(frozen=True)
class Decision:
    """`compute` is the precision of the arithmetic, `storage` the dtype the tensor has in memory (what the
    partitioner can save for the backward); they differ only for STORED_LOW."""

    compute: torch.dtype
    storage: torch.dtype
    rule: Rule
    reason: str
    op: str
    part: str = "inference"


@dataclass
class Plan:
    decisions: dict[fx.Node, Decision] = field(default_factory=dict)

    def is_low(self, node: fx.Node, low: torch.dtype) -> bool:
        d = self.decisions.get(node)
        return d is not None and d.compute == low


@dataclass(frozen=True)
class GraphInfo:
    """Facts about a graph that every stage needs, computed once before the graph changes. `backward` holds what
    the partitioner will not run in the forward unless it chooses to: every node of a joint graph that the forward
    outputs do not need (a transpose of an activation that only a gradient matmul reads is backward, though no
    tangent flows into it)."""

    joint: bool
    backward: frozenset[fx.Node]
    outputs: frozenset[fx.Node]

    @staticmethod
    def of(graph: fx.Graph) -> GraphInfo:
        joint = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        out = next(n for n in graph.nodes if n.op == "output")
        bwd: frozenset[fx.Node] = frozenset()
        if joint:
            tangent_fed = backward_nodes(graph)
            needed = {a for a in out.all_input_nodes if a not in tangent_fed}  # the forward outputs
            for n in reversed(graph.nodes):
                if n in needed:
                    needed.update(n.all_input_nodes)
            bwd = frozenset(n for n in graph.nodes if n.op != "output" and n not in needed)
        return GraphInfo(joint, bwd, frozenset(out.all_input_nodes))

    def part(self, n: fx.Node) -> str:
        return ("backward" if n in self.backward else "forward") if self.joint else "inference"


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


Decide = Callable[[torch.dtype, Rule, str], None]


def paint(gm: fx.GraphModule, config: PrecisionConfig, info: GraphInfo) -> Plan:
    """One topological sweep: each node's dtype depends only on its inputs' decisions and the cost model."""
    low = config.dtype
    plan = Plan()
    shared = _SharedCasts()

    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = lists.op_name(n.target)
        cat = lists.classify(n.target)
        ins = float_inputs(n)
        low_ins = [a for a in ins if plan.is_low(a, low)]

        def decide(dtype: torch.dtype, rule: Rule, why: str) -> None:
            plan.decisions[n] = Decision(dtype, dtype, rule, why, name, info.part(n))

        out_val = cost.val(n)
        if n.target is operator.getitem:
            elem = out_val.dtype if isinstance(out_val, torch.Tensor) else None
            if plan.is_low(n.args[0], low) and elem == torch.float32:
                decide(low, Rule.TUPLE_ELEMENT, "element of a low-precision result")
            elif elem is not None:
                decide(elem, Rule.TUPLE_ELEMENT, "element of a tuple result")
            continue
        if not _out_is_float(n) and not ins:
            continue  # integer/bool bookkeeping: nothing to decide
        if name in CAST_OPS:
            target = n.kwargs.get("dtype", n.args[1] if len(n.args) > 1 else None)
            decide(target if isinstance(target, torch.dtype) else out_val.dtype, Rule.EXPLICIT_CAST,
                   "explicit cast in the model")
        elif any(cost.val(a).dtype == torch.float64 for a in ins):
            decide(torch.float64, Rule.FLOAT64, "float64 input: the model asked for double precision")
        elif name in config.fp32_ops:
            decide(torch.float32, Rule.USER_FP32, "kept FP32 by user configuration (fp32_ops)")
        elif cat is Category.ALLOW:
            casts = sum(cost.input_cast_seconds(cost.numel(a) / shared.uses(a), low, config.spec, _cast_fuses(a))
                        for a in ins if a not in low_ins)
            v = cost.matmul_verdict(n, low, casts, config.spec)
            decide(low if v.low else torch.float32, Rule.TENSOR_CORE if v.low else Rule.TOO_SMALL, v.reason)
        elif cat is Category.GATHER:
            table = n.args[0]
            if plan.is_low(table, low):
                decide(low, Rule.GATHER_LOW_TABLE, "table already low precision")
            else:
                v = cost.gather_verdict(cost.numel(table), cost.numel(n), low, config.spec)
                decide(low if v.low else torch.float32,
                       Rule.GATHER_SMALL_TABLE if v.low else Rule.GATHER_HUGE_TABLE, v.reason)
        elif cat is Category.DENY:
            decide(torch.float32, Rule.DENY_LIST, lists.reason(n.target))
        elif cat in (Category.INFER, Category.CLEAR):
            _follow(n, ins, low_ins, config, decide)
        else:
            decide(torch.float32, Rule.UNKNOWN_OP, lists.reason(n.target))
    return plan


# Ops whose result is their input seen differently: same values, no element dropped (a cast of one is a view of the
# cast). alias/detach are how a joint graph hands a forward result to the backward.
VIEW_OPS = frozenset({"t", "transpose", "permute", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze",
                      "expand", "alias", "detach"})


def view_root(a: fx.Node) -> fx.Node:
    """The tensor a chain of views (VIEW_OPS: none of them drops elements) looks into."""
    while a.op == "call_function" and lists.op_name(a.target) in VIEW_OPS and isinstance(a.args[0], fx.Node):
        a = a.args[0]
    return a


def _cast_fuses(a: fx.Node) -> bool:
    """Whether Inductor can emit a cast of `a` inside the kernel that computes it: true of the pointwise,
    reduction and data-movement ops it generates code for, not of graph inputs, matmul/conv outputs (library
    kernels), elements of multi-output ops or ops it does not know."""
    root = view_root(a)
    return (root.op == "call_function" and root.target is not operator.getitem
            and lists.classify(root.target) in (Category.INFER, Category.DENY, Category.CLEAR, Category.GATHER))


class _SharedCasts:
    """A weight's cast is made once and shared by every Tensor Core op that reads it (forward matmul, backward
    grad-input matmul, ...; casts.py hoists it through views), so each op pays only its share of that cast."""

    def __init__(self) -> None:
        self._count: dict[fx.Node, int] = {}

    def uses(self, a: fx.Node) -> int:
        root = view_root(a)
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


def _follow(n: fx.Node, ins: list[fx.Node], low_ins: list[fx.Node], config: PrecisionConfig, decide: Decide) -> None:
    """Elementwise and movement ops take their inputs' precision. When low and FP32 inputs meet, small FP32 operands
    (bias, scales, 0-d tensors) are cast down; a full-size FP32 operand (a residual stream) keeps the op in FP32,
    which is autocast's type promotion and keeps accumulated sums accurate."""
    low = config.dtype
    if not low_ins:
        decide(torch.float32, Rule.FOLLOW_FP32, "inputs are FP32")
        return
    fp32_ins = [a for a in ins if a not in low_ins]
    if not fp32_ins:
        decide(low, Rule.FOLLOW_LOW, "follows its low-precision inputs")
        return
    out = max(cost.numel(n), 1)
    big = [a for a in fp32_ins if cost.numel(a) * config.small_operand_ratio > out]
    if big:
        decide(torch.float32, Rule.PROMOTED_BY_FP32_OPERAND,
               f"meets full-size FP32 input {big[0].name}: promoted to FP32")
    else:
        decide(low, Rule.FOLLOW_LOW, "follows low-precision inputs; small FP32 operands cast down")
