"""Sibling linear layers as one GEMM: a graph rewrite for the compiled paths.

Why: transformers' Llama, Qwen2, Mistral and Gemma compute query, key and value (and gate and up) as separate linear
layers that read the same hidden states. One GEMM on the weights concatenated along their output dimension reads
the input once and is wide enough to fill the tensor cores where a 512-wide key or value projection alone does not;
its backward is one GEMM for the input's gradient and one for the weights', where the separate layers take one each
per layer and add the input gradients up.

What is rewritten: two or more `linear(x, W_i, b_i)` of one graph that read the same `x`, whose weights are distinct
graph inputs (parameters) of one input width that nothing else in the graph reads (a tied or shared weight keeps its
own layer), with biases on all of them or on none. They become `linear(x, cat(W_i), cat(b_i))` split back into the
outputs each layer had. The parameters, their gradients, `state_dict` and the optimizer stay as the script made them:
the concatenation happens in the graph, each step, and its backward hands every parameter its own gradient.

FP8 layers (automp.precision.fp8.layers) appear in Dynamo's graph as `autograd_function_apply(fwd, bwd,
x.reshape(-1, k), W)`, the higher-order op of their autograd function around `torch._scaled_mm`. Siblings of one
recipe (their bodies alike up to names) become one such call on the concatenated weight: the group casts its input
to FP8 once and its weight into one FP8 buffer, and its GEMM is wide enough to pay where a key or value projection
alone is not. One tensorwise scale then covers the whole group's weight (and its output gradient), as a fused
projection's would.

The rewritten graph is checked with fake tensors on the graph's example inputs before it is kept: a layer's output
that the model views in a way its slice of the wide output does not allow keeps the original graph.
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F

FUSED_SIBLINGS = "fused-sibling-linears"  # the report's rule for a rewritten group
_LINEAR = (torch._C._nn.linear, F.linear)


@dataclass(frozen=True)
class Group:
    """One rewritten group: its weights (graph names) and their output widths, in the order they were joined."""
    weights: tuple[str, ...]
    widths: tuple[int, ...]


def _value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _operands(node: fx.Node) -> tuple[Any, Any, Any]:
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return node.args[0], node.args[1], bias


def _own_input(node: Any) -> bool:
    """A parameter read by this one layer only: a graph input (or attribute) with a single user."""
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr") and len(node.users) == 1


def _groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    groups = []
    for x in gm.graph.nodes:
        layers = []
        for user in x.users:
            if user.op != "call_function" or user.target not in _LINEAR or user.args[0] is not x:
                continue
            _, w, b = _operands(user)
            wv = _value(w)
            if not _own_input(w) or wv is None or wv.dim() != 2 or (b is not None and not _own_input(b)):
                continue
            layers.append(user)
        by_kind: dict[tuple, list[fx.Node]] = {}
        for layer in layers:
            _, w, b = _operands(layer)
            wv = _value(w)
            by_kind.setdefault((wv.shape[1], wv.dtype, wv.device, b is None), []).append(layer)
        groups += [g for g in by_kind.values() if len(g) >= 2]
    return groups


_HOP = getattr(torch.ops.higher_order, "autograd_function_apply", None)


def _body(gm: fx.GraphModule, node: Any) -> fx.GraphModule | None:
    return getattr(gm, node.target, None) if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _signature(body: fx.GraphModule) -> tuple:
    """A subgraph's ops and constants, names left out: FP8 layers of one recipe and dtype have equal signatures."""
    return tuple((n.op, str(n.target), tuple(a if not isinstance(a, fx.Node) else None for a in n.args),
                  tuple(sorted((k, v) for k, v in n.kwargs.items() if not isinstance(v, fx.Node))))
                 for n in body.graph.nodes if n.op != "placeholder" and n.op != "output")


def _fp8_groups(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """FP8 layers (their autograd function's higher-order op) on `reshape(x, -1, k)` of one x, alike in recipe."""
    if _HOP is None:
        return []
    by_kind: dict[tuple, list[fx.Node]] = {}
    for hop in gm.graph.nodes:
        if hop.op != "call_function" or hop.target is not _HOP or len(hop.args) != 4:
            continue
        fwd, bwd, arg, w = (_body(gm, hop.args[0]), _body(gm, hop.args[1]), *hop.args[2:])
        wv = _value(w)
        if (fwd is None or bwd is None or not any(n.target is torch._scaled_mm for n in fwd.graph.nodes)
                or not isinstance(arg, fx.Node) or arg.target != "reshape" or len(arg.users) != 1
                or not _own_input(w) or wv is None or wv.dim() != 2
                or [u.target for u in hop.users] != [operator.getitem] or next(iter(hop.users)).args[1] != 0):
            continue
        x = arg.args[0]
        by_kind.setdefault((x, tuple(arg.args[1:]), wv.shape[1], wv.dtype, _signature(fwd), _signature(bwd),
                            tuple(sorted(hop.kwargs.items(), key=str))), []).append(hop)
    return [g for g in by_kind.values() if len(g) >= 2]


def _join_fp8(gm: fx.GraphModule, hops: list[fx.Node]) -> Group:
    """The first FP8 call on the concatenated weight, its output split back; the others and their inputs go."""
    order = list(gm.graph.nodes)
    first = min(hops, key=order.index)
    weights = [h.args[3] for h in hops]
    widths = [int(_value(w).shape[0]) for w in weights]
    outs = [next(iter(h.users)) for h in hops]
    with gm.graph.inserting_before(first):
        w_cat = gm.graph.call_function(torch.cat, (tuple(weights),), {"dim": 0})
    first.args = (*first.args[:3], w_cat)
    head = next(iter(first.users))
    with gm.graph.inserting_after(head):
        parts = gm.graph.call_function(torch.split, (head, widths), {"dim": -1})
    with gm.graph.inserting_after(parts):
        pieces = [gm.graph.call_function(operator.getitem, (parts, i)) for i in range(len(hops))]
    for out, piece in zip(outs, pieces):
        out.replace_all_uses_with(piece, delete_user_cb=lambda u: u is not parts)
    for hop, out in zip(hops, outs):
        if hop is not first:
            reshape = hop.args[2]
            bodies = hop.args[:2]
            gm.graph.erase_node(out)
            gm.graph.erase_node(hop)
            gm.graph.erase_node(reshape)
            for body in bodies:  # its forward and backward subgraphs, read by nothing now
                if not body.users:
                    gm.graph.erase_node(body)
    return Group(tuple(w.name for w in weights), tuple(widths))


def _join(gm: fx.GraphModule, layers: list[fx.Node]) -> Group:
    x = layers[0].args[0]
    weights = [_operands(n)[1] for n in layers]
    biases = [_operands(n)[2] for n in layers]
    widths = [int(_value(w).shape[0]) for w in weights]
    first = min(layers, key=list(gm.graph.nodes).index)  # x and the weights (graph inputs) come before it
    with gm.graph.inserting_before(first):
        w_cat = gm.graph.call_function(torch.cat, (tuple(weights),), {"dim": 0})
        b_cat = gm.graph.call_function(torch.cat, (tuple(biases),), {"dim": 0}) if biases[0] is not None else None
        wide = gm.graph.call_function(torch._C._nn.linear, (x, w_cat, b_cat))
        parts = gm.graph.call_function(torch.split, (wide, widths), {"dim": -1})
        pieces = [gm.graph.call_function(operator.getitem, (parts, i)) for i in range(len(layers))]
    for layer, piece in zip(layers, pieces):
        layer.replace_all_uses_with(piece)
        gm.graph.erase_node(layer)
    return Group(tuple(w.name for w in weights), tuple(widths))


def _checks(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """The rewritten graph runs on fake tensors of the example inputs (every view of a slice allowed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    except Exception:  # noqa: BLE001 - any failure: the original graph is kept
        return False
    return True


def fuse_sibling_linears(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None
                         ) -> tuple[fx.GraphModule, list[Group]]:
    """Join each group of sibling linear layers of a Dynamo graph (module docstring); the graph and the groups
    joined. With `example_inputs`, a rewritten graph that does not run on them leaves `gm` as it was."""
    groups, fp8 = _groups(gm), _fp8_groups(gm)
    if not groups and not fp8:
        return gm, []
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    names = {n.name: n for n in new.graph.nodes}
    joined = [_join(new, [names[n.name] for n in g]) for g in groups]
    joined += [_join_fp8(new, [names[n.name] for n in g]) for g in fp8]
    new.graph.lint()
    new.recompile()
    if example_inputs is not None and not _checks(new, example_inputs):
        return gm, []
    return new, joined
