"""Weight-only int8 / int4 quantization of transformers causal LMs, for memory-bound batch-1 decoding.

`quantize` swaps every projection (attention q/k/v/o or GPT-2's c_attn/c_proj, and the MLP) for automp.quant's
`WeightOnlyLinear` (here also named `QuantLinear`) holding the packed codes: on CUDA the Triton kernels dequantize
in registers, so the weights cross memory in their packed form; on a CPU the layer runs a torch reference.
Embeddings, norms and lm_head stay in fp16/bf16 by default (lm_head optionally quantized): a small share of a large
model's bytes, and the layers where rounding costs the most accuracy. The input embedding can be quantized too
(`quantize_embeddings`, a `QuantEmbedding`): it costs no time (a decode step reads one row per token), but it is 6%
of TinyLlama-1.1B's fp16 bytes and with lm_head it is what keeps int4 weights above 30% of fp16 memory. The linears
that read one activation (q/k/v, gate/up) then share one kernel call per group (automp.llm.fuse: at batch 1 each call
costs its latency whatever its size), their buffers row slices of one tensor, saved as before.

The settings and the per-architecture layer groups are automp.llm.arch; AWQ (activation-aware scale search,
optional) is automp.llm.awq.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from automp.llm.arch import ARCHS, DTYPES, SCHEMES, Arch, QuantConfig, arch_of
from automp.llm.awq import collect_inputs, scale_block, search_scale
from automp.llm.fuse import fuse_projections
from automp.quant.api import set_module
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


def input_embedding(model: nn.Module) -> tuple[torch.device, torch.dtype, int, bool]:
    """(device, activation dtype, bytes, tied to the output head) of the model's input embedding, quantized or not."""
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        return emb.qw.device, emb.dtype, sum(t.numel() * t.element_size() for t in (emb.qw, emb.scales)), False
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    return emb.weight.device, emb.weight.dtype, emb.weight.numel() * emb.weight.element_size(), tied


# ----------------------------------------------------------------------------------------------- model surgery
def _dense(module: nn.Module, conv1d: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 copies of (weight [N, K], bias [N]) of an nn.Linear or a transformers Conv1D ([K, N] weight)."""
    w = module.weight.detach()
    w = (w.t() if conv1d else w).float().clone()
    b = module.bias.detach().float().clone() if getattr(module, "bias", None) is not None else None
    return w, b


def target_paths(model: nn.Module, config: QuantConfig) -> list[str]:
    """Every module `quantize` replaces, checked for group-size compatibility before anything changes."""
    arch = arch_of(model)
    blocks = model.get_submodule(arch.blocks)
    paths = [f"{arch.blocks}.{i}.{lin}" for i in range(len(blocks)) for g in arch.groups for lin in g.linears]
    if config.quantize_lm_head:
        paths.append("lm_head")
    if config.quantize_embeddings:
        emb = model.get_input_embeddings()
        if isinstance(emb, QuantEmbedding):
            raise ValueError("automp.llm.quantize: the input embedding is already quantized (quantize the original "
                             "model)")
        if not config.quantize_lm_head and input_embedding(model)[3]:
            raise ValueError("automp.llm.quantize: the input embedding is tied to lm_head: quantizing it alone would "
                             "keep the fp16 matrix for the head (no memory saved); pass quantize_lm_head=True too")
        d = emb.weight.shape[1]
        if config.group_size is not None and d % config.group_size:
            raise ValueError(f"automp.llm.quantize: group_size {config.group_size} does not divide the embedding "
                             f"dim {d}; use a power of two dividing {d}, or group_size=None (one scale per row)")
    for p in paths:
        m = model.get_submodule(p)
        if isinstance(m, QuantLinear):
            raise ValueError(f"automp.llm.quantize: {p} is already quantized (quantize the original model)")
        k = m.weight.shape[0] if arch.conv1d and p != "lm_head" else m.weight.shape[1]
        if config.group_size is not None and k % config.group_size:
            raise ValueError(f"automp.llm.quantize: group_size {config.group_size} does not divide K={k} of layer "
                             f"{p}; use a power of two dividing {k}, or group_size=None (one scale per row)")
    return paths


# ----------------------------------------------------------------------------------------------- entry point
def quantize(model: nn.Module, scheme: str = "int4", group_size: int | None = 128, calib: torch.Tensor | None = None,
             awq: bool = False, quantize_lm_head: bool = False, dtype: str = "float16",
             quantize_embeddings: bool = False, edge_scheme: str | None = None, fuse: bool = True) -> nn.Module:
    """Quantize `model` (LlamaForCausalLM or GPT2LMHeadModel) in place to weight-only int8/int4 and return it.

    calib: int64 token ids [B, T] (or [T]) for the AWQ scale search (required with awq=True). Every argument and
    every layer is checked before the model is touched. The rest of the model is cast to `dtype`. fuse: the linears
    that read one activation (q/k/v, gate/up) run as one kernel call each (automp.llm.fuse; same results).
    """
    config = QuantConfig(scheme, group_size, awq, quantize_lm_head, dtype, quantize_embeddings, edge_scheme, fuse)
    arch = arch_of(model)
    target_paths(model, config)
    if awq:
        if calib is None:
            raise ValueError("automp.llm.quantize: awq=True needs calib (int64 token ids [B, T])")
        calib = torch.as_tensor(calib)
        if calib.dtype != torch.int64 or calib.dim() not in (1, 2) or calib.numel() == 0:
            raise ValueError(f"automp.llm.quantize: calib must be non-empty int64 token ids [B, T], got "
                             f"{calib.dtype} {tuple(calib.shape)}")
        calib = calib.reshape(-1, calib.shape[-1])
    act = DTYPES[dtype]
    inputs = collect_inputs(model, arch, calib) if awq else {}
    blocks = model.get_submodule(arch.blocks)
    for i, block in enumerate(blocks):
        prefix = f"{arch.blocks}.{i}."
        dense = {f"{prefix}{lin}": list(_dense(model.get_submodule(f"{prefix}{lin}"), arch.conv1d))
                 for g in arch.groups for lin in g.linears}
        scales: dict[int, torch.Tensor] = {}
        alphas: dict[str, float] = {}
        for gi, g in enumerate(arch.groups if awq else ()):  # searched on the unscaled weights, then applied
            names = [f"{prefix}{lin}" for lin in g.linears]
            scales[gi], alpha = search_scale(inputs[names[0]], [dense[n][0] for n in names], config.bits,
                                             group_size)
            alphas.update({n: alpha for n in names})
        explicit = scale_block(block, prefix, arch, dense, scales)
        for name, (w, b) in dense.items():
            set_module(model, name, QuantLinear.from_weight(w, b, config.bits, group_size, act, explicit.get(name),
                                                            alphas.get(name)))
    if quantize_lm_head:
        head = model.get_submodule("lm_head")
        w, b = _dense(head, conv1d=False)
        set_module(model, "lm_head", QuantLinear.from_weight(w, b, config.edge_bits, group_size, act))
        model.config.tie_word_embeddings = False  # the fp16 input embedding and the quantized head are now separate
    if quantize_embeddings:
        emb = model.get_input_embeddings()
        model.set_input_embeddings(QuantEmbedding.from_weight(emb.weight, config.edge_bits, group_size, act))
    for p in model.parameters():
        p.data = p.data.to(act)
    for attr in ("dtype", "torch_dtype"):
        if attr in model.config.to_dict():
            setattr(model.config, attr, act)
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
