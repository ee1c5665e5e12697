"""What automp.llm knows about a model before quantizing it: the quantization settings (`QuantConfig`, saved with the
model) and, per supported architecture, which linears read one activation and which op produces it (`Arch`).

Shared by quantize (the layers to replace), awq (the groups whose scales it searches and where it folds them) and
fuse (the groups served by one kernel call), which is why it sits below all three.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from automp.quant.weight_only import MIN_GROUP

SCHEMES = {"int8": 8, "int4": 4}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class QuantConfig:
    """How `quantize` treats a model (saved with it, so `load` rebuilds the same thing)."""
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
        g = self.group_size
        if g is not None and (not isinstance(g, int) or g < MIN_GROUP or g & (g - 1)):
            raise ValueError(f"automp.llm.quantize: group_size must be a power of two >= {MIN_GROUP} or None "
                             f"(per-channel), got {g!r}")
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


@dataclass(frozen=True)
class Group:
    """Linears (paths inside a decoder block) that read one activation, and the op that produces it (for AWQ)."""
    linears: tuple[str, ...]
    prev: str | None


@dataclass(frozen=True)
class Arch:
    blocks: str              # path of the ModuleList of decoder blocks
    groups: tuple[Group, ...]
    conv1d: bool             # weights stored [in, out] (GPT-2's transformers Conv1D)


ARCHS = {
    "LlamaForCausalLM": Arch("model.layers", (
        Group(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
        Group(("self_attn.o_proj",), "self_attn.v_proj"),
        Group(("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
        Group(("mlp.down_proj",), "mlp.up_proj")), conv1d=False),
    "GPT2LMHeadModel": Arch("transformer.h", (
        Group(("attn.c_attn",), "ln_1"),
        Group(("attn.c_proj",), "attn.c_attn"),
        Group(("mlp.c_fc",), "ln_2"),
        Group(("mlp.c_proj",), None)), conv1d=True),
}


def arch_of(model: nn.Module) -> Arch:
    name = type(model).__name__
    if name not in ARCHS:
        raise TypeError(f"automp.llm: unsupported architecture {name}; supported: {', '.join(sorted(ARCHS))}")
    return ARCHS[name]
