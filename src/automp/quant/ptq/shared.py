"""Linears that read the same input tensor become slices of one int8 GEMM over their concatenated weights.

Attention's query, key and value projections read the same hidden state. As three W8A8 layers, the input is
quantized three times: three int8 copies written by the LayerNorm kernel that produces it. Three 768 -> 768 GEMMs
each fill the GPU for only a few waves. Concatenated, it is one quantization and one 768 -> 2304 GEMM. The slices
share one SmoothQuant factor per input channel (taken over the concatenated weight) and one static scale, as
SmoothQuant does for QKV.

    groups = input_groups(module, names, call)       # [("attn.q", "attn.k", "attn.v"), ...] from one calibration run
    slices = shared_layers(module, group, act, smooth)   # {name: Int8Slice} over one Int8Linear

The repeated calls of the shared layer are merged when the model is compiled (requant.dedupe).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from automp.quant.ptq import boundary
from automp.quant.int8 import Int8Linear, Int8Slice


def input_groups(module: nn.Module, names: list[str], call: boundary.Call) -> list[tuple[str, ...]]:
    """Groups (2 or more, in `names` order) of the named Linears whose input is one and the same tensor in a run of
    `call`. A layer called more than once per run (shared weights, a loop) is never grouped."""
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    with torch.no_grad():
        boundary.hooked_pass(module, names, lambda n, x, _: inputs[n].append(x), [call])
    groups: list[list[str]] = []
    for n in names:
        if len(inputs[n]) != 1:
            continue
        x = inputs[n][0]
        group = next((g for g in groups if inputs[g[0]][0] is x), None)
        if group is None:
            groups.append([n])
        else:
            group.append(n)
    return [tuple(g) for g in groups if len(g) > 1]


def concatenated(module: nn.Module, group: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The group's weights stacked along the output dimension, and their biases (zeros where a layer has none;
    None if no layer has one)."""
    layers = [module.get_submodule(n) for n in group]
    weight = torch.cat([lin.weight.detach().float() for lin in layers])
    if all(lin.bias is None for lin in layers):
        return weight, None
    return weight, torch.cat([lin.bias.detach().float() if lin.bias is not None else
                              torch.zeros(lin.out_features, device=weight.device) for lin in layers])


def shared_layers(module: nn.Module, group: tuple[str, ...], act: tuple[float, int] | None,
                  smooth: torch.Tensor | None) -> dict[str, Int8Slice]:
    """One Int8Linear over the group's concatenated weights (static qparams `act` or dynamic, SmoothQuant factors
    `smooth` or none), and each layer's slice of it."""
    weight, bias = concatenated(module, group)
    shared = Int8Linear(weight, bias, act, smooth)
    out, start = {}, 0
    for n in group:
        width = module.get_submodule(n).out_features
        out[n] = Int8Slice(shared, start, start + width)
        start += width
    return out
