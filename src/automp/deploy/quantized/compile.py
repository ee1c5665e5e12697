"""Compile a converted model for fixed input shapes: Inductor + CUDA graphs on CUDA, eager on the CPU.

Why compile at all: dynamic int8 activations are quantized in the forward (row absmax, divide, round, cast), a
handful of elementwise kernels per Linear in eager mode. Inductor fuses them into one kernel per Linear input, and
with the LayerNorm / GELU / residual kernels around them; CUDA graphs ("reduce-overhead") then remove the launch
cost that dominates at batch 1. The automp kernels are torch.library custom ops with fake impls, so Dynamo traces
them as single opaque nodes (no graph break); `graph_breaks` checks that for a given model and input.

Wide rows: a dynamic int8 activation needs its row's absmax before any element can be quantized. Inductor keeps a
row in registers (one read) only up to 1024 elements; a wider row (BERT's 3072-wide MLP activation, fused with the
GELU that produces it) becomes a looped reduction that reads the row and recomputes the GELU twice. Inductor's
multi-kernel mode would compile the one-read version too (and pick it where it is faster), but with torch 2.11 and
Triton 3.6 it fails to compile a model whose kernels come from a warm Inductor cache (a TypeError in
multi_kernel's cache_file_path: the second process on a machine crashes), so it is left off. Static activations
have no row reduction at all.

Static activations: the requant pass (automp.deploy.quantized.requant) lets a GEMM whose output only feeds the next
layer's static quantization (an MLP's first GEMM, through its GELU) write that int8 input from its epilogue.

Shapes are static (dynamic=False): each new input shape compiles and records once, as the anchor
`torch.compile(model.half(), mode="reduce-overhead")` does. CUDA-graph outputs are overwritten by the next call of
the same graph: clone an output you keep across calls.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from automp.deploy.quantized.requant import RequantPass

MODES = ("reduce-overhead", "default", "max-autotune", "max-autotune-no-cudagraphs")


def _device_type(model: nn.Module) -> str:
    return next((t.device.type for t in list(model.parameters()) + list(model.buffers())), "cpu")


def compile_module(model: nn.Module, mode: str = "reduce-overhead", backend: str | None = None) -> nn.Module:
    """torch.compile(model, mode=mode, dynamic=False) when the model is on CUDA or a backend is named (tests use
    backend="eager" / "aot_eager" on the CPU); otherwise the model itself, to run eagerly."""
    if mode not in MODES:
        raise ValueError(f"compile mode must be one of {MODES}, got {mode!r}")
    if backend is not None:
        return torch.compile(model, backend=backend, dynamic=False)
    if _device_type(model) != "cuda":
        return model
    return torch.compile(model, dynamic=False, options=inductor_options(mode))


def inductor_options(mode: str) -> dict[str, Any]:
    """The options `mode` stands for (torch.compile takes a mode or options, not both), plus the requant pass for
    static activations (see the module docstring)."""
    from torch._inductor import list_mode_options
    return {**list_mode_options(mode), "post_grad_custom_post_pass": RequantPass()}


def graph_breaks(model: nn.Module, *args: Any, **kwargs: Any) -> tuple[int, list[str]]:
    """(graph break count, reasons) of Dynamo tracing model(*args, **kwargs); 0 means one whole graph."""
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(*args, **kwargs)
    return explained.graph_break_count, [str(b.reason) for b in explained.break_reasons]
