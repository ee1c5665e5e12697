"""automp.runtime.ranks under torch.distributed (gloo, 2 processes): every rank runs rank 0's verdict, and which
modules count as called in lockstep."""
import pytest
import torch.nn as nn

from automp.runtime.ranks import lockstep
from automp.runtime.decisions import MEASURED, RANK0, Route, Verdict
from tests import gloo


def _agree_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch
    import torch.distributed as dist

    from automp.runtime.ranks import agreed
    gloo.join(rank, port, timeout_s=30)
    try:
        mine = Route.COMPILED if rank == 0 else Route.EAGER_LOW  # the ranks measured different winners
        got = agreed(Verdict(mine, f"rank {rank} measured", {mine.value: 1.0}, rule=MEASURED, confirmed=True))
        torch.save({"path": got.path.value, "rule": got.rule, "confirmed": got.confirmed},
                   os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.ranks
def test_every_rank_runs_rank_0s_verdict(tmp_path):
    r0, r1 = gloo.spawn(_agree_worker, tmp_path)
    assert r0["path"] == r1["path"] == Route.COMPILED.value
    assert r0["rule"] == MEASURED and r1["rule"] == RANK0 and r1["confirmed"]


def test_lockstep_modules_are_ddp_fsdp_and_fsdp2_by_their_mixin():
    from torch.distributed.fsdp import FSDPModule
    plain = nn.Sequential(nn.Linear(2, 2))
    assert not lockstep(plain)

    class FSDPish(nn.Linear, FSDPModule):  # what fully_shard makes of a module: a class with the FSDPModule mixin
        pass
    inner = nn.Sequential(nn.Linear(2, 2))
    inner[0].__class__ = FSDPish
    assert lockstep(inner)  # a root holding a fully_shard submodule runs its collectives too
