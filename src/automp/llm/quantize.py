"""`automp.llm.quantize`: weight-only int8 / int4 quantization of a transformers causal LM in automp.llm's names, for
memory-bound decoding. A preset over automp.quant's one verb: the model goes to
`automp.quant.quantize(model, WeightOnlyConfig(...))` (automp.quant.causal_lm says what it does, automp.quant.awq how
AWQ scales), then the projections that read one activation (q/k/v, gate/up) are fused into one kernel call per group
(automp.llm.fuse: at batch 1 each call costs its latency whatever its size), their buffers row slices of one tensor,
saved as before.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from automp.llm.fuse import fuse_projections
from automp.quant.api import quantize as quantize_model
from automp.quant.api import set_module
from automp.quant.archs import ARCHS, Arch, arch_of
from automp.quant.causal_lm import QuantConfig, input_embedding, target_paths
from automp.quant.names import DTYPES, SCHEMES
from automp.quant.weight_only import QuantEmbedding, WeightOnlyLinear

QuantLinear = WeightOnlyLinear  # the name automp.llm has always exported
__all__ = ["quantize", "QuantConfig", "QuantLinear", "QuantEmbedding", "check_backend", "input_embedding",
           "target_paths", "set_module", "is_quantized", "weight_bytes", "ARCHS", "DTYPES", "SCHEMES", "Arch",
           "arch_of"]


def check_backend(bits: int, device: torch.device | str) -> None:
    """Quantized layers run on CUDA (Triton kernels) or on the CPU (torch reference); any other device is an error
    here, named, rather than a failure deep inside a kernel call."""
    if bits not in SCHEMES.values():
        raise ValueError(f"automp.llm: weight bits must be one of {sorted(SCHEMES.values())}, got {bits!r}")
    if torch.device(device).type not in ("cuda", "cpu"):
        raise RuntimeError(f"automp.llm: int{bits} weights run on a CUDA device or the CPU; got device "
                           f"{torch.device(device)}")


def quantize(model: nn.Module, scheme: str = "int4", group_size: int | None = 128, calib: torch.Tensor | None = None,
             awq: bool = False, quantize_lm_head: bool = False, dtype: str = "float16",
             quantize_embeddings: bool = False, edge_scheme: str | None = None, fuse: bool = True) -> nn.Module:
    """Quantize `model` (LlamaForCausalLM or GPT2LMHeadModel) in place to weight-only int8/int4 and return it.

    calib: int64 token ids [B, T] (or [T]) for the AWQ scale search (required with awq=True). Every argument and
    every layer is checked before the model is touched. The rest of the model is cast to `dtype`. fuse: the linears
    that read one activation (q/k/v, gate/up) run as one kernel call each (automp.llm.fuse; same results).
    """
    config = QuantConfig(scheme, group_size, awq, quantize_lm_head, dtype, quantize_embeddings, edge_scheme, fuse)
    arch_of(model)  # an unsupported model is named here, not by automp.quant's per-layer default
    quantize_model(model, config.weight_only(calib))
    model.automp_quant = config
    fuse_projections(model)
    return model.eval()


def is_quantized(model: nn.Module) -> bool:
    return isinstance(getattr(model, "automp_quant", None), QuantConfig)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
