"""Script-style training loops, unchanged except for fp16 compute: with the hook installed they reach the FP32
final loss (within 2 %); the same loops without scaling do not, since the loss is in small units (x 2^-20)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.scaling import LossScaler, install
from tests.scaling.fp16_nets import HalfMLP, twin

MULT = 2.0 ** -20
W_TRUE = torch.randn(16, 4, generator=torch.Generator().manual_seed(5)) / 4


def _batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(31 * step + micro)
    x = torch.randn(32, 16, generator=g)
    return x, torch.tanh(x @ W_TRUE)


def _accumulate_and_clip(model, steps=40):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        for micro in range(2):
            x, y = _batch(step, micro)
            (F.mse_loss(model(x), y) * MULT / 2).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=MULT)  # a threshold in the loss's own units
        opt.step()


def _manual_sgd_with_autograd_grad(model, steps=40):
    params = list(model.parameters())
    for step in range(steps):
        x, y = _batch(step)
        gs = torch.autograd.grad(F.mse_loss(model(x), y) * MULT, params)
        with torch.no_grad():
            for p, g in zip(params, gs):
                p -= 0.3 / MULT * g


def _final_loss(model) -> float:
    x, y = _batch(999)
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


@pytest.mark.parametrize("loop", [_accumulate_and_clip, _manual_sgd_with_autograd_grad])
def test_script_trains_like_fp32(loop):
    torch.manual_seed(0)
    start = HalfMLP()
    ref, unscaled, scaled = twin(start), HalfMLP(), HalfMLP()
    unscaled.load_state_dict(start.state_dict()), scaled.load_state_dict(start.state_dict())
    loop(ref)
    loop(unscaled)
    install(LossScaler())
    loop(scaled)
    fp32, lost, ours = _final_loss(ref), _final_loss(unscaled), _final_loss(scaled)
    assert fp32 < 0.5 * _final_loss(start)  # the loop does train
    assert abs(ours - fp32) / fp32 < 0.02
    assert (lost - fp32) / fp32 > 0.1
