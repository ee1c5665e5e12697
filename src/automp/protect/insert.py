"""Identity-equivalent ops and opaque-predicate branches, so the graph no longer reads like the exporter wrote it.

Identity ops (each exact in floating point, so the output does not move at all):
  x * 2^-k * 2^k    (k in 1..3: scaling down first cannot overflow; only values below ~1e-37 lose bits)
  x + (c - c)       (c random: c - c is exactly +0)
  Transpose(perm) then Transpose(inverse perm)
  Reshape(x, Shape(x))

Branches (the idea of MindSpore's dynamic obfuscation): a node is moved into the then-branch of an If whose
condition is always true but computed from random constants -- sum(a*a) >= 0, max|sin a| < c with c > 1, or
x(x+1) even for integers -- and the else-branch runs the same op followed by a decoy (Neg, Tanh, x*c, ...), so both
branches have the output's type and shape. Constant folding (onnx-simplifier, onnxruntime at load time) evaluates
the conditions and inlines the branches: this hides the structure from a reader, not from a tool.

`ratio` is the fraction of eligible spots used, for each kind separately: float32/float64 tensors produced by a node
(identity ops), and standard-domain nodes without bodies whose outputs are all float32/float64 (branches).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from automp.deploy.passes.graph import has_subgraph, infer_shapes, value_types
from automp.protect.names import FLOAT_TYPES, Fresh, dims, elem_type

MIN_OPSET = 11
IDENTITY_KINDS = ("scale_pow2", "add_zero", "transpose_pair", "reshape_same")
DECOYS = ("Neg", "Abs", "Tanh", "Sigmoid", "Sin", "Cos", "Mul", "Add")
MAX_PREDICATES = 4


@dataclass
class InsertResult:
    identity_eligible: int = 0
    identity_spots: int = 0
    identity_ops: int = 0  # nodes added for them
    identity_kinds: dict[str, int] = field(default_factory=dict)
    branch_eligible: int = 0
    branches: int = 0
    predicate_nodes: int = 0


class _Builder:
    """Collects the initializers the new nodes need (kept in the main graph, so encryption covers them)."""

    def __init__(self, model: onnx.ModelProto, rng: np.random.Generator):
        self.model, self.rng, self.fresh = model, rng, Fresh(model)
        self.inits: list[onnx.TensorProto] = []

    def const(self, value) -> str:
        name = self.fresh("k")
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, inputs: list[str], output: str | None = None, **attrs) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output or self.fresh("t")], name=self.fresh("n"), **attrs)


def _predicate(b: _Builder, kind: int) -> list[onnx.NodeProto]:
    """Nodes computing a scalar bool that is always true; the last node's output is the condition."""
    rng = b.rng
    if kind == 0:  # a sum of squares is never negative
        a = b.const(rng.standard_normal(int(rng.integers(4, 17))).astype(np.float32))
        sq = b.node("Mul", [a, a])
        total = b.node("ReduceSum", [sq.output[0]], keepdims=0)
        less = b.node("Less", [total.output[0], b.const(np.float32(0))])
        return [sq, total, less, b.node("Not", [less.output[0]])]
    if kind == 1:  # |sin| never exceeds 1
        a = b.const(rng.uniform(-50, 50, int(rng.integers(4, 17))).astype(np.float32))
        sin = b.node("Sin", [a])
        mag = b.node("Abs", [sin.output[0]])
        top = b.node("ReduceMax", [mag.output[0]], keepdims=0)
        return [sin, mag, top, b.node("Less", [top.output[0], b.const(np.float32(rng.uniform(1.05, 3.0)))])]
    a = b.const(rng.integers(-1000, 1000, int(rng.integers(4, 17))).astype(np.int64))  # x(x+1) is always even
    nxt = b.node("Add", [a, b.const(np.int64(1))])
    prod = b.node("Mul", [a, nxt.output[0]])
    rem = b.node("Mod", [prod.output[0], b.const(np.int64(2))])
    top = b.node("ReduceMax", [rem.output[0]], keepdims=0)
    return [nxt, prod, rem, top, b.node("Equal", [top.output[0], b.const(np.int64(0))])]


def _identity(b: _Builder, kind: str, x: str, out: str, rank: int | None, dtype: type) -> list[onnx.NodeProto]:
    if kind == "scale_pow2":
        k = int(b.rng.integers(1, 4))
        down = b.node("Mul", [x, b.const(dtype(2.0 ** -k))])
        return [down, b.node("Mul", [down.output[0], b.const(dtype(2.0 ** k))], out)]
    if kind == "add_zero":
        c = b.const(dtype(b.rng.uniform(-8, 8)))
        zero = b.node("Sub", [c, c])
        return [zero, b.node("Add", [x, zero.output[0]], out)]
    if kind == "transpose_pair":
        perm = list(range(rank))
        while perm == list(range(rank)):
            perm = [int(p) for p in b.rng.permutation(rank)]
        first = b.node("Transpose", [x], perm=perm)
        return [first, b.node("Transpose", [first.output[0]], out, perm=[int(p) for p in np.argsort(perm)])]
    shape = b.node("Shape", [x])
    return [shape, b.node("Reshape", [x, shape.output[0]], out)]


def _wrappable(node: onnx.NodeProto, types: dict[str, onnx.TypeProto]) -> bool:
    return (node.domain in ("", "ai.onnx") and node.op_type != "Constant" and not has_subgraph(node)
            and len(node.output) > 0 and all(o and elem_type(types, o) in FLOAT_TYPES for o in node.output))


def _wrap(b: _Builder, node: onnx.NodeProto, cond: str, types: dict[str, onnx.TypeProto]) -> onnx.NodeProto:
    """If(cond) with node in the then-branch and node + a decoy op in the else-branch; same outputs as node."""
    real, fake = onnx.NodeProto(), onnx.NodeProto()
    real.CopyFrom(node)
    fake.CopyFrom(node)
    real.name, fake.name = b.fresh("n"), b.fresh("n")
    real.output[:] = [b.fresh("t") for _ in node.output]
    fake.output[:] = [b.fresh("t") for _ in node.output]
    decoys, else_out = [], []
    for o, f in zip(node.output, fake.output):
        op = str(b.rng.choice(DECOYS))
        dtype = FLOAT_TYPES[elem_type(types, o)]
        extra = [b.const(dtype(b.rng.uniform(0.5, 2.0) * b.rng.choice([-1, 1])))] if op in ("Mul", "Add") else []
        decoys.append(b.node(op, [f] + extra))
        else_out.append(decoys[-1].output[0])
    then_g = helper.make_graph([real], b.fresh("g"), [], [helper.make_value_info(t, types[o])
                                                          for t, o in zip(real.output, node.output)])
    else_g = helper.make_graph([fake] + decoys, b.fresh("g"), [], [helper.make_value_info(t, types[o])
                                                                   for t, o in zip(else_out, node.output)])
    return helper.make_node("If", [cond], list(node.output), name=b.fresh("n"), then_branch=then_g,
                            else_branch=else_g)


def _pick(rng: np.random.Generator, n: int, ratio: float) -> list[int]:
    k = int(round(ratio * n))
    return sorted(int(i) for i in rng.choice(n, k, replace=False)) if k else []


def opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def insert(model: onnx.ModelProto, rng: np.random.Generator, ratio: float) -> InsertResult:
    """Insert in place; ratio 0 leaves the model as it is."""
    res = InsertResult()
    if ratio > 0 and opset(model) < MIN_OPSET:
        raise ValueError(f"inserting identity ops and branches needs ONNX opset >= {MIN_OPSET}; the model is opset "
                         f"{opset(model)} (use ratio=0, or convert it with onnx.version_converter)")
    types = value_types(infer_shapes(model))
    nodes = list(model.graph.node)
    wrappable = [n for n in nodes if _wrappable(n, types)]
    spots = [o for n in nodes for o in n.output if o and elem_type(types, o) in FLOAT_TYPES]
    res.branch_eligible, res.identity_eligible = len(wrappable), len(spots)
    chosen_nodes = {id(wrappable[i]) for i in _pick(rng, len(wrappable), ratio)}
    chosen_spots = [spots[i] for i in _pick(rng, len(spots), ratio)]
    if not chosen_nodes and not chosen_spots:
        return res
    b = _Builder(model, rng)

    preds: list[str] = []
    head: list[onnx.NodeProto] = []
    for _ in range(min(MAX_PREDICATES, len(chosen_nodes))):
        pred = _predicate(b, int(rng.integers(3)))
        head += pred
        preds.append(pred[-1].output[0])
    res.predicate_nodes = len(head)
    body = [_wrap(b, n, preds[int(rng.integers(len(preds)))], types) if id(n) in chosen_nodes else n for n in nodes]
    res.branches = len(chosen_nodes)

    producer = {o: n for n in body for o in n.output if o}
    after: dict[int, list[onnx.NodeProto]] = {}
    kinds: Counter = Counter()
    for t in chosen_spots:
        d = dims(types, t)
        options = [k for k in IDENTITY_KINDS if k != "transpose_pair" or (d is not None and len(d) >= 2)]
        kind = str(rng.choice(options))
        node = producer[t]
        moved = b.fresh("t")
        node.output[list(node.output).index(t)] = moved
        chain = _identity(b, kind, moved, t, None if d is None else len(d), FLOAT_TYPES[elem_type(types, t)])
        after.setdefault(id(node), []).extend(chain)
        kinds[kind] += 1
        res.identity_ops += len(chain)
    res.identity_spots, res.identity_kinds = len(chosen_spots), dict(kinds)

    model.graph.initializer.extend(b.inits)
    new = head + [m for n in body for m in [n] + after.get(id(n), [])]
    del model.graph.node[:]
    model.graph.node.extend(new)
    return res
