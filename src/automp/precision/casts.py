"""Make a painted graph consistent: casts at precision boundaries, then as few of them as possible.

Casts are memory traffic with no arithmetic, so after inserting one wherever a node's input dtype differs from the
node's decided dtype, we remove every cast that does not change anything (x -> x's dtype), collapse chains through a
wide intermediate, drop back-to-back inverse pairs, and share one cast per (tensor, dtype): a weight used by the
forward matmul and by the backward's grad-input matmul is cast once per step, not once per use. A cast of a view is
a view of the cast, so the forward's casts move up through views to the tensor itself and its views share one.

The backward makes its own casts of forward activations (weights excepted). The partitioner never recomputes a
forward tensor that a backward matmul reads directly: it saves it. Reading it through a cast of its own leaves the
partitioner free to recompute it from what the backward keeps anyway (a layer norm's output from its normalised
input) or to save the low-precision copy, whichever costs less. What remains is left for Inductor to fuse.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from automp.precision import cost
from automp.precision.paint import Decision, GraphInfo, Plan, Rule, float_inputs, view_root

_CONVERT = torch.ops.prims.convert_element_type.default
_OURS = "automp_cast"  # meta key marking casts this pass inserted
_STORED = "automp_stored_low"  # meta key marking a stored-low tensor's casts (storage.py): never collapsed
_PRIVATE = "automp_backward_cast"  # meta key marking a backward cast of a forward activation: never shared
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


def _new_cast(graph: fx.Graph, src: fx.Node, dtype: torch.dtype, tags: fx.Node, **marks: bool) -> fx.Node:
    """A cast node with its fake value (later passes — partitioner, Inductor — read dtypes from it) and the
    provenance tags of `tags` (the node it serves)."""
    c = graph.call_function(_CONVERT, (src, dtype))
    c.meta.update({k: v for k, v in tags.meta.items() if k in ("stack_trace", "seq_nr", "partitioner_tag")})
    _set_val(c, _CONVERT(cost.val(src), dtype))
    c.meta.update({_OURS: True, **marks})
    return c


class _Caster:
    """Inserts casts, one per (source, dtype, backward-private or not)."""

    def __init__(self, graph: fx.Graph, info: GraphInfo, stats: CastStats):
        self.graph, self.info, self.stats = graph, info, stats
        self.cache: dict[tuple[fx.Node, torch.dtype, bool], fx.Node] = {}

    def to(self, src: fx.Node, dtype: torch.dtype, before: fx.Node) -> fx.Node:
        if dtype_of(src) == dtype:
            return src
        root = view_root(src)
        private = before in self.info.backward and root not in self.info.backward and root.op != "placeholder"
        key = (src, dtype, private)
        if key not in self.cache:
            # Before the first consumer (not after the source): a cast of a tangent then sits in the backward, where
            # the partitioner expects it, and the consumer's provenance tags apply to it.
            with self.graph.inserting_before(before):
                self.cache[key] = _new_cast(self.graph, src, dtype, before, **{_PRIVATE: private})
            self.stats.inserted += 1
        return self.cache[key]

    def store(self, n: fx.Node, dtype: torch.dtype) -> fx.Node:
        """Cast n right after it is computed and make every use read that cast (the backward's through shield), so
        nothing the partitioner could save for the backward reads the FP32 n."""
        with self.graph.inserting_after(n):
            low = _new_cast(self.graph, n, dtype, n, **{_STORED: True})
        n.replace_all_uses_with(low, delete_user_cb=lambda u: u is not low)
        self.stats.inserted += 1
        self.shield(low)
        return low

    def shield(self, x: fx.Node) -> None:
        """Give the backward users of a stored-low forward tensor (or of a view of it) an FP32 copy made in the
        backward. A backward matmul reading x itself would make the partitioner keep x; through the copy it may
        as well recompute x from what it keeps anyway (a layer norm's output from the normalised input)."""
        bwd = [u for u in x.users if u in self.info.backward]
        if not bwd:
            return
        first = next(u for u in self.graph.nodes if u in bwd)
        with self.graph.inserting_before(first):
            up = _new_cast(self.graph, x, torch.float32, first, **{_STORED: True})
        x.replace_all_uses_with(up, delete_user_cb=lambda u: u in bwd)
        self.stats.inserted += 1


def insert_casts(gm: fx.GraphModule, plan: Plan, low: torch.dtype, info: GraphInfo) -> CastStats:
    """Rewrite inputs to each node's decided dtype, store STORED_LOW tensors low, and refresh fake values in one
    topological sweep.

    An op that cannot run in low precision (its fake/meta kernel refuses the dtype) is put back to FP32 here and the
    decision's reason says so; its consumers then see an FP32 input and get a cast like any other boundary."""
    stats = CastStats()
    caster = _Caster(gm.graph, info, stats)
    dirty: set[fx.Node] = set()
    for n in list(gm.graph.nodes):
        if n.op == "output":
            _restore_outputs(n, caster, dirty)
            continue
        if n.op != "call_function":  # (casts inserted below are not in this snapshot of the node list)
            continue
        d = plan.decisions.get(n)
        if d is not None and n.target is not operator.getitem and d.compute in (low, torch.float32):
            _retarget(n, d, caster, low)
        if (set(n.all_input_nodes) & dirty) or (d is not None and d.compute == low):
            old = cost.val(n)
            try:
                new = _fake_run(n)
            except Exception as e:  # noqa: BLE001 - any refusal of the dtype means: run this op in FP32
                if d is None or d.compute != low:
                    raise
                d = plan.decisions[n] = Decision(torch.float32, torch.float32, Rule.NO_LOW_KERNEL,
                                                 f"no low-precision kernel ({type(e).__name__}): kept FP32", d.op,
                                                 d.part)
                _retarget(n, d, caster, low)
                new = _fake_run(n)
            _set_val(n, new)
            if _dtypes(new) != _dtypes(old) or set(n.all_input_nodes) & dirty:
                dirty.add(n)
        if d is not None and d.storage != d.compute and dtype_of(n) == torch.float32:
            dirty.add(caster.store(n, d.storage))
        elif d is not None and d.rule is Rule.VIEW_OF_STORED:
            caster.shield(n)
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
        if a in skip or v.dtype not in (torch.float32, low) or v.dtype == d.compute or v.dim() == 0:
            continue
        n.replace_input_with(a, caster.to(a, d.compute, n))


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
        seen: dict[tuple[fx.Node, torch.dtype, bool], fx.Node] = {}
        for n in list(gm.graph.nodes):
            if not is_cast(n):
                continue
            src, dst = n.args[0], cast_dtype(n)
            if dtype_of(src) == dst:  # x -> its own dtype
                n.replace_all_uses_with(src)
            elif (is_cast(src) and dtype_of(src) == torch.float32 and dtype_of(src.args[0]) in _EXACT_IN_FP32
                  and not src.meta.get(_STORED)):
                # a -> fp32 -> c: fp32 holds a exactly, so this is a -> c (or nothing, when c == a)
                inner = src.args[0]
                if dtype_of(inner) == dst:
                    n.replace_all_uses_with(inner)
                else:
                    n.args = (inner, dst) if n.target is _CONVERT else (inner,)
                    changed = True
                    continue
            elif (is_cast(src) and dtype_of(src.args[0]) == dst and n.meta.get(_OURS) and src.meta.get(_OURS)
                  and not src.meta.get(_STORED)):
                # our own down-and-up round trip; a user's x.half().float() rounds on purpose and is kept, and so is
                # a stored-low tensor's: the backward must read the low copy, not the FP32 tensor it came from
                n.replace_all_uses_with(src.args[0])
            elif not n.meta.get(_PRIVATE) and _hoistable(src):
                # cast(view(x)) -> view(cast(x)): every view of x then shares one cast
                with gm.graph.inserting_before(src):
                    c = _new_cast(gm.graph, src.args[0], dst, n)
                    v = gm.graph.call_function(src.target, (c, *src.args[1:]), dict(src.kwargs))
                v.meta.update({k: x for k, x in n.meta.items() if k in ("stack_trace", "seq_nr", "partitioner_tag")})
                _set_val(v, _fake_run(v))
                n.replace_all_uses_with(v)
            elif (src, dst, bool(n.meta.get(_PRIVATE))) in seen:
                n.replace_all_uses_with(seen[(src, dst, bool(n.meta.get(_PRIVATE)))])
            else:
                seen[(src, dst, bool(n.meta.get(_PRIVATE)))] = n
                continue
            gm.graph.erase_node(n)
            removed += 1
            changed = True
        for n in list(gm.graph.nodes):  # casts whose consumers all went away
            if is_cast(n) and not n.users:
                gm.graph.erase_node(n)
                removed += 1
    return removed


def _hoistable(view: fx.Node) -> bool:
    """A view (same or more elements) of a floating tensor: casting the tensor instead costs no more, and one cast
    then serves every view of it (a weight's forward and backward views, the q/k/v views of one activation)."""
    root = view_root(view)
    return root is not view and dtype_of(root) is not None and dtype_of(root).is_floating_point
