"""CUDA graphs for small models: replay a root's compiled graphs instead of launching their kernels one by one.

On a small model the host is the bottleneck: Inductor launches each Triton kernel from Python, and on an H100 a
3-layer MLP's compiled training step measured 2.55 ms against 1.45 ms for the same step in eager (BENCHMARKS.md
section 0), although its GPU work takes a fraction of either. A CUDA graph replays all of a graph's kernels in
one launch. Inductor's cudagraph trees (what `mode="reduce-overhead"` turns on) do the recording; what automp adds
is the part a user would otherwise trip over: outputs that stay valid, and memory given back when the graphs
lose their trial (session.py decides when).
"""
from __future__ import annotations

from typing import Any, Callable

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


def skipped() -> int:
    """How many compiled graphs Inductor declined to record (CPU tensors, mutated inputs, ...): they run as
    compiled kernels, launched one by one."""
    from torch._dynamo.utils import counters
    return int(counters["inductor"].get("cudagraph_skips", 0))


def release() -> None:
    """Give back the recordings' private memory pools (every device's): for when no module runs graphed."""
    from torch._inductor import cudagraph_trees
    cudagraph_trees.reset_cudagraph_trees()
