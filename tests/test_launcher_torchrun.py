"""`torchrun -m automp run` on unmodified DDP and FSDP2 scripts (gloo, 2 CPU processes): the losses match the same
script without automp, every rank reports the same path, and a rank that raises ends the whole run with an error
within a bounded time instead of leaving its peers waiting in a collective."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
SCRIPT = '''
import gc, json, sys, torch, torch.nn as nn, torch.distributed as dist
kind, out, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
if kind == "ddp":
    model = nn.parallel.DistributedDataParallel(model)
else:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # FSDP2 on the CPU: its default mesh is CUDA's if any
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
gen = torch.Generator().manual_seed(100 + rank)
losses = []
for step in range(12):
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
    if rank == 1 and step == fail_at:
        raise RuntimeError("rank 1 failed on purpose")
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
json.dump(losses, open(f"{out}.rank{rank}.json", "w"))
del model, opt  # a DDP module freed only at interpreter exit aborts it now and then (gloo, torch 2.13)
gc.collect()
dist.destroy_process_group()
'''


def _torchrun(tmp_path: Path, kind: str, automp_args: list[str] | None, tag: str, fail_at: int = -1,
              timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               AUTOMP_CACHE_DIR=str(tmp_path / "cache"), GLOO_SOCKET_IFNAME="lo",
               CUDA_VISIBLE_DEVICES="")  # CPU (gloo) ranks, also on a GPU host: automp in them sees no GPU either
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run = ["-m", "automp", "run", *automp_args] if automp_args is not None else []
    t0 = time.perf_counter()
    done = subprocess.run([*launch, *run, str(script), kind, str(tmp_path / tag), str(fail_at)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return done, time.perf_counter() - t0


def _losses(tmp_path: Path, tag: str) -> list[list[float]]:
    return [json.loads((tmp_path / f"{tag}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.ranks
@pytest.mark.skipif(sys.platform != "linux", reason="gloo on the loopback interface")
@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_losses_match_the_plain_script_and_every_rank_runs_one_path(tmp_path, kind):
    plain, _ = _torchrun(tmp_path, kind, None, "plain")
    assert plain.returncode == 0, plain.stderr[-2000:]
    report = tmp_path / "report.json"
    under, _ = _torchrun(tmp_path, kind, ["--dtype", "bf16", "--path", "eager", "--report", str(report)], "automp")
    assert under.returncode == 0, under.stderr[-2000:]
    ref, ours = _losses(tmp_path, "plain"), _losses(tmp_path, "automp")
    for r in (0, 1):  # bf16 against FP32 on the same data: within bf16's rounding over 12 steps
        assert len(ours[r]) == len(ref[r]) == 12
        assert max(abs(a - b) / abs(b) for a, b in zip(ours[r], ref[r])) < 0.03, (ours[r], ref[r])
    assert ours[0] != ours[1]  # each rank's own data: the comparison is per rank, not one rank twice
    reports = [json.loads(report.read_text()), json.loads((tmp_path / "report.rank1.json").read_text())]
    paths = [[(c["module"], c["path"]) for c in rep["choices"]] for rep in reports]
    assert paths[0] == paths[1] and paths[0] and all(p == "low-precision-eager" for _, p in paths[0])
    printed = under.stdout + under.stderr  # the ranks share the terminal: their lines may interleave
    assert printed.count("automp (rank 0): ") == printed.count("automp (rank 1): ") == 1


@pytest.mark.ranks
@pytest.mark.skipif(sys.platform != "linux", reason="gloo on the loopback interface")
def test_a_rank_that_raises_ends_the_run_with_an_error(tmp_path):
    done, seconds = _torchrun(tmp_path, "fsdp2", ["--dtype", "bf16", "--path", "eager"], "fail", fail_at=3,
                              timeout=180)
    assert done.returncode != 0
    assert "rank 1 failed on purpose" in done.stderr
    assert seconds < 120  # not the process group's 30-minute collective timeout
    assert not (tmp_path / "fail.rank0.json").exists()  # rank 0 was stopped, not left to finish alone
