"""A causal mask built inside the graph, handed to attention as `is_causal=True`: a graph rewrite for the compiled
paths.

Why: `scaled_dot_product_attention` given an `attn_mask` cannot know the mask is causal, so its fused kernels
(cuDNN's, memory-efficient) compute every tile of the T x T scores and mask them afterwards; with `is_causal=True`
they skip the tiles above the diagonal, about half the work. transformers' causal LMs pass `is_causal` when they
run eagerly, but while Dynamo traces them several transformers releases build the causal mask as a boolean tensor
instead (masking_utils will not skip the mask while tracing on the torch versions automp supports), so the
compiled step, the hand-written `torch.compile` loop's included, attends with a mask it does not need. Measured on
GPT-2 and Llama-3.2-1B dims, attention took about twice as long with the mask (BENCHMARKS.md, "Causal attention").

What is rewritten: an attention call whose mask is computed from nothing the graph takes in (no graph input or
attribute among its ancestors: aranges, comparisons and expands of fixed sizes), and whose value, computed here once,
is exactly the lower triangle `is_causal` stands for, in every batch and head. Boolean masks and additive ones
(0 where attended, -inf or the dtype's lowest value elsewhere) both qualify. The call gets `is_causal=True` and no
mask; the mask's nodes, no longer read, go. Both forms compute the same attention. A mask that reads the script's
inputs (padding), a sliding window, a mask of symbolic sizes (dynamic shapes) or one with randomness keeps its call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

CAUSAL_ATTENTION = "causal-attention"  # the report's rule for a rewritten mask
_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_VMAP_OPS = "torch._functorch.predispatch"  # the module of the vmap ops Dynamo records
_LEVEL_CALLS = ("_vmap_increment_nesting", "_vmap_decrement_nesting", "lazy_load_decompositions")
_SIGNATURE = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
# ops whose value differs from call to call (randomness, uninitialized memory): a mask made with one is no constant
_NOT_CONSTANT_PREFIXES = ("rand", "empty", "new_empty", "bernoulli", "multinomial", "normal", "uniform", "exponential",
                          "geometric", "cauchy", "log_normal", "poisson")


@dataclass(frozen=True)
class Site:
    """One rewritten mask: its graph name, how many attention calls read it, its shape."""
    mask: str
    calls: int
    shape: tuple[int, ...]


def _value(node: object) -> torch.Tensor | None:
    v = node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _arguments(call: fx.Node) -> dict[str, object]:
    """The call's arguments by name (positional ones named by SDPA's signature)."""
    return {**dict(zip(_SIGNATURE, call.args)), **call.kwargs}


def _closure(todo: list[fx.Node], seen: set[fx.Node]) -> bool:
    """Add the nodes of `todo` and everything they are computed from to `seen`; False when one of them is a graph
    input, an attribute, a module call or an op with randomness: then the mask is not a constant of the graph."""
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        if n.op not in ("call_function", "call_method"):
            return False
        name = getattr(n.target, "__name__", str(n.target)).lower()
        if name.startswith(_NOT_CONSTANT_PREFIXES) or "dropout" in name:
            return False
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return True


def _vmap_op(n: fx.Node, name: str | None = None) -> bool:
    """One of the vmap ops Dynamo records (nesting levels, batch dims); `name`: that one."""
    return (n.op == "call_function" and getattr(n.target, "__module__", "") == _VMAP_OPS
            and (name is None or n.target.__name__ == name))


def _ancestors(node: fx.Node) -> list[fx.Node] | None:
    """`node` and the nodes it is computed from, in graph order, ready to run on their own; None when it is not a
    constant of the graph. A mask built under torch.vmap (transformers 4.5x builds it over batch, head, query and key
    indices) also needs the vmap levels its ops refer to by number: the vmap calls between its first node and itself
    and those closing the levels after it, none of which it reads; levels that do not close give None."""
    seen: set[fx.Node] = set()
    if not _closure([node], seen):
        return None
    order = list(node.graph.nodes)
    if any(_vmap_op(n) for n in seen):
        last = order.index(node)
        inside = [n for n in order[min(order.index(n) for n in seen):last] if _vmap_op(n)]
        if not _closure(inside, seen):
            return None
        depth = sum(_vmap_op(n, "_vmap_increment_nesting") for n in seen) - sum(
            _vmap_op(n, "_vmap_decrement_nesting") for n in seen)
        for n in order[last + 1:]:
            if depth <= 0 or not _vmap_op(n, "_vmap_decrement_nesting"):
                break
            seen.add(n)
            depth -= 1
        if depth != 0:
            return None
    return [n for n in order if n in seen]


def _evaluate(nodes: list[fx.Node], mask: fx.Node) -> torch.Tensor | None:
    """The value of `mask`, computed from `nodes` (a closed subgraph: see _ancestors) on real tensors outside any
    fake-tensor mode; None if it fails or is not a tensor. The vmap levels it opened are closed whatever happens."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[mask])
    level = torch._C._functorch.maybe_current_level()
    try:
        with unset_fake_temporarily(), torch.no_grad():
            value = fx.GraphModule(torch.nn.Module(), graph).forward()  # forward: no traceback printed on failure
    except Exception:  # noqa: BLE001 - a subgraph that cannot run alone keeps its call, as any other doubt does
        value = None
    finally:
        while torch._C._functorch.maybe_current_level() != level:
            torch._C._functorch._vmap_decrement_nesting()
    return value if isinstance(value, torch.Tensor) else None


def is_causal_mask(mask: torch.Tensor, queries: int, keys: int) -> bool:
    """Whether `mask`, as SDPA reads it for `queries` x `keys` scores, is the pattern `is_causal=True` applies:
    position (i, j) attended exactly when j <= i, in every leading index."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (queries, keys) or mask.numel() == 0:
        return False
    lower = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == lower).all())
    if not mask.is_floating_point():
        return False
    blocked = torch.isneginf(mask) | (mask == torch.finfo(mask.dtype).min)
    return bool(((mask == 0) == lower).all() and (blocked == ~lower).all())


def causal_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[Site]]:
    """Rewrite each attention call of a Dynamo graph whose in-graph mask is causal (module docstring); the graph and
    the masks rewritten."""
    verdicts: dict[fx.Node, bool] = {}
    subgraphs: dict[fx.Node, list[fx.Node]] = {}  # each causal mask's own nodes, erased once nothing reads them
    calls: dict[fx.Node, int] = {}
    for call in list(gm.graph.nodes):
        if call.op != "call_function" or call.target not in _SDPA:
            continue
        args = _arguments(call)
        mask, q, k = args.get("attn_mask"), _value(args.get("query")), _value(args.get("key"))
        if not isinstance(mask, fx.Node) or args.get("is_causal") or q is None or k is None or q.dim() < 2:
            continue
        if mask not in verdicts:
            nodes = _ancestors(mask)
            value = _evaluate(nodes, mask) if nodes else None
            verdicts[mask] = value is not None and is_causal_mask(value, q.shape[-2], k.shape[-2])
            if verdicts[mask]:
                subgraphs[mask] = nodes
        if not verdicts[mask]:
            continue
        args.update(attn_mask=None, is_causal=True)
        call.args, call.kwargs = tuple(args[n] for n in _SIGNATURE[:3]), {k: v for k, v in args.items()
                                                                           if k not in _SIGNATURE[:3]}
        calls[mask] = calls.get(mask, 0) + 1
    sites = [Site(mask.name, n, tuple(_value(mask).shape) if _value(mask) is not None else ())
             for mask, n in calls.items()]
    for mask in calls:  # the mask's own nodes that nothing reads now, users first (vmap's level calls stay)
        for n in reversed(subgraphs[mask]):
            if not n.users and not any(_vmap_op(n, name) for name in _LEVEL_CALLS):
                gm.graph.erase_node(n)
    if sites:
        gm.graph.lint()
        gm.recompile()
    return gm, sites
