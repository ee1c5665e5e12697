"""DDP + automp fp16 on N GPUs (NCCL) or CPU processes (gloo): `torchrun --nproc_per_node=2 scripts/ddp_check.py`.

An inf is injected on the last rank only, inside a no_sync micro-batch (no gradient all-reduce carries it); every
rank must skip exactly that optimizer step, keep the same loss scale, and end with identical parameters."""
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import automp
from automp.scaling import current

STEPS, MICRO, BAD_STEP = 8, 2, 3


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).to(dev)
    # on a CPU the trial keeps FP32 (and then takes loss scaling off): force low precision to check the scaling
    automp.enable(dtype="fp16", loss_scale="dynamic", inner="inductor" if cuda else "eager",
                  path="auto" if cuda else "eager")
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    scales, skipped, losses = [], [], []
    for step in range(STEPS):
        before = [p.detach().clone() for p in ddp.parameters()]
        for micro in range(MICRO):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
            x = torch.randn(256, 512, generator=g).to(dev)
            if step == BAD_STEP and micro == 0 and rank == world - 1:
                x[0, 0] = float("inf")
            with ddp.no_sync() if micro < MICRO - 1 else torch.enable_grad():
                loss = F.mse_loss(ddp(x), x)
                loss.backward()
            scales.append(current().scale)
        opt.step()
        opt.zero_grad()
        skipped.append(all(torch.equal(a, p) for a, p in zip(before, ddp.parameters())))
        losses.append(loss.item())
    rep = automp.disable()
    params = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    ok = (skipped == [s == BAD_STEP for s in range(STEPS)]
          and all(torch.equal(gathered[0], t) for t in gathered))
    low = sum(n["dtype"] == "float16" for gr in rep["graphs"] for n in gr["nodes"])
    print(f"rank {rank}/{world} {dev}: skipped={skipped} scales={scales} final_loss={losses[-1]:.4f} "
          f"fp16_nodes={low} fallbacks={len(rep['fallbacks'])} params_equal_across_ranks="
          f"{all(torch.equal(gathered[0], t) for t in gathered)} -> {'PASS' if ok else 'FAIL'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
