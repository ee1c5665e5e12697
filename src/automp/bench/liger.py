"""Liger-Kernel on a transformers Llama, as the strongest hand-written loop for an HF LLM has it (`automp bench fp8`
and `automp bench zoo`, mode bf16-liger). Liger-Kernel is an optional bench anchor (`pip install liger_kernel`),
imported only when that mode runs."""
from __future__ import annotations

import torch
import torch.nn as nn


def with_liger(model: nn.Module) -> None:
    """Liger-Kernel's fused linear cross-entropy (no logits) on a transformers Llama instance, as transformers'
    Trainer applies it (`use_liger_kernel=True`). Under torch.compile (torch 2.11, Liger 0.8.5) Liger's RMSNorm
    kernel fails Inductor's Triton compile and Dynamo fails to trace its fused linear cross-entropy, so what a user can
    run is the compiled model with that one function left to run eagerly (`torch.compiler.disable`, a graph break at
    the loss): RMSNorm and SwiGLU stay transformers' own, which Inductor fuses as Liger's kernels would. Liger's RoPE
    is left out: it replaces a function of transformers' Llama module, which every other model built in this process
    would then run; the two classes it replaces there go back once this model's instances hold Liger's, for the
    same reason."""
    import liger_kernel.transformers.functional as liger_functional
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama
    if not isinstance(model, modeling_llama.LlamaForCausalLM):
        raise RuntimeError(f"bf16-liger: Liger's Llama kernels do not apply to {type(model).__name__}")
    saved = {name: getattr(modeling_llama, name) for name in ("LlamaRMSNorm", "LlamaMLP")}
    try:
        apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, fused_linear_cross_entropy=True,
                                    model=model)
    finally:
        for name, value in saved.items():
            setattr(modeling_llama, name, value)
    fused = liger_functional.liger_fused_linear_cross_entropy
    if not getattr(fused, "_torchdynamo_disable", False):  # looked up at each call (liger's loss_utils)
        liger_functional.liger_fused_linear_cross_entropy = torch.compiler.disable(fused)
