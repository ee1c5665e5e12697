"""AWQ (Lin et al. 2023), optional in weight-only quantization of a causal LM (automp.quant.causal_lm): a few input channels carry much larger activations than
the rest, and their weights matter more. Scaling weight column k by s_k (and the activation by 1/s_k) gives those
columns more of the int grid.
Per group of linears that read one activation, s = mean|x|^alpha with alpha chosen on a grid in [0, 1] to minimise the
group's output MSE on calibration activations (alpha = 0 is plain quantization, so the search never does worse on
them). 1/s is folded into the op that produces the activation: the RMSNorm/LayerNorm weight (and bias) before q/k/v
and before the MLP's up projections; the trailing output rows of v_proj (or c_attn's v part) before o_proj/c_proj, and
of up_proj before down_proj (the attention output is linear in v, and act(gate) * up is linear in up). Where no such
op exists (GPT-2's mlp.c_proj reads gelu(c_fc); o_proj under grouped-query attention, whose input repeats each v
head), 1/s stays in the WeightOnlyLinear as an explicit input multiply. The search's clipping step from the paper is
not done.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from automp.quant.archs import Arch
from automp.quant.weight_only import fake_quant

AWQ_GRID = 20          # alphas 0, 0.05, ..., 0.95
AWQ_MAX_ROWS = 1024    # calibration rows kept per activation: enough for the MSE, bounded memory on large models


def search_scale(x: torch.Tensor, weights: list[torch.Tensor], bits: int, group_size: int | None,
                 grid: int = AWQ_GRID) -> tuple[torch.Tensor, float]:
    """(s [K], alpha): the per-input-channel scale s = mean|x|^alpha minimising sum_i ||x W_i^T - (x/s) Q(W_i s)^T||^2
    over alpha in {0, 1/grid, ..., (grid-1)/grid}; x [T, K] and weights [N_i, K] in fp32."""
    x_mean = x.abs().mean(dim=0)
    refs = [x @ w.t() for w in weights]
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for i in range(grid):
        alpha = i / grid
        s = x_mean.pow(alpha).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()  # centred on 1: keeps the scaled weights' range near the original
        err = sum(float(((x / s) @ fake_quant(w * s, bits, group_size).t() - r).pow(2).mean())
                  for w, r in zip(weights, refs))
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def collect_inputs(model: nn.Module, arch: Arch, calib: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inputs (fp32 [T, K], at most AWQ_MAX_ROWS rows) of the first linear of every group, from one calibration pass
    of the unquantized model: folding leaves every function the model computes unchanged, so they stay valid."""
    blocks = model.get_submodule(arch.blocks)
    firsts = {f"{arch.blocks}.{i}.{g.linears[0]}" for i in range(len(blocks)) for g in arch.groups}
    seen: dict[str, list[torch.Tensor]] = {p: [] for p in firsts}
    hooks = []
    for p in firsts:
        def hook(_mod, args, p=p):
            x = args[0].detach()
            seen[p].append(x.reshape(-1, x.shape[-1]).float())
        hooks.append(model.get_submodule(p).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            for rows in calib.to(device).split(8):
                model(input_ids=rows, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for p, xs in seen.items():
        x = torch.cat(xs)
        if x.shape[0] > AWQ_MAX_ROWS:
            x = x[torch.linspace(0, x.shape[0] - 1, AWQ_MAX_ROWS, device=x.device).long()]
        out[p] = x
    return out


def _fold(block: nn.Module, prev: str, s: torch.Tensor, dense: dict[str, list], prefix: str) -> bool:
    """Divide the output of `prev` by s (exactly compensating the weight columns' * s); False if impossible."""
    if f"{prefix}{prev}" in dense:  # a linear: scale its trailing K output rows (v's outputs, up's outputs)
        w, b = dense[f"{prefix}{prev}"]
        k = s.numel()
        if w.shape[0] < k:  # grouped-query v_proj: o_proj's input repeats v heads, no one-to-one channel
            return False
        w[-k:] /= s[:, None]
        if b is not None:
            b[-k:] /= s
        return True
    norm = block.get_submodule(prev)
    with torch.no_grad():
        norm.weight.div_(s.to(norm.weight.dtype))
        if getattr(norm, "bias", None) is not None:
            norm.bias.div_(s.to(norm.bias.dtype))
    return True


def scale_block(block: nn.Module, prefix: str, arch: Arch, dense: dict[str, list],
                scales: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Apply AWQ scales {group index: s} to one block: the group's weight columns (fp32 copies in `dense`) times s,
    1/s folded into the producing op; returns the 1/s input multiplies of the groups where no fold was possible."""
    explicit = {}
    for gi, s in scales.items():
        g = arch.groups[gi]
        names = [f"{prefix}{lin}" for lin in g.linears]
        for n in names:
            dense[n][0] *= s[None, :]
        if g.prev is None or not _fold(block, g.prev, s, dense, prefix):
            explicit.update({n: 1.0 / s for n in names})
    return explicit
