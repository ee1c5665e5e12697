"""Least-squares refit of a pruned layer: the weights a mask keeps are solved again to reproduce what the dense
model computed, on calibration inputs. After a one-shot 2:4 cut this recovers most of the accuracy in seconds,
without a training loop (the idea of OBS / SparseGPT reconstruction; here solved exactly, row by row, since 2:4
fixes each row's kept columns). The caller chooses inputs and targets; the useful choice is the layer's input in
the pruned model and the dense model's output, so that each layer also corrects the error of the layers before it.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def refit(linear: nn.Linear, keep: torch.Tensor, x: torch.Tensor, y: torch.Tensor, ridge: float = 0.1,
          chunk: int = 128) -> None:
    """Set the kept weights (and the bias) of `linear` to argmin ||x W^T + b - y||^2 + lam ||W - W0||^2, pruned
    weights zero. W0 is the layer's weight as it is: the prior keeps the fit close to what the model learned where
    the calibration data says little. lam = `ridge` * mean input energy; the bias is not penalised.

    keep: bool [out, in], the same number of kept weights in every row (2:4 has); x: [n, in]; y: [n, out].
    Each row is one small normal-equations solve (Cholesky), `chunk` rows at a time."""
    rows, cols = linear.weight.shape
    if keep.shape != (rows, cols) or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool mask of the weight's shape {[rows, cols]}, got "
                         f"{keep.dtype} {list(keep.shape)}")
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.shape[1] != cols or y.shape[1] != rows:
        raise ValueError(f"refit needs x [n, {cols}] and y [n, {rows}], got {list(x.shape)} and {list(y.shape)}")
    per_row = int(keep[0].sum())
    if not bool((keep.sum(1) == per_row).all()):
        raise ValueError("refit needs the same number of kept weights in every row (as 2:4 has)")
    dev, bias = x.device, linear.bias is not None
    keep = keep.to(dev)
    xa = torch.cat([x.float(), torch.ones(x.shape[0], 1, device=dev)], 1) if bias else x.float()
    gram, cross = xa.T @ xa, xa.T @ y.float().to(dev)
    lam = ridge * float(gram.diagonal()[:cols].mean())
    idx = keep.nonzero()[:, 1].reshape(rows, per_row)
    w0 = linear.weight.detach().float().to(dev).gather(1, idx)
    penalty = torch.full((per_row,), lam, device=dev)
    if bias:  # the bias is one more "column" of every row, always kept, never penalised
        idx = torch.cat([idx, torch.full((rows, 1), cols, device=dev)], 1)
        w0 = torch.cat([w0, torch.zeros(rows, 1, device=dev)], 1)
        penalty = torch.cat([penalty, torch.zeros(1, device=dev)])
    solved = torch.empty(rows, idx.shape[1], device=dev)
    for s in range(0, rows, chunk):
        ii, r = idx[s:s + chunk], torch.arange(s, min(rows, s + chunk), device=dev)
        lhs = gram[ii[:, :, None], ii[:, None, :]] + penalty.diag()
        rhs = cross[ii, r[:, None]] + lam * w0[s:s + chunk]
        solved[s:s + chunk] = torch.cholesky_solve(rhs.unsqueeze(-1), torch.linalg.cholesky(lhs)).squeeze(-1)
    w = torch.zeros(rows, cols, device=dev).scatter_(1, idx[:, :per_row], solved[:, :per_row])
    with torch.no_grad():
        linear.weight.copy_(w)
        if bias:
            linear.bias.copy_(solved[:, -1])
