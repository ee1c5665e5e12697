"""dtype="fp8" on an FSDP2 model under torch.distributed (gloo, 2 processes, the FP8 check and GEMM table emulated
as in test_fp8_session): every rank installs rank 0's FP8 layers although rank 1's own table would choose none, the
step runs the FP8 path on every rank, FSDP2 all-gathers those layers' weights in FP8 once the path is settled (in bf16
again after automp.disable), and the losses match the same FSDP2 model in bf16 closely."""
import os

import pytest
import torch
import torch.nn as nn

from tests import gloo
from tests.precision.fp8.test_layers import needs_scaled_mm


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import automp
    from automp.precision.fp8.table import Fp8Table, Fp8Timing, bucket
    from automp.runtime import session as sessions
    from automp.runtime.fp8_layers import Fp8Layers
    os.environ["AUTOMP_INNER"] = "eager"
    gloo.join(rank, port)
    mesh = init_device_mesh("cpu", (2,))  # a CPU (gloo) test: on a GPU host FSDP2 would default its mesh to CUDA

    def table(device, shapes, recipe, cache_dir):  # rank 0: the wide layers gain; rank 1: nothing does
        gain = Fp8Timing(2.0, 0.8, 0.2) if rank == 0 else Fp8Timing(1.0, 1.0, 0.5)
        return Fp8Table("fake", torch.__version__, 1000.0, {
            (recipe, bucket(s)): gain if s.k >= 64 else Fp8Timing(1.0, 1.0, 0.5) for s in shapes})

    sessions.open_session = lambda config, recorder: sessions.Session(
        config, recorder, fp8=Fp8Layers(config, recorder, check=lambda device: None, table=table))

    def train(dtype: str) -> tuple[list[float], dict]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Sequential(nn.Linear(32, 64), nn.GELU()), nn.Sequential(nn.Linear(64, 128),
                              nn.GELU()), nn.Linear(128, 16))
        for block in model[:2]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(10 + rank)
        losses, seen = [], []
        model[1][0].register_forward_pre_hook(lambda m, a: seen.append(type(m.weight).__name__))
        automp.enable(dtype=dtype, path="fp8-compile" if dtype == "fp8" else "autocast-compile",
                      cache_dir=os.path.join(out, f"cache{rank}"), fp8_output=True)
        try:
            for _ in range(6):
                x, y = torch.randn(48, 32, generator=gen), torch.randn(48, 16, generator=gen)
                loss = ((model(x).float() - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        finally:
            report = automp.disable()
        model(torch.randn(48, 32, generator=gen))  # after disable: FSDP2's own gather again
        report["seen"] = seen
        return losses, report

    try:
        fp8_losses, report = train("fp8")
        bf16_losses, _ = train("bf16")
        torch.save({"fp8": fp8_losses, "bf16": bf16_losses, "report": report}, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.ranks
@needs_scaled_mm
def test_every_rank_runs_rank0s_fp8_layers_under_fsdp2(tmp_path):
    r0, r1 = gloo.spawn(_worker, tmp_path)
    chosen = [{n for n, c in next(iter(r["report"]["fp8"].values()))["layers"].items() if c["dtype"] == "fp8"}
              for r in (r0, r1)]
    assert chosen[0] == chosen[1] == {"1.0", "2"}  # rank 0's table's choice, on rank 1 too
    assert [c["path"] for c in r0["report"]["choices"]] == [c["path"] for c in r1["report"]["choices"]] == \
        ["fp8-compiled"]
    for r in (r0, r1):  # the first call probes and settles; from the second on, FP8 weights arrive from FSDP2
        assert r["report"]["seen"][-1] == "Parameter" and "Fp8Weight" in r["report"]["seen"][:-1]
        assert next(iter(r["report"]["fp8"].values()))["all_gather"]["rules"] == {"fp8-all-gather": 2}
    for r in (r0, r1):  # FP8 against bf16 on the same data: close, and not identical (FP8 did run)
        rel = [abs(a - b) / abs(b) for a, b in zip(r["fp8"], r["bf16"])]
        assert max(rel) < 0.05 and max(rel) > 0, rel
