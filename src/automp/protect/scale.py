"""Per-channel weight scaling: every layer stores W·diag(s) instead of W, with s random, and the graph still
computes the same function.

A layer whose output channels are scaled by s (a MatMul/Gemm/Conv weight's output axis, a normalisation's gamma and
beta, an embedding table's columns) produces y·s. The scale travels forward through ops that commute with a positive
per-channel factor -- ReLU, pooling, a constant bias Add (whose bias is scaled too), transposes and reshapes that keep
the channel axis whole -- until it reaches a consumer that takes 1/s into its own constants: the next
MatMul/Gemm/Conv's input rows, or a BatchNormalization's mean and variance. Those layers then show neither W nor s,
and running the model costs nothing extra. Only where the scale meets anything else (a residual Add, a softmax, a
graph output) is a Mul by 1/s inserted, and that Mul shows s next to the layer it undoes.

s is positive (ReLU and max pooling commute only with positive factors) and log-uniform with |log2 s| in
[0.5, log2(max_scale)], so no scaled weight is close to its original. Weights are rescaled in float64 and rounded
once; only float32/float64 weights are scaled (a float16 weight would be rounded visibly), others are reported.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from automp.deploy.passes.graph import Graph, attr, has_subgraph, infer_shapes, value_types
from automp.protect.names import FLOAT_TYPES, Fresh, dims, graphs

SOURCES = ("MatMul", "Gemm", "Conv", "BatchNormalization", "LayerNormalization", "Gather")
TRANSPARENT = ("Relu", "LeakyRelu", "PRelu", "Identity", "Dropout", "MaxPool", "AveragePool", "GlobalAveragePool",
               "GlobalMaxPool", "Add", "Sub", "Mul", "Div", "Transpose", "Reshape", "Flatten", "Squeeze",
               "Unsqueeze", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")
_POOLS = ("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")
_RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
_REDUCES = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")
_ANY_FLOAT = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)

Edit = tuple[onnx.NodeProto, int, Callable[[np.ndarray], np.ndarray]]


@dataclass
class ScaleResult:
    layers: int = 0  # sources whose output channels were scaled
    weights: int = 0  # initializer slots rewritten (scaled weights, biases, norms, BN statistics)
    absorbed: int = 0  # consumers that took 1/s into their own constants
    compensation_muls: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)  # op -> nodes holding float weights left unscaled
    scaled_names: list[str] = field(default_factory=list)  # new initializers that differ from the old (not split)


@dataclass
class _Flow:
    source: onnx.NodeProto
    s: np.ndarray
    dtype: type
    edits: list[Edit] = field(default_factory=list)
    unscale: list[tuple[str, int, list[tuple[onnx.NodeProto, int]]]] = field(default_factory=list)
    absorbed: int = 0


def _along(factor: np.ndarray, axis: int) -> Callable[[np.ndarray], np.ndarray]:
    def edit(w: np.ndarray) -> np.ndarray:
        shape = [1] * w.ndim
        shape[axis] = -1
        return w * factor.reshape(shape)
    return edit


def _broadcast(factor: np.ndarray, neg: int) -> Callable[[np.ndarray], np.ndarray]:
    """Multiply a constant that broadcasts against a tensor whose channel axis is `neg` (counted from the end)."""
    return lambda b: b * factor.reshape([-1] + [1] * (-neg - 1))


class _Ctx:
    def __init__(self, model: onnx.ModelProto):
        self.g = Graph(model)
        self.types = value_types(infer_shapes(model))

    def weight(self, node: onnx.NodeProto, k: int) -> np.ndarray | None:
        """Input k when it is a float32/float64 initializer that no caller can override."""
        if k >= len(node.input) or not node.input[k]:
            return None
        t = self.g.inits.get(node.input[k])
        if t is None or node.input[k] in self.g.graph_inputs or t.data_type not in FLOAT_TYPES:
            return None
        return numpy_helper.to_array(t)

    def rank(self, name: str) -> int | None:
        d = dims(self.types, name)
        return None if d is None else len(d)

    def only_first_output(self, node: onnx.NodeProto) -> bool:
        return all(not o or self.g.uses(o) == 0 for o in node.output[1:])


def _optional(ctx: _Ctx, node: onnx.NodeProto, k: int) -> tuple[bool, np.ndarray | None]:
    """(usable, value) for an optional constant input: absent is usable (None), present must be a weight."""
    if k >= len(node.input) or not node.input[k]:
        return True, None
    w = ctx.weight(node, k)
    return w is not None, w


def _source(ctx: _Ctx, node: onnx.NodeProto) -> tuple[int, int, Callable[[np.ndarray], list[Edit]]] | None:
    """(channels, channel axis of the output from the end, edits for a scale s) when node can scale its output."""
    op = node.op_type
    if op == "MatMul":
        w = ctx.weight(node, 1)
        if w is None or w.ndim < 2:
            return None
        return w.shape[-1], -1, lambda s: [(node, 1, _along(s, -1))]
    if op == "Gemm":
        w, (ok, c) = ctx.weight(node, 1), _optional(ctx, node, 2)
        if w is None or w.ndim != 2 or not ok:
            return None
        axis = 0 if attr(node, "transB", 0) else 1
        return w.shape[axis], -1, lambda s: [(node, 1, _along(s, axis))] + ([(node, 2, _broadcast(s, -1))]
                                                                           if c is not None else [])
    if op == "Conv":
        w, (ok, b) = ctx.weight(node, 1), _optional(ctx, node, 2)
        if w is None or w.ndim < 3 or not ok:
            return None
        return w.shape[0], 1 - w.ndim, lambda s: [(node, 1, _along(s, 0))] + ([(node, 2, _along(s, 0))]
                                                                              if b is not None else [])
    if op == "BatchNormalization":
        gamma, beta, rank = ctx.weight(node, 1), ctx.weight(node, 2), ctx.rank(node.input[0])
        if gamma is None or beta is None or rank is None or attr(node, "training_mode", 0) or \
                not ctx.only_first_output(node):
            return None
        return len(gamma), 1 - rank, lambda s: [(node, 1, _along(s, 0)), (node, 2, _along(s, 0))]
    if op == "LayerNormalization":
        gamma, (ok, beta), rank = ctx.weight(node, 1), _optional(ctx, node, 2), ctx.rank(node.input[0])
        axis = attr(node, "axis", -1)
        if gamma is None or gamma.ndim != 1 or not ok or not ctx.only_first_output(node) or \
                (axis != -1 and (rank is None or axis != rank - 1)):
            return None
        return len(gamma), -1, lambda s: [(node, 1, _along(s, 0))] + ([(node, 2, _along(s, 0))]
                                                                     if beta is not None else [])
    if op == "Gather":
        w = ctx.weight(node, 0)
        if w is None or w.ndim != 2 or attr(node, "axis", 0) not in (0, -2) or node.input[1] in ctx.g.inits:
            return None
        return w.shape[1], -1, lambda s: [(node, 0, _along(s, -1))]
    return None


def _same_size(a: list, b: list) -> bool:
    a, b = [d for d in a if d != 1], [d for d in b if d != 1]
    if all(isinstance(d, int) for d in a + b):
        return int(np.prod(a, dtype=np.int64)) == int(np.prod(b, dtype=np.int64))
    return len(a) == len(b) and all(x is not None and x == y for x, y in zip(a, b))


def _reshaped(before: list | None, after: list | None, neg: int, channels: int) -> int | None:
    """Where a reshape-like op puts the channel axis, if it stays one whole axis. In row-major order the channel of
    flat element i is (i // inner) % C with inner the size of the dims after it, so the channel survives a reshape
    exactly when an output axis of size C has the same inner size behind it; the dims before it do not matter.
    Unknown dims never match, so an unprovable case is simply not followed."""
    if before is None or after is None or -neg > len(before) or before[neg] != channels:
        return None
    inner = before[len(before) + neg + 1:]
    for q in range(len(after) - 1, -1, -1):
        if after[q] == channels and _same_size(inner, after[q + 1:]):
            return q - len(after)
    return None


def _reduce_axes(ctx: _Ctx, node: onnx.NodeProto) -> list[int] | None:
    axes = attr(node, "axes")
    if axes is None and len(node.input) > 1 and node.input[1]:
        t = ctx.g.inits.get(node.input[1])
        axes = None if t is None else numpy_helper.to_array(t).reshape(-1).tolist()
    return axes or None  # no axes: everything is reduced, the channel axis too


def _through(ctx: _Ctx, node: onnx.NodeProto, k: int, neg: int, s: np.ndarray
             ) -> tuple[int, list[Edit]] | None:
    """(channel axis of the output, edits) when node passes a per-channel scale on its input k to its output."""
    op, rank = node.op_type, ctx.rank(node.input[k])
    if not ctx.only_first_output(node):
        return None
    if op in ("Relu", "LeakyRelu", "PRelu", "Identity") and k == 0:
        return neg, []
    if op == "Dropout" and k == 0 and (len(node.input) < 3 or not node.input[2]):
        return neg, []
    if op in _POOLS and k == 0 and rank is not None and neg == 1 - rank:
        return neg, []
    if op in ("Add", "Sub") and ctx.weight(node, 1 - k) is not None:
        return neg, [(node, 1 - k, _broadcast(s, neg))]
    if (op == "Mul" and ctx.weight(node, 1 - k) is not None) or (op == "Div" and k == 0 and ctx.weight(node, 1)
                                                                 is not None):
        return neg, []
    if op == "Transpose" and k == 0:
        perm = attr(node, "perm") or (list(range(rank))[::-1] if rank is not None else None)
        if perm is None or -neg > len(perm):
            return None
        return perm.index(len(perm) + neg) - len(perm), []
    if op in _RESHAPES and k == 0:
        q = _reshaped(dims(ctx.types, node.input[0]), dims(ctx.types, node.output[0]), neg, len(s))
        return None if q is None else (q, [])
    if op in _REDUCES and k == 0 and rank is not None:
        axes = _reduce_axes(ctx, node)
        p = rank + neg
        if axes is None or p in [a % rank for a in axes]:
            return None
        if attr(node, "keepdims", 1):
            return neg, []
        axes = [a % rank for a in axes]
        return (p - sum(a < p for a in axes)) - (rank - len(axes)), []
    return None


def _absorb(ctx: _Ctx, node: onnx.NodeProto, k: int, neg: int, s: np.ndarray) -> list[Edit] | None:
    """Edits that take 1/s (a scale on input k along axis neg) into node's own constants, or None."""
    op, n, inv = node.op_type, len(s), 1.0 / s
    if k != 0:
        return None
    if op == "MatMul" and neg == -1:
        w = ctx.weight(node, 1)
        if w is not None and w.ndim >= 2 and w.shape[-2] == n:
            return [(node, 1, _along(inv, -2))]
    if op == "Gemm" and neg == (-2 if attr(node, "transA", 0) else -1):
        w, axis = ctx.weight(node, 1), 1 if attr(node, "transB", 0) else 0
        if w is not None and w.ndim == 2 and w.shape[axis] == n:
            return [(node, 1, _along(inv, axis))]
    if op == "Conv":
        w, group = ctx.weight(node, 1), attr(node, "group", 1)
        if w is not None and w.ndim >= 3 and neg == 1 - w.ndim and w.shape[1] * group == n \
                and w.shape[0] % group == 0:
            per_group, cg = w.shape[0] // group, w.shape[1]
            m, j = np.meshgrid(np.arange(w.shape[0]), np.arange(cg), indexing="ij")
            factor = inv[(m // per_group) * cg + j].reshape(*w.shape[:2], *[1] * (w.ndim - 2))
            return [(node, 1, lambda a: a * factor)]
    if op == "BatchNormalization" and not attr(node, "training_mode", 0) and ctx.only_first_output(node):
        mean, var, rank = ctx.weight(node, 3), ctx.weight(node, 4), ctx.rank(node.input[0])
        eps = attr(node, "epsilon", 1e-5)
        if mean is None or var is None or rank is None or neg != 1 - rank or len(var) != n:
            return None
        # BN((x s - mean s) / sqrt(var' + eps)) equals BN(x) when var' + eps = s^2 (var + eps)
        if not np.all(s ** 2 * (var.astype(np.float64) + eps) - eps > eps):
            return None
        return [(node, 3, lambda a: a * s), (node, 4, lambda a: s ** 2 * (a + eps) - eps)]
    return None


def _follow(ctx: _Ctx, start: str, neg: int, flow: _Flow) -> None:
    """Carry flow's scale from `start` to its readers, and on through transparent ones; record where it must be
    undone by a Mul (iterative: a long chain of transparent ops must not hit Python's recursion limit)."""
    g = ctx.g
    todo = [(start, neg)]
    while todo:
        tensor, neg = todo.pop()
        handled: list[tuple[onnx.NodeProto, int]] = []
        unscaled = tensor in g.graph_outputs or tensor in g.nested
        for node in {id(n): n for n in g.consumers.get(tensor, [])}.values():
            ks = [k for k, i in enumerate(node.input) if i == tensor]
            if len(ks) != 1 or node.domain not in ("", "ai.onnx") or has_subgraph(node):
                unscaled = True
                continue
            edits = _absorb(ctx, node, ks[0], neg, flow.s)
            if edits is not None:
                flow.edits += edits
                flow.absorbed += 1
                handled.append((node, ks[0]))
                continue
            through = _through(ctx, node, ks[0], neg, flow.s) if node.op_type in TRANSPARENT else None
            if through is None:
                unscaled = True
                continue
            flow.edits += through[1]
            handled.append((node, ks[0]))
            todo.append((node.output[0], through[0]))
        if unscaled:
            flow.unscale.append((tensor, neg, handled))


def random_scales(rng: np.random.Generator, n: int, max_scale: float) -> np.ndarray:
    """Positive, log-uniform, never within a factor sqrt(2) of 1."""
    mag = rng.uniform(0.5, np.log2(max_scale), n)
    return np.exp2(np.where(rng.random(n) < 0.5, -mag, mag))


def _plan(ctx: _Ctx, rng: np.random.Generator, max_scale: float, allow_mul: bool) -> list[_Flow]:
    """One flow per source: its scale, the constants it edits, and where it must be undone by a Mul."""
    flows = []
    for node in list(ctx.g.g.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in SOURCES or has_subgraph(node):
            continue
        src = _source(ctx, node)
        if src is None:
            continue
        channels, neg, make = src
        s = random_scales(rng, channels, max_scale)
        weight = ctx.g.inits[node.input[0 if node.op_type == "Gather" else 1]]
        flow = _Flow(node, s, FLOAT_TYPES[weight.data_type], edits=make(s))
        _follow(ctx, node.output[0], neg, flow)
        if allow_mul or not flow.unscale:
            flows.append(flow)
    return flows


def _insert_muls(model: onnx.ModelProto, ctx: _Ctx, flows: list[_Flow], fresh: Fresh) -> int:
    """Where a scaled tensor has readers that need it unscaled: the producer writes a new name, the readers that
    handle the scale read that, and Mul(new, 1/s) takes the old name for everyone else."""
    after: dict[int, list[onnx.NodeProto]] = {}
    for flow in flows:
        for tensor, neg, handled in flow.unscale:
            producer = ctx.g.producer[tensor]
            scaled = fresh("s")
            producer.output[list(producer.output).index(tensor)] = scaled
            for node, k in handled:
                node.input[k] = scaled
            inv = fresh("w")
            model.graph.initializer.append(numpy_helper.from_array(
                (1.0 / flow.s).astype(flow.dtype).reshape([-1] + [1] * (-neg - 1)), inv))
            after.setdefault(id(producer), []).append(helper.make_node("Mul", [scaled, inv], [tensor],
                                                                       name=fresh("n")))
    if after:
        nodes = [m for n in model.graph.node for m in [n] + after.get(id(n), [])]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return sum(len(v) for v in after.values())


def scale_weights(model: onnx.ModelProto, rng: np.random.Generator, max_scale: float = 4.0,
                  allow_mul: bool = True) -> ScaleResult:
    """Scale in place. allow_mul=False scales only layers whose scale is absorbed everywhere (no inserted Mul)."""
    ctx, res = _Ctx(model), ScaleResult()
    flows = _plan(ctx, rng, max_scale, allow_mul)
    work: dict[tuple[int, int], tuple[onnx.NodeProto, int, np.ndarray, type]] = {}
    for flow in flows:  # every edit of one initializer slot, composed in float64, rounded once
        for node, k, fn in flow.edits:
            key = (id(node), k)
            if key not in work:
                w = ctx.weight(node, k)
                work[key] = (node, k, w.astype(np.float64), w.dtype.type)
            n_, k_, arr, dt = work[key]
            work[key] = (n_, k_, fn(arr), dt)
    touched = {key[0] for key in work}
    for node in model.graph.node:  # before the rewrite: ctx indexes the original initializers
        if id(node) not in touched and any(_is_weight(ctx, i) for i in node.input):
            res.skipped[node.op_type] = res.skipped.get(node.op_type, 0) + 1
    fresh = Fresh(model)
    for node, k, arr, dt in work.values():  # new names: the old initializer may have other readers
        name, value = fresh("w"), arr.astype(dt)
        model.graph.initializer.append(numpy_helper.from_array(value, name))
        if not np.array_equal(value, ctx.weight(node, k)):  # an all-zero bias scales to itself: left to the split
            res.scaled_names.append(name)
        node.input[k] = name
    res.weights, res.layers = len(work), len(flows)
    res.absorbed = sum(f.absorbed for f in flows)
    res.by_op = dict(Counter(f.source.op_type for f in flows))
    res.compensation_muls = _insert_muls(model, ctx, flows, fresh)
    _drop_unused_initializers(model)
    return res


def _is_weight(ctx: _Ctx, name: str) -> bool:
    """A float initializer of more than one element (a float16 one counts: it is left unscaled)."""
    t = ctx.g.inits.get(name)
    return t is not None and name not in ctx.g.graph_inputs and t.data_type in _ANY_FLOAT and \
        int(np.prod(t.dims, dtype=np.int64)) > 1


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    for g in graphs(model.graph):
        for n in g.node:
            used.update(n.input)
    keep = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
