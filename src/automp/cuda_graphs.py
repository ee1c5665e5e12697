"""CUDA graphs for small models: replay a root's compiled graphs instead of launching their kernels one by one.

On a small model the host is the bottleneck: Inductor launches each Triton kernel from Python, and on an H100 a
3-layer MLP's compiled training step measured 2.55 ms against 1.45 ms for the same step in eager (BENCHMARKS.md
section 0), although its GPU work takes a fraction of either. A CUDA graph replays all of a graph's kernels in
one launch. Inductor's cudagraph trees (what `mode="reduce-overhead"` turns on) do the recording; what automp adds
is the part a user would otherwise trip over: outputs and gradients that stay valid, and memory given back when
the graphs lose their trial (session.py decides when).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.utils._pytree import tree_map_only


def owned_outputs(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """A CUDA graph writes its outputs into the same memory at every replay, and torch raises an error when a
    script reads an output it kept from an earlier iteration (a list of losses, logits gathered over an evaluation
    loop). The script gets copies of its own (one device copy per output tensor: small, on the models that run
    graphed), so code that worked as written keeps working. Gradients flow through the copies."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return tree_map_only(torch.Tensor, torch.clone, compiled(*args, **kwargs))

    return call


class StableGrads:
    """Gradients that outlive the next replay. A backward replayed as a CUDA graph returns each parameter's gradient
    in the graph's memory pool, and autograd installs that very tensor as `.grad` when the parameter had none. The
    next iteration's replay frees it, so a script that adds to a gradient across iterations or across backward
    calls (gradient accumulation; a DCGAN's generator step, whose backward runs through the discriminator after
    the discriminator's own step, without zeroing it) or zeroes it in place would read freed memory, and torch
    raises. So at the end of every backward, the gradients of the watched parameters that autograd took from the
    pool are replaced by copies, in one multi-tensor pass; a gradient accumulated in place into such a copy is
    left alone."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.copies: dict[int, int] = {}  # id(param) -> data_ptr of the gradient copy installed for it
        self.pending: list[torch.Tensor] = []

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(self._accumulated))

    def _accumulated(self, p: torch.Tensor) -> None:
        if p.grad is None or p.grad.data_ptr() == self.copies.get(id(p)):
            return
        if not self.pending:  # the first of this backward: copy them all once the engine is done
            torch.autograd.Variable._execution_engine.queue_callback(self._copy)
        self.pending.append(p)

    def _copy(self) -> None:
        params, self.pending = self.pending, []
        dense = [p for p in params if not p.grad.is_sparse]
        for p, g in zip(dense, torch._foreach_mul([p.grad for p in dense], 1.0)):
            p.grad = g
        for p in params:
            if p.grad.is_sparse:
                p.grad = p.grad.clone()
            self.copies[id(p)] = p.grad.data_ptr()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.copies, self.pending = [], {}, []


def skipped() -> int:
    """How many compiled graphs Inductor declined to record (CPU tensors, mutated inputs, ...): they run as
    compiled kernels, launched one by one."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"].get("cudagraph_skips", 0))


def release() -> None:
    """Give back the recordings' private memory pools (every device's): for when no module runs graphed."""
    from torch._inductor import cudagraph_trees
    cudagraph_trees.reset_cudagraph_trees()
