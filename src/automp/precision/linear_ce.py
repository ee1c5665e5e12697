"""Linear + cross-entropy without the full-precision logits: a graph rewrite for the compiled paths.

Why: a causal language model's step ends in its output layer and a cross-entropy over the vocabulary. At a 128k
vocabulary and 8k tokens the logits hold a billion values; the stock graph writes them in bf16, upcasts them to FP32,
keeps what the softmax's backward needs and writes their FP32 gradient: several bytes per value, written and read
again, at the step's memory peak. Computed a block of rows at a time, the loss and both gradients (the hidden states'
and the weight's) need the FP32 logits of one block only; the gradients are computed in the forward, while the block
is at hand, and the backward scales them by the loss's gradient (as Liger-Kernel's fused linear cross-entropy does).

What is rewritten: `cross_entropy(view(float(linear(h, W, b)), -1, V), target)` as transformers' causal LMs compute
their loss (and any chain of float/to/view/reshape/flatten/contiguous between the layer and the loss), with no class
weights, reduction "mean" or "sum", any ignore_index and label smoothing. The logits are still returned where the graph
returns them, in the layer's own dtype, but only where the graph detaches them first (a model output the script
never reads: automp.runtime.guards.unread_outputs): logits that a loss of the script's own may read keep the stock
graph, which gives them a gradient.

The rewrite is a pass `GraphModule -> GraphModule` on the graph Dynamo captures, before AOTAutograd: the function
below is traced into the joint graph like any autograd.Function, so Inductor fuses each block's softmax arithmetic.

Off by default (config.fuse_linear_ce). Inductor already keeps the stock graph lean: it fuses the upcast into the
softmax and holds the logits and their gradient in bf16. At Llama-3.2-1B's head the blocks were slower, the FP32
weight gradient being read and written once per block, and no smaller: traced into the compiled graph, the blocks'
buffers are scheduled together rather than one block at a time (BENCHMARKS.md, "Output layer + cross-entropy in
blocks"). The pass (which sites, the detached-logits rule, the
report) stands; the blocks need an operator Inductor does not schedule into.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

BLOCK_VALUES = 1 << 27  # FP32 logits of one block: 2**27 values, 8 blocks for a 128k vocabulary at 8k tokens
FUSED_LINEAR_CE = "fused-linear-ce"  # the report's rule for a rewritten site


def block_rows(rows: int, vocab: int) -> int:
    """Rows per block: as many as keep one block's FP32 logits within BLOCK_VALUES, and at least 1."""
    return max(1, min(rows, BLOCK_VALUES // max(vocab, 1)))


def _compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear computes in here: autocast's where it is on (as around a compiled call), else the inputs'."""
    kind = h.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(h.dtype, weight.dtype)


class LinearCrossEntropy(torch.autograd.Function):
    """(loss, logits or None) of cross_entropy(linear(h, weight, bias), target) over rows of h: [N, H], target: [N].
    The loss is FP32, the logits (when asked for) the layer's compute dtype and not differentiable."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                ignore_index: int, label_smoothing: float, reduction: str, want_logits: bool
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cdt = _compute_dtype(h, weight)
        rows, vocab = h.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(cdt)
            b = bias.to(cdt) if bias is not None else None
            valid_all = target != ignore_index
            count = valid_all.sum().to(torch.float32) if reduction == "mean" else None
            total = h.new_zeros((), dtype=torch.float32)
            logits_out = h.new_empty((rows, vocab), dtype=cdt) if want_logits else None
            grad_h = torch.empty_like(h) if need_h else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
            grad_b = torch.zeros((vocab,), dtype=torch.float32, device=h.device) if need_b else None
            step = block_rows(rows, vocab)
            for start in range(0, rows, step):
                end = min(rows, start + step)
                hc = h[start:end].to(cdt)
                logits = F.linear(hc, w, b)
                if logits_out is not None:
                    logits_out[start:end] = logits
                lf = logits.float()
                lse = torch.logsumexp(lf, dim=-1)
                tgt = target[start:end]
                valid = valid_all[start:end]
                safe = torch.where(valid, tgt, torch.zeros_like(tgt))
                loss = lse - lf.gather(1, safe.unsqueeze(1)).squeeze(1)
                if label_smoothing:
                    loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - lf.mean(dim=-1))
                total = total + torch.where(valid, loss, torch.zeros_like(loss)).sum()
                if not (need_h or need_w or need_b):
                    continue
                g = torch.exp(lf - lse.unsqueeze(1))
                hit = torch.full((end - start, 1), -(1.0 - label_smoothing), dtype=g.dtype, device=g.device)
                g = g.scatter_add(1, safe.unsqueeze(1), hit)
                if label_smoothing:
                    g = g - label_smoothing / vocab
                g = g * valid.unsqueeze(1).to(g.dtype)
                if count is not None:
                    g = g / count
                gc = g.to(cdt)
                if grad_h is not None:
                    grad_h[start:end] = (gc @ w).to(h.dtype)
                if grad_w is not None:
                    grad_w = grad_w + (gc.t() @ hc).float()
                if grad_b is not None:
                    grad_b = grad_b + g.sum(0)
            loss = total / count if count is not None else total
        ctx.save_for_backward(grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                              None if grad_b is None else grad_b.to(bias.dtype))
        if logits_out is not None:
            ctx.mark_non_differentiable(logits_out)
        return loss, logits_out

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_logits: Any) -> tuple[Any, ...]:
        grad_h, grad_w, grad_b = ctx.saved_tensors
        scale = grad_loss.float()
        return (None if grad_h is None else grad_h * scale.to(grad_h.dtype),
                None if grad_w is None else grad_w * scale.to(grad_w.dtype),
                None if grad_b is None else grad_b * scale.to(grad_b.dtype),
                None, None, None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
                         ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                         logits_shape: Any = None, loss_dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """cross_entropy(linear(h, weight, bias).view(-1, V), target.view(-1)) in blocks: (loss in `loss_dtype`, the
    logits in the layer's compute dtype and shape `logits_shape` when that is given, else None)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction {reduction!r} is not 'mean' or 'sum'")
    loss, logits = LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, bias, target.reshape(-1),
                                            ignore_index, float(label_smoothing), reduction, logits_shape is not None)
    return loss.to(loss_dtype), (logits.view(logits_shape) if logits is not None else None)


# --- the pass ----------------------------------------------------------------------------------------------------

_LINEAR = (torch._C._nn.linear, F.linear)
_CE = (F.cross_entropy,)
_CHAIN_METHODS = {"float", "to", "view", "reshape", "contiguous", "flatten"}
_DETACH = ("detach",)


@dataclass(frozen=True)
class Site:
    """One rewritten linear + cross-entropy: the layer's weight (its graph name) and the vocabulary."""
    weight: str
    vocab: int


def _value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _is_chain(node: fx.Node) -> bool:
    if node.op == "call_method" and node.target in _CHAIN_METHODS:
        if node.target == "to":  # a dtype cast (or a move to the same device), nothing else
            return all(isinstance(a, (torch.dtype, torch.device)) for a in node.args[1:]) and not node.kwargs
        return True
    return node.op == "call_function" and node.target in (torch.reshape,)


def _only_output(node: fx.Node) -> bool:
    """The node's value leaves the graph detached and nothing else reads it: detach, then outputs (or casts to
    outputs) only."""
    for user in node.users:
        if user.op == "output":
            continue
        if _is_chain(user) and _only_output(user):
            continue
        return False
    return True


def _detached_uses_only(node: fx.Node, chain_head: fx.Node) -> bool:
    for user in node.users:
        if user is chain_head:
            continue
        is_detach = (user.op == "call_method" and user.target in _DETACH) or (
            user.op == "call_function" and user.target in (torch.detach, torch.Tensor.detach))
        if not (is_detach and _only_output(user)):
            return False
    return True


def _match(ce: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the linear node, the first node of the chain after it) of a cross-entropy node fed by a linear layer."""
    if ce.op != "call_function" or ce.target not in _CE:
        return None
    kwargs = dict(ce.kwargs)
    if len(ce.args) > 2 or kwargs.get("weight") is not None or kwargs.get("reduction", "mean") not in ("mean", "sum"):
        return None
    if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
        return None
    logits_in = ce.args[0] if ce.args else kwargs.get("input")
    target = ce.args[1] if len(ce.args) > 1 else kwargs.get("target")
    if not isinstance(logits_in, fx.Node) or not isinstance(target, fx.Node):
        return None
    value, tvalue = _value(logits_in), _value(target)
    if value is None or tvalue is None or value.dim() != 2 or tvalue.dim() != 1 or tvalue.dtype.is_floating_point:
        return None  # class probabilities as targets, or a (N, C, d1...) layout: the stock graph
    node, head = logits_in, None
    while _is_chain(node):
        if len(node.users) != 1:
            return None
        head, node = node, node.args[0]
        if not isinstance(node, fx.Node):
            return None
    if node.op != "call_function" or node.target not in _LINEAR:
        return None
    head = head or ce
    if len(node.users) != 1 and not _detached_uses_only(node, head):
        return None
    out = _value(node)
    if out is None or out.shape[-1] != value.shape[-1] or out.numel() // max(out.shape[-1], 1) != tvalue.shape[0]:
        return None
    return node, head


def fuse_linear_cross_entropy(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[Site]]:
    """Rewrite each linear + cross-entropy of a Dynamo graph (module docstring); the graph and the sites rewritten."""
    sites = []
    for ce in list(gm.graph.nodes):
        found = _match(ce)
        if found is None:
            continue
        linear, head = found
        h, weight = linear.args[0], linear.args[1]
        bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
        target = ce.args[1] if len(ce.args) > 1 else ce.kwargs["target"]
        out, loss_value = _value(linear), _value(ce)
        keep_logits = len(linear.users) > 1
        with gm.graph.inserting_before(ce):
            fused = gm.graph.call_function(linear_cross_entropy, (h, weight, bias, target), {
                "ignore_index": ce.kwargs.get("ignore_index", -100),
                "label_smoothing": ce.kwargs.get("label_smoothing", 0.0),
                "reduction": ce.kwargs.get("reduction", "mean"),
                "logits_shape": tuple(out.shape) if keep_logits else None,
                "loss_dtype": loss_value.dtype if loss_value is not None else torch.float32})
            loss = gm.graph.call_function(operator.getitem, (fused, 0))
            logits = gm.graph.call_function(operator.getitem, (fused, 1)) if keep_logits else None
        ce.replace_all_uses_with(loss)
        if logits is not None:
            for user in [u for u in linear.users if u is not head]:
                user.replace_input_with(linear, logits)
        for dead in _chain_nodes(ce, linear):
            gm.graph.erase_node(dead)
        sites.append(Site(weight.name if isinstance(weight, fx.Node) else str(weight), int(out.shape[-1])))
    if sites:
        gm.graph.lint()
        gm.recompile()
    return gm, sites


def _chain_nodes(ce: fx.Node, linear: fx.Node) -> list[fx.Node]:
    """The cross-entropy, its chain and the linear node, in an order each can be erased (users first)."""
    order, node = [ce], ce.args[0] if ce.args else ce.kwargs["input"]
    while node is not linear:
        order.append(node)
        node = node.args[0]
    order.append(linear)
    return order

