"""Graph pass: an int8 GEMM whose only consumer is the next layer's static int8 quantization (through GELU or not)
writes that int8 input itself, from its epilogue (`automp::int8_gemm_requant`).

Why: in a transformer MLP the first GEMM's output is 4x wider than the model. Unfused, it is written in half
precision, read and written again by GELU, and read again by the static quantization that writes int8: three
passes over the widest tensor of the layer. Fused, the tile is still in registers when GELU and the quantization
run, and one byte per element is written. Only static quantization can fuse: a dynamic (per-row) scale needs the
whole row's maximum before any element is quantized, which one output tile does not have.

The pass runs on Inductor's post-grad graph (aten ops, functional, decomposed), so it matches the forms Inductor
produces there: GELU as its erf decomposition, the quantization as Int8Linear's static formula
clamp(round(x * act_mult) [+ act_zero], -127 | -128, 127) -> int8, with views and float casts anywhere in between.
A chain that does not have exactly this shape, or whose intermediate values have another consumer, is left alone:
the pass only ever removes work that nothing else reads.

    fuse_requant(gm) -> gm            the pass (GraphModule -> GraphModule, in place); gm.meta["requant"] = fused count
    dedupe(gm) -> gm                  common subexpressions of pure ops computed once; gm.meta["deduped"] = removed
    RequantPass()                     dedupe, then fuse_requant, as Inductor's post_grad_custom_post_pass (see
                                      compile.inductor_options)

Why dedupe: layers that read one input share one int8 GEMM (automp.quant.Int8Slice, e.g. attention's query, key
and value as one 768 -> 2304 product). Each of them still calls the shared layer, and neither AOTAutograd nor
Inductor merges repeated calls of a custom op, so without it the shared GEMM and its input quantization would run
once per slice.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten, prims = torch.ops.aten, torch.ops.prims
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _only_user(n: fx.Node) -> fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _is(n: object, *targets: object) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _val(n: object) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _through_views(n: fx.Node) -> fx.Node:
    """The last node of the single-consumer chain of views and float casts starting at n."""
    while True:
        u = _only_user(n)
        if u is None or u.args[0] is not n:
            return n
        if not (_is(u, *_VIEWS) or (_is(u, prims.convert_element_type.default) and u.args[1] in _FLOATS)):
            return n
        n = u


def _const(x: object, value: float) -> bool:
    return isinstance(x, (int, float)) and math.isclose(float(x), value, rel_tol=1e-6)


def _other(n: fx.Node, x: fx.Node) -> object:
    """The operand of binary node n that is not x (None if x is not one of its two operands)."""
    a, b = n.args[:2]
    return b if a is x else a if b is x else None


def _gelu_output(x: fx.Node) -> fx.Node | None:
    """n if the users of x compute n = (x * 0.5) * (1 + erf(x * 0.7071...)) and nothing else, else None."""
    users = list(x.users)
    if len(users) != 2 or not all(_is(u, aten.mul.Tensor) for u in users):
        return None
    half = next((u for u in users if _const(_other(u, x), 0.5)), None)
    scaled = next((u for u in users if _const(_other(u, x), 1 / math.sqrt(2))), None)
    if half is None or scaled is None or half is scaled:
        return None
    erf = _only_user(scaled)
    if not _is(erf, aten.erf.default):
        return None
    plus = _only_user(erf)
    if not (_is(plus, aten.add.Tensor) and _const(_other(plus, erf), 1.0)):
        return None
    out = _only_user(plus)
    if not (_is(out, aten.mul.Tensor) and _only_user(half) is out and _other(out, plus) is half):
        return None
    return out


def _quantization(n: fx.Node, width: int) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """(int8 cast node, multiplier, zero point or None) if n's single-consumer chain is the static quantization."""
    mul = _only_user(n)
    if not _is(mul, aten.mul.Tensor):
        return None
    mult = _other(mul, n)
    mv, nv = _val(mult), _val(n)
    if mv is None or nv is None or mv.dtype not in _FLOATS or nv.dim() == 0 or nv.shape[-1] != width:
        return None
    if not (mv.numel() == 1 or (mv.dim() == 1 and mv.shape[0] == width)):
        return None
    node = _only_user(mul)
    if not _is(node, aten.round.default):
        return None
    node, zero = _only_user(node), None
    if _is(node, aten.add.Tensor):
        zero = _other(node, node.args[0])
        zv = _val(zero)
        if zv is None or zv.is_floating_point() or zv.numel() != 1:
            return None
        node = _only_user(node)
    lo = -128 if zero is not None else -127
    if _is(node, aten.clamp.default) and len(node.args) == 3:
        ok = node.args[1] == lo and node.args[2] == 127
    elif _is(node, aten.clamp_min.default):
        top = _only_user(node)
        ok = node.args[1] == lo and _is(top, aten.clamp_max.default) and top.args[1] == 127
        node = top
    else:
        return None
    cast = _only_user(node) if ok else None
    if not (_is(cast, prims.convert_element_type.default) and cast.args[1] == torch.int8):
        return None
    return cast, mult, zero


def _fake(target: object, args: tuple) -> torch.Tensor | None:
    """The output value of target(*args) on the fake tensors of args (what Inductor reads from node.meta)."""
    from torch._guards import detect_fake_mode

    vals = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if mode is None:
        return None
    with mode:
        return target(*vals)


def fuse_requant(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every int8_gemm [-> GELU] -> static int8 quantization chain by one int8_gemm_requant (in place)."""
    graph, fused = gm.graph, 0
    gemm, requant = torch.ops.automp.int8_gemm.default, torch.ops.automp.int8_gemm_requant.default
    for g in [n for n in graph.nodes if _is(n, gemm)]:
        out = _val(g)
        if out is None or out.dim() != 2:
            continue
        end = _through_views(g)
        act = _gelu_output(end)
        if act is not None:
            end = _through_views(act)
        found = _quantization(end, out.shape[1])
        if found is None:
            continue
        cast, mult, zero = found
        a_q, b_q, sa, sb, bias, a_zero = g.args[:6]
        args = (a_q, b_q, sa, sb, bias, a_zero, act is not None, mult, zero)
        with graph.inserting_before(cast):
            new = graph.call_function(requant, args)
            new.meta["val"] = _fake(requant, args)
            result = new
            if _val(cast) is not None and tuple(_val(cast).shape) != tuple(out.shape):
                result = graph.call_function(aten.reshape.default, (new, list(_val(cast).shape)))
                result.meta["val"] = _fake(aten.reshape.default, result.args)
        cast.replace_all_uses_with(result)
        _erase_chain(graph, cast)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    gm.meta["requant"] = gm.meta.get("requant", 0) + fused
    return gm


def _erase_chain(graph: fx.Graph, last: fx.Node) -> None:
    """Erase last and, walking back, every node left without a user (the replaced GEMM, GELU and quantization)."""
    todo = [last]
    while todo:
        n = todo.pop()
        if n.op != "call_function" or n.users:
            continue
        inputs = [a for a in n.all_input_nodes]
        graph.erase_node(n)
        todo += inputs


def _pure(target: object) -> bool:
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def _key(v: object) -> object:
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _key(x)) for k, x in v.items())))
    return v


def dedupe(gm: fx.GraphModule) -> fx.GraphModule:
    """Every pure call that repeats an earlier one (same op, same inputs, same arguments) replaced by it (in place).
    Walking in graph order makes the merge transitive: once two calls are one node, their consumers compare equal."""
    seen: dict[object, fx.Node] = {}
    removed = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or not _pure(n.target) or not n.all_input_nodes:
            continue  # a factory call (empty, full) may stand for a buffer written later: never merge those
        key = (n.target, _key(n.args), _key(n.kwargs))
        try:
            first = seen.setdefault(key, n)
        except TypeError:  # an unhashable argument: leave the node as it is
            continue
        if first is not n:
            n.replace_all_uses_with(first)
            gm.graph.erase_node(n)
            removed += 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    gm.meta["deduped"] = gm.meta.get("deduped", 0) + removed
    return gm


class RequantPass(CustomGraphPass):
    """dedupe + fuse_requant as Inductor's post_grad_custom_post_pass; uuid() keys Inductor's cache on this file."""

    def __call__(self, graph: fx.Graph) -> None:
        fuse_requant(dedupe(graph.owning_module))

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
