"""Which weights to zero: magnitude masks for the unstructured and the 2:4 semi-structured pattern.

Pure functions on tensors (True = keep). A weight that an earlier mask pruned scores below every live one, so a
new mask always prunes it again: re-pruning at a higher amount (the gradual schedule, or prune() called twice)
only ever adds zeros, and a 2:4 mask on an already sparse layer keeps its zeros where it can.
"""
from __future__ import annotations

import torch

GROUP, KEEP = 4, 2  # 2:4: in every group of 4 consecutive input-dim weights, keep 2


def scores(weight: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """|w| in float32, with already-pruned weights at -1 (below any magnitude)."""
    s = weight.detach().abs().float()
    return s if mask is None else s.masked_fill(~mask, -1.0)


def two_four_mask(weight: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the 2 largest |w| of every 4 consecutive weights along the last (input) dim: the layout sparse tensor
    cores read, since a Linear computes x @ W.T and each output row is a dot product over in_features."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(f"2:4 needs a 2-D weight whose last dim is a multiple of {GROUP}, got {list(weight.shape)}")
    rows, cols = weight.shape
    groups = scores(weight, mask).reshape(rows, cols // GROUP, GROUP)
    keep = groups.topk(KEEP, dim=-1).indices
    new = torch.zeros(groups.shape, dtype=torch.bool, device=weight.device).scatter_(-1, keep, True)
    new = new.reshape(rows, cols)
    return new if mask is None else new & mask


def _prune_smallest(flat_scores: torch.Tensor, amount: float) -> torch.Tensor:
    """Flat keep-mask with exactly round(amount * n) of the smallest scores pruned (ties broken by topk)."""
    n = flat_scores.numel()
    k = min(n, round(amount * n))
    keep = torch.ones(n, dtype=torch.bool, device=flat_scores.device)
    if k:
        keep[flat_scores.topk(k, largest=False).indices] = False
    return keep


def magnitude_mask(weight: torch.Tensor, amount: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Prune the fraction `amount` of smallest-|w| weights of one layer (exact count, rounded to nearest)."""
    keep = _prune_smallest(scores(weight, mask).flatten(), amount).reshape(weight.shape)
    return keep if mask is None else keep & mask


def global_magnitude_masks(weights: dict[str, torch.Tensor], amount: float,
                           masks: dict[str, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
    """One threshold over all layers: the fraction `amount` of all their weights, smallest |w| first. Layers whose
    weights are small as a whole lose more than `amount`, large ones less (what global pruning is for)."""
    masks = masks or {}
    flat = [scores(w, masks.get(name)).flatten().to(next(iter(weights.values())).device)
            for name, w in weights.items()]
    keep = _prune_smallest(torch.cat(flat), amount)
    out, start = {}, 0
    for (name, w), f in zip(weights.items(), flat):
        m = keep[start:start + f.numel()].reshape(w.shape).to(w.device)
        start += f.numel()
        old = masks.get(name)
        out[name] = m if old is None else m & old
    return out


def is_two_four(weight: torch.Tensor) -> bool:
    """At most 2 nonzeros in every group of 4 along the last dim (what sparse tensor cores can compress)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        return False
    nonzero = (weight.detach() != 0).reshape(weight.shape[0], -1, GROUP).sum(-1)
    return bool((nonzero <= KEEP).all())


def two_four_damage(weight: torch.Tensor) -> float:
    """Fraction of the layer's squared weight norm a 2:4 mask removes: how much one layer suffers from 2:4, used to
    prune the least sensitive layers first."""
    w = weight.detach().float()
    total = float((w * w).sum())
    if total == 0.0:
        return 0.0
    kept = w * two_four_mask(w)
    return 1.0 - float((kept * kept).sum()) / total


def sparsity(weight: torch.Tensor) -> float:
    """Fraction of exact zeros."""
    return float((weight.detach() == 0).sum()) / max(1, weight.numel())
