"""Weight-only int8 / int4 quantization of a causal LM, for memory-bound decoding: automp.quant's model handler for
WeightOnlyConfig on the architectures of automp.quant.archs.

    quantize(model, WeightOnlyConfig(bits=4, group_size=128))                  # automp.quant.quantize
    quantize(model, WeightOnlyConfig(bits=4, awq=True, calib=token_ids))       # AWQ scales (automp.quant.awq)

Every projection (attention q/k/v/o or GPT-2's c_attn/c_proj, and the MLP) becomes a `WeightOnlyLinear` holding the
packed codes: on CUDA the Triton kernels dequantize in registers, so the weights cross memory in their packed form;
on a CPU the layer runs a torch reference. Embeddings, norms and lm_head stay in fp16/bf16 by default (lm_head and the
input embedding optionally quantized, at `edge_bits`): a small share of a large model's bytes, and the layers where
rounding costs the most accuracy. The input embedding costs no time when quantized (a decode step reads one row per
token), but it is 6% of TinyLlama-1.1B's fp16 bytes and with lm_head it is what keeps int4 weights above 30% of fp16
memory. The rest of the model is cast to the config's dtype, and `model.automp_quant` records what was done
(QuantConfig: what automp.llm saves and generates from). Every setting and every layer is checked before the model
is touched. automp.llm.quantize is this with automp.llm's names, and the projections that read one activation fused
into one kernel call per group (automp.llm.fuse).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from automp.quant.api import FilterFn, WeightOnlyConfig, register_model_handler, set_module
from automp.quant.archs import arch_of, is_causal_lm
from automp.quant.awq import collect_inputs, scale_block, search_scale
from automp.quant.names import DTYPES, SCHEMES, dtype_name
from automp.quant.weight_only import MIN_GROUP, QuantEmbedding, WeightOnlyLinear, valid_group


@dataclass(frozen=True)
class QuantConfig:
    """How a causal LM was quantized, in automp.llm's terms: set on the model (`model.automp_quant`) and saved with it,
    so that automp.llm.store.load rebuilds the same thing. `weight_only()` is the same as automp.quant's config."""
    scheme: str = "int4"               # "int4" | "int8"
    group_size: int | None = 128       # power of two >= 32 dividing every K, or None for one scale per row
    awq: bool = False
    quantize_lm_head: bool = False
    dtype: str = "float16"             # activations and the unquantized weights: "float16" | "bfloat16"
    quantize_embeddings: bool = False  # the input embedding too (QuantEmbedding)
    edge_scheme: str | None = None     # lm_head and the input embedding, where quantized: None = `scheme`
    fuse: bool = True                  # q/k/v and gate/up as one kernel call each (automp.llm.fuse)

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"automp.llm.quantize: scheme must be one of {sorted(SCHEMES)}, got {self.scheme!r}")
        if not valid_group(self.group_size):
            raise ValueError(f"automp.llm.quantize: group_size must be a power of two >= {MIN_GROUP} or None "
                             f"(per-channel), got {self.group_size!r}")
        if self.edge_scheme is not None and self.edge_scheme not in SCHEMES:
            raise ValueError(f"automp.llm.quantize: edge_scheme must be one of {sorted(SCHEMES)} or None, got "
                             f"{self.edge_scheme!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"automp.llm.quantize: dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def bits(self) -> int:
        return SCHEMES[self.scheme]

    @property
    def edge_bits(self) -> int:
        """Bits of lm_head and the input embedding: on a small model int4 there cost perplexity where int8 cost
        almost none (BENCHMARKS.md, "Perplexity"), for a few percent of a large model's bytes."""
        return SCHEMES[self.edge_scheme or self.scheme]

    def weight_only(self, calib: torch.Tensor | None = None) -> WeightOnlyConfig:
        """The WeightOnlyConfig that quantizes a model as this record says (`calib`: AWQ's token ids)."""
        return WeightOnlyConfig(self.bits, self.group_size, DTYPES[self.dtype], self.awq, calib, self.quantize_lm_head,
                                self.quantize_embeddings, SCHEMES[self.edge_scheme] if self.edge_scheme else None)

    @classmethod
    def of(cls, config: WeightOnlyConfig, fuse: bool = True) -> "QuantConfig":
        scheme = {bits: name for name, bits in SCHEMES.items()}
        return cls(scheme[config.bits], config.group_size, config.awq, config.lm_head, dtype_name(config.dtype),
                   config.embeddings, scheme[config.edge_bits] if config.edge_bits is not None else None, fuse)


def input_embedding(model: nn.Module) -> tuple[torch.device, torch.dtype, int, bool]:
    """(device, activation dtype, bytes, tied to the output head) of the model's input embedding, quantized or not."""
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        return emb.qw.device, emb.dtype, sum(t.numel() * t.element_size() for t in (emb.qw, emb.scales)), False
    head = model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    return emb.weight.device, emb.weight.dtype, emb.weight.numel() * emb.weight.element_size(), tied


def _dense(module: nn.Module, conv1d: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 copies of (weight [N, K], bias [N]) of an nn.Linear or a transformers Conv1D ([K, N] weight)."""
    w = module.weight.detach()
    w = (w.t() if conv1d else w).float().clone()
    b = module.bias.detach().float().clone() if getattr(module, "bias", None) is not None else None
    return w, b


def target_paths(model: nn.Module, config: QuantConfig) -> list[str]:
    """Every module the handler replaces, checked for group-size compatibility before anything changes."""
    arch = arch_of(model)
    blocks = model.get_submodule(arch.blocks)
    paths = [f"{arch.blocks}.{i}.{lin}" for i in range(len(blocks)) for g in arch.groups for lin in g.linears]
    if config.quantize_lm_head:
        paths.append("lm_head")
    if config.quantize_embeddings:
        emb = model.get_input_embeddings()
        if isinstance(emb, QuantEmbedding):
            raise ValueError("automp.quant.quantize: the input embedding is already quantized (quantize the original "
                             "model)")
        if not config.quantize_lm_head and input_embedding(model)[3]:
            raise ValueError("automp.quant.quantize: the input embedding is tied to lm_head: quantizing it alone would "
                             "keep the fp16 matrix for the head (no memory saved); pass quantize_lm_head=True too")
        d = emb.weight.shape[1]
        if config.group_size is not None and d % config.group_size:
            raise ValueError(f"automp.quant.quantize: group_size {config.group_size} does not divide the embedding "
                             f"dim {d}; use a power of two dividing {d}, or group_size=None (one scale per row)")
    for p in paths:
        m = model.get_submodule(p)
        if isinstance(m, WeightOnlyLinear):
            raise ValueError(f"automp.quant.quantize: {p} is already quantized (quantize the original model)")
        k = m.weight.shape[0] if arch.conv1d and p != "lm_head" else m.weight.shape[1]
        if config.group_size is not None and k % config.group_size:
            raise ValueError(f"automp.quant.quantize: group_size {config.group_size} does not divide K={k} of layer "
                             f"{p}; use a power of two dividing {k}, or group_size=None (one scale per row)")
    return paths


@register_model_handler(WeightOnlyConfig, lambda model, config: is_causal_lm(model))
def quantize_causal_lm(model: nn.Module, config: WeightOnlyConfig, filter_fn: FilterFn | None = None) -> nn.Module:
    """Quantize `model` in place as the module docstring says and return it (in eval mode). filter_fn(module, path),
    given, narrows the projections (and lm_head) to those it selects; AWQ scales whole groups, so it takes none."""
    if config.budget is not None or config.exclude:
        raise ValueError("automp.quant.quantize: budget and exclude are automp.quant.ptq's, for modules that are not "
                         "causal LMs; on a causal LM pick the projections with filter_fn")
    record = QuantConfig.of(config)
    arch = arch_of(model)
    chosen = set(target_paths(model, record))
    if filter_fn is not None:
        if config.awq:
            raise ValueError("automp.quant.quantize: awq scales whole groups of projections; it takes no filter_fn")
        chosen = {p for p in chosen if filter_fn(model.get_submodule(p), p)}
        if not chosen:
            raise ValueError(f"automp.quant.quantize: no projection of {type(model).__name__} matched the filter")
    group_size, calib, awq, bits, edge_bits = (config.group_size, config.calib, config.awq, record.bits,
                                               record.edge_bits)
    if awq:
        if calib is None:
            raise ValueError("automp.quant.quantize: awq=True needs calib (int64 token ids [B, T])")
        calib = torch.as_tensor(calib)
        if calib.dtype != torch.int64 or calib.dim() not in (1, 2) or calib.numel() == 0:
            raise ValueError(f"automp.quant.quantize: calib must be non-empty int64 token ids [B, T], got "
                             f"{calib.dtype} {tuple(calib.shape)}")
        calib = calib.reshape(-1, calib.shape[-1])
    act = config.dtype
    inputs = collect_inputs(model, arch, calib) if awq else {}
    blocks = model.get_submodule(arch.blocks)
    for i, block in enumerate(blocks):
        prefix = f"{arch.blocks}.{i}."
        dense = {f"{prefix}{lin}": list(_dense(model.get_submodule(f"{prefix}{lin}"), arch.conv1d))
                 for g in arch.groups for lin in g.linears if f"{prefix}{lin}" in chosen}
        scales: dict[int, torch.Tensor] = {}
        alphas: dict[str, float] = {}
        for gi, g in enumerate(arch.groups if awq else ()):  # searched on the unscaled weights, then applied
            names = [f"{prefix}{lin}" for lin in g.linears]
            scales[gi], alpha = search_scale(inputs[names[0]], [dense[n][0] for n in names], bits, group_size)
            alphas.update({n: alpha for n in names})
        explicit = scale_block(block, prefix, arch, dense, scales)
        for name, (w, b) in dense.items():
            set_module(model, name, WeightOnlyLinear.from_weight(w, b, bits, group_size, act, explicit.get(name),
                                                                 alphas.get(name)))
    if "lm_head" in chosen:
        head = model.get_submodule("lm_head")
        w, b = _dense(head, conv1d=False)
        set_module(model, "lm_head", WeightOnlyLinear.from_weight(w, b, edge_bits, group_size, act))
        model.config.tie_word_embeddings = False  # the fp16 input embedding and the quantized head are now separate
    if config.embeddings:
        emb = model.get_input_embeddings()
        model.set_input_embeddings(QuantEmbedding.from_weight(emb.weight, edge_bits, group_size, act))
    for p in model.parameters():
        p.data = p.data.to(act)
    for attr in ("dtype", "torch_dtype"):
        if attr in model.config.to_dict():
            setattr(model.config, attr, act)
    model.automp_quant = record
    return model.eval()
