"""The causal LMs weight-only quantization knows: per architecture, which linears read one activation and which op
produces it (`Arch`).

Shared by causal_lm (the layers to replace), awq (the groups whose scales it searches and where it folds them) and
automp.llm.fuse (the groups served by one kernel call), which is why it sits below all three.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


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


def is_causal_lm(model: nn.Module) -> bool:
    """Whether `model` is one of the architectures of ARCHS."""
    return type(model).__name__ in ARCHS
