"""DDP on CPU (gloo, 2 processes): every rank takes the same skip decision and the same scale, and fp16 training
reaches the FP32 loss. The overflow is injected on rank 1 only, inside a no_sync micro-batch, where no gradient
all-reduce would carry it to rank 0: only the found-inf all-reduce can."""
import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tests import gloo
from tests.scaling.fp16_nets import HalfMLP

from automp.scaling import LossScaleConfig, LossScaler, current, install, uninstall

STEPS, MICRO, BAD_STEP = 8, 2, 3


def _batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(16, 16, generator=g)
    return x, torch.tanh(x[:, :4]) * 1e-3  # small targets: small gradients


def _train(rank: int, half: bool, inject: bool):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(HalfMLP(half=half))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scales, skipped = [], []
    for step in range(STEPS):
        before = [p.detach().clone() for p in model.parameters()]
        for micro in range(MICRO):
            x, y = _batch(rank, step, micro)
            if inject and step == BAD_STEP and micro == 0 and rank == 1:
                x[0, 0] = float("inf")
            ctx = model.no_sync() if micro < MICRO - 1 else torch.enable_grad()
            with ctx:
                F.mse_loss(model(x), y).backward()
            scales.append(current().scale if half else 1.0)
        opt.step()
        opt.zero_grad()
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, model.parameters())))
    with torch.no_grad():
        x, y = _batch(99, 0, 0)
        final = F.mse_loss(model.module(x), y).item()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"scales": scales, "skipped": skipped, "final": final, "params": params}


def _worker(rank: int, port: int, out_dir: str):
    gloo.join(rank, port, timeout_s=30)  # a mismatched collective fails after 30 s instead of hanging the run
    torch.set_num_threads(1)
    try:
        fp32 = _train(rank, half=False, inject=False)
        scaler = install(LossScaler(LossScaleConfig(init_scale=2.0 ** 12, growth_interval=4)))
        fp16 = _train(rank, half=True, inject=True)
        fp16["summary"] = scaler.summary()
        uninstall()
        torch.save({"fp32": fp32, "fp16": fp16}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        # DDP modules sit in reference cycles; one still alive after destroy_process_group tears its reducer
        # down at interpreter exit and aborts the process (SIGABRT, about 1 run in 10 on torch 2.13 CPU)
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.ranks
def test_ddp_ranks_agree_on_skip_and_scale(tmp_path):
    r0, r1 = gloo.spawn(_worker, tmp_path)
    a, b = r0["fp16"], r1["fp16"]
    assert a["scales"] == b["scales"]  # the same scale at every backward on both ranks
    assert a["skipped"] == b["skipped"] == [s == BAD_STEP for s in range(STEPS)]
    assert a["summary"]["overflow_steps"] == b["summary"]["overflow_steps"] == 1
    assert torch.equal(a["params"], b["params"]) and torch.isfinite(a["params"]).all()
    # fp16 (with one skipped step) trains to the FP32 loss: the fp32 run takes one more step, hence 10 %
    assert abs(a["final"] - r0["fp32"]["final"]) / r0["fp32"]["final"] < 0.1
