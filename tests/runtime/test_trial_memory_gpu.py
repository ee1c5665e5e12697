"""A trial fits where the hand-written loop fits: an FP32 MLP script whose bf16 loop (autocast + torch.compile + fused
AdamW) peaks at about 70% of the GPU runs under automp without running out of memory, and automp's peak, trial
included, stays within 10% of that loop's (what the budget's estimate of an eager step's peak misses).

GPU only: the batch is sized on the device itself, from two measured runs of the loop (peak memory grows linearly
with the batch). Run by the GPU test run."""
import tempfile

import pytest
import torch
import torch.nn as nn

import automp

from .sessions import candidates, inject

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's memory"),
              pytest.mark.usefixtures("fresh_session")]
WIDTH, LAYERS, STEPS = 4096, 8, 8
SHARE = 0.70


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.GELU())]
    return nn.Sequential(*layers).cuda()


def _peak(rows: int, under_automp: bool) -> int:
    """Peak allocated bytes of STEPS steps of the script at `rows` rows a batch: the hand-written bf16 loop, or the
    FP32 loop under automp (its trial included)."""
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    net = _mlp()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, **({} if under_automp else {"fused": True}))
    model = net if under_automp else torch.compile(net)
    x = torch.randn(rows, WIDTH, device="cuda")
    cache = tempfile.TemporaryDirectory(prefix="automp-memory-")
    if under_automp:
        automp.enable(dtype="bf16", cache_dir=cache.name)
    try:
        for _ in range(STEPS):
            if under_automp:
                loss = model(x).float().pow(2).mean()
            else:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    finally:
        if under_automp:
            automp.disable()
        cache.cleanup()
        del net, opt, model, x


def test_the_trial_peaks_no_higher_than_the_hand_written_loop_near_the_cards_limit():
    total = torch.cuda.get_device_properties(0).total_memory
    small, large = 8192, 16384
    a, b = _peak(small, False), _peak(large, False)
    per_row = (b - a) / (large - small)
    rows = int(small + (SHARE * total - a) / per_row) // 64 * 64
    anchor = _peak(rows, False)
    assert 0.6 * total < anchor < 0.8 * total, (rows, anchor / total)
    ours = _peak(rows, True)  # raised an out-of-memory error before the budget, where eager held more than the loop
    assert ours <= 1.10 * anchor, (ours / 2**30, anchor / 2**30)


def _after_forwards(monkeypatch, release: bool, rows: int = 4096, steps: int = 10) -> list[int]:
    """Bytes allocated as each of a trial's forwards returns, from the sixth on (the loop is learned after its
    fourth call): the FP32 loop zeroing its gradients after its forward, automp's gradient release on or off, a trial
    of low precision eager against stock Inductor kept running (the same candidate at each step in both runs)."""
    from automp.runtime.decisions import Route
    from automp.runtime.trial import TrialConfig
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    net = _mlp()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randn(rows, WIDTH, device="cuda")
    cache = tempfile.TemporaryDirectory(prefix="automp-release-")
    inject(monkeypatch, candidates=candidates([Route.COMPILED_AUTOCAST, Route.EAGER_LOW]),
           trial_config=TrialConfig(give_up=100.0, give_up_first=100.0, measure=8))  # still running at the last step
    automp.enable(dtype="bf16", cache_dir=cache.name, release_grads=release)
    held = []
    try:
        for step in range(steps):
            loss = net(x).float().pow(2).mean()
            held.append(torch.cuda.memory_allocated())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        assert automp._session.roots[net].path is None, "the trial must run through every measured step"
        return held[5:]
    finally:
        automp.disable()
        cache.cleanup()
        del net, opt, x


def test_the_trials_forwards_run_without_the_gradients_the_loop_drops_after_them(monkeypatch):
    """Once the loop is learned, each forward of the trial ends without the last step's gradients (one FP32 copy of
    the parameters) beside its activations: the same step holds that much less than with them kept."""
    grads = 4 * LAYERS * (WIDTH * WIDTH + WIDTH)
    kept, released = _after_forwards(monkeypatch, False), _after_forwards(monkeypatch, True)
    assert all(k - r >= 0.95 * grads for k, r in zip(kept, released)), [(k - r) / grads for k, r in zip(kept, released)]
