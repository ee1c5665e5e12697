"""Make a painted graph consistent: casts at precision boundaries, then as few of them as possible.

Casts are memory traffic with no arithmetic, so after inserting one wherever a node's input dtype differs from the
node's decided dtype, we remove every cast that does not change anything (x -> x's dtype), collapse chains through a
wide intermediate, drop back-to-back inverse pairs, and share one cast per (tensor, dtype): a weight used by the
forward matmul and by the backward's grad-input matmul is cast once per step, not once per use. What remains is
left for Inductor to fuse into neighbouring kernels.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from automp.precision import cost
from automp.precision.paint import VIEW_OPS, Decision, Plan, float_inputs
from automp.precision.lists import Category

_CONVERT = torch.ops.prims.convert_element_type.default
_OURS = "automp_cast"  # meta key marking casts this pass inserted
_EXACT_IN_FP32 = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class CastStats:
    inserted: int = 0
    eliminated: int = 0
    remaining: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"inserted": self.inserted, "eliminated": self.eliminated, "remaining": self.remaining}


def is_cast(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is _CONVERT:
        return True
    return n.target is torch.ops.aten._to_copy.default and set(n.kwargs) <= {"dtype"} and "dtype" in n.kwargs


def cast_dtype(n: fx.Node) -> torch.dtype:
    return n.args[1] if n.target is _CONVERT else n.kwargs["dtype"]


def dtype_of(n: fx.Node) -> torch.dtype | None:
    v = cost.val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def written_args(n: fx.Node) -> set[int]:
    """Positions of arguments an op mutates (copy_, BN running stats): casting them would write into a temporary."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return set()
    return {i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write}


# Statistics a kernel reads as fp32 whatever the data dtype (attention's log-sum-exp, norms' saved moments).
# Fake kernels don't check them, the real kernels would read a half-size buffer as fp32.
_FP32_ARG_NAMES = frozenset({"logsumexp", "log_sumexp", "softmax_lse", "running_mean", "running_var", "save_mean",
                             "save_var", "save_invstd", "rstd", "mean", "invstd"})


def fp32_args(n: fx.Node) -> set[int]:
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return set()
    return {i for i, a in enumerate(schema.arguments) if a.name in _FP32_ARG_NAMES}


def _fake_run(n: fx.Node):
    def unwrap(a):
        return cost.val(a) if isinstance(a, fx.Node) else a
    args = fx.node.map_aggregate(n.args, unwrap)
    kwargs = fx.node.map_aggregate(n.kwargs, unwrap)
    return n.target(*args, **kwargs)


def _set_val(n: fx.Node, v) -> None:
    n.meta["val"] = v
    if isinstance(v, torch.Tensor):
        from torch.fx.passes.shape_prop import _extract_tensor_metadata
        n.meta["tensor_meta"] = _extract_tensor_metadata(v)


class _Caster:
    """Inserts casts, one per (source, dtype), with fake values so later passes (partitioner, Inductor) see dtypes."""

    def __init__(self, graph: fx.Graph, stats: CastStats):
        self.graph, self.stats = graph, stats
        self.cache: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}

    def to(self, src: fx.Node, dtype: torch.dtype, before: fx.Node) -> fx.Node:
        if dtype_of(src) == dtype:
            return src
        key = (src, dtype)
        if key in self.cache:
            return self.cache[key]
        # Before the first consumer (not after the source): a cast of a tangent then sits in the backward, where the
        # partitioner expects it, and the consumer's provenance tags apply to it.
        with self.graph.inserting_before(before):
            c = self.graph.call_function(_CONVERT, (src, dtype))
        c.meta.update({k: v for k, v in before.meta.items() if k in ("stack_trace", "seq_nr", "partitioner_tag")})
        _set_val(c, _CONVERT(cost.val(src), dtype))
        c.meta[_OURS] = True
        self.cache[key] = c
        self.stats.inserted += 1
        return c


def insert_casts(gm: fx.GraphModule, plan: Plan, low: torch.dtype) -> CastStats:
    """Rewrite inputs to each node's decided dtype and refresh fake values in one topological sweep.

    An op that cannot run in low precision (its fake/meta kernel refuses the dtype) is put back to FP32 here and the
    decision's reason says so; its consumers then see an FP32 input and get a cast like any other boundary."""
    stats = CastStats()
    caster = _Caster(gm.graph, stats)
    dirty: set[fx.Node] = set()
    for n in list(gm.graph.nodes):
        if n.op == "output":
            _restore_outputs(n, caster, dirty)
            continue
        if n.op != "call_function":  # (casts inserted below are not in this snapshot of the node list)
            continue
        d = plan.decisions.get(n)
        if d is not None and n.target is not operator.getitem and d.dtype in (low, torch.float32):
            _retarget(n, d, caster, low)
        if not (set(n.all_input_nodes) & dirty) and not (d is not None and d.dtype == low):
            continue
        old = cost.val(n)
        try:
            new = _fake_run(n)
        except Exception as e:  # noqa: BLE001 - any refusal of the dtype means: run this op in FP32
            if d is None or d.dtype != low:
                raise
            plan.decisions[n] = Decision(d.op, torch.float32, f"no low-precision kernel ({type(e).__name__}): "
                                                               f"kept FP32", Category.UNKNOWN, d.part)
            _retarget(n, plan.decisions[n], caster, low)
            new = _fake_run(n)
        _set_val(n, new)
        if _dtypes(new) != _dtypes(old):
            dirty.add(n)
        elif set(n.all_input_nodes) & dirty:
            dirty.add(n)
    return stats


def _dtypes(v):
    if isinstance(v, torch.Tensor):
        return v.dtype
    if isinstance(v, (tuple, list)):
        return tuple(_dtypes(x) for x in v)
    return None


def _retarget(n: fx.Node, d: Decision, caster: _Caster, low: torch.dtype) -> None:
    """Point each floating input of n at a version of itself in n's decided dtype (0-d tensors excepted: type
    promotion already lets them through without changing the result's dtype)."""
    skip = {n.args[i] for i in written_args(n) | fp32_args(n) if i < len(n.args) and isinstance(n.args[i], fx.Node)}
    for a in float_inputs(n):
        v = cost.val(a)
        if a in skip or v.dtype not in (torch.float32, low) or v.dtype == d.dtype or v.dim() == 0:
            continue
        n.replace_input_with(a, caster.to(a, d.dtype, n))


def _restore_outputs(out: fx.Node, caster: _Caster, dirty: set[fx.Node]) -> None:
    """Graph outputs keep their original dtypes: the user's code (and AOTAutograd's gradients, which must match
    their FP32 parameters) sees exactly what it would see without automp."""
    def fix(a):
        if isinstance(a, fx.Node) and a in dirty:
            orig = a.meta.get("automp_orig_dtype")
            if orig is not None and dtype_of(a) != orig:
                return caster.to(a, orig, out)
        return a
    out.args = fx.node.map_aggregate(out.args, fix)


def remember_output_dtypes(gm: fx.GraphModule) -> None:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for a in out.all_input_nodes:
        if dtype_of(a) is not None:
            a.meta["automp_orig_dtype"] = dtype_of(a)


def eliminate_casts(gm: fx.GraphModule) -> int:
    """Remove no-op casts, collapse cast chains and inverse pairs, share duplicate casts. Returns how many went."""
    removed = 0
    changed = True
    while changed:
        changed = False
        seen: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
        for n in list(gm.graph.nodes):
            if not is_cast(n):
                continue
            src, dst = n.args[0], cast_dtype(n)
            if dtype_of(src) == dst:  # x -> its own dtype
                n.replace_all_uses_with(src)
            elif is_cast(src) and dtype_of(src) == torch.float32 and dtype_of(src.args[0]) in _EXACT_IN_FP32:
                # a -> fp32 -> c: fp32 holds a exactly, so this is a -> c (or nothing, when c == a)
                inner = src.args[0]
                if dtype_of(inner) == dst:
                    n.replace_all_uses_with(inner)
                else:
                    n.args = (inner, dst) if n.target is _CONVERT else (inner,)
                    changed = True
                    continue
            elif is_cast(src) and dtype_of(src.args[0]) == dst and n.meta.get(_OURS) and src.meta.get(_OURS):
                # our own down-and-up round trip; a user's x.half().float() rounds on purpose and is kept
                n.replace_all_uses_with(src.args[0])
            elif _hoistable(src, dst):
                # cast(view(weight)) -> view(cast(weight)): every use of a weight then shares one cast
                with gm.graph.inserting_before(src):
                    c = gm.graph.call_function(_CONVERT, (src.args[0], dst))
                    v = gm.graph.call_function(src.target, (c, *src.args[1:]), dict(src.kwargs))
                c.meta[_OURS] = True
                for new in (c, v):
                    new.meta.update({k: x for k, x in n.meta.items() if k in ("stack_trace", "seq_nr",
                                                                              "partitioner_tag")})
                    _set_val(new, _fake_run(new))
                n.replace_all_uses_with(v)
            elif (src, dst) in seen:
                n.replace_all_uses_with(seen[(src, dst)])
            else:
                seen[(src, dst)] = n
                continue
            gm.graph.erase_node(n)
            removed += 1
            changed = True
        for n in list(gm.graph.nodes):  # casts whose consumers all went away
            if is_cast(n) and not n.users:
                gm.graph.erase_node(n)
                removed += 1
    return removed


def _hoistable(view: fx.Node, dst: torch.dtype) -> bool:
    """A view (same or more elements) of a graph input: casting the input instead costs no more and is shared."""
    node = view
    while node.op == "call_function" and _op(node) in VIEW_OPS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node is not view and node.op == "placeholder" and dtype_of(node) is not None and dtype_of(
        node).is_floating_point


def _op(n: fx.Node) -> str:
    return getattr(getattr(n.target, "overloadpacket", None), "__name__", "")


def count_casts(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if is_cast(n))
