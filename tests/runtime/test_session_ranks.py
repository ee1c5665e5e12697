"""A session under torch.distributed (gloo, 2 processes): every rank runs the same path at every iteration, for a
DDP module and for an FSDP2 one (fully_shard)."""
import pytest
import torch
import torch.nn as nn

from tests import gloo


def _wrap(kind: str, module: nn.Module) -> nn.Module:
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(module)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2,))  # a CPU (gloo) test: on a GPU host FSDP2 would default its mesh to CUDA
    return fully_shard(module, mesh=mesh)


def _ranks_worker(rank: int, port: int, out: str, kind: str) -> None:
    import gc
    import os

    import torch.distributed as dist

    from automp.runtime.decisions import Route
    from automp.config import AutoMPConfig
    from automp.runtime.session import Session
    os.environ["AUTOMP_CACHE_DIR"] = os.path.join(out, str(rank))
    gloo.join(rank, port, timeout_s=30)
    # rank 1 measures FP32 5x slower: alone, its trial would drop FP32 after one round and end earlier than rank 0's
    cost = {Route.FP32: 0.024 if rank == 0 else 0.100, Route.EAGER_LOW: 0.020}
    now, ran = [0.0], []
    net, x = _wrap(kind, nn.Linear(8, 4)), torch.randn(4, 8)

    def run(iterations: int) -> dict:
        ran.clear()
        session = Session(AutoMPConfig(dtype="bf16", inner="eager", spec="h100"), clock=lambda: now[0],
                          candidates=lambda device, low: (list(cost), "test"))
        real_run = session._run
        session._run = lambda module, root, path, a, k: ran.append(path.value) or real_run(module, root, path, a, k)
        session.install()
        for _ in range(iterations):
            net(x).sum().backward()  # DDP all-reduces, FSDP reduce-scatters the gradient: a rank still in its
            # trial would meet a broadcast there
            now[0] += cost[Route(ran[-1])]
        if rank == 0:  # an evaluation on rank 0 only: a module of its own, which must not wait for rank 1
            probe = nn.Linear(8, 2)
            for _ in range(40):
                probe(x).sum().backward()
                now[0] += cost[Route(ran[-1])]
        dist.barrier()
        return {"ran": list(ran), "choices": session.uninstall()["choices"]}

    try:
        first = run(80)
        if rank == 1:  # another node, another cache: rank 1 has no verdict, rank 0 has a confirmed one
            os.environ["AUTOMP_CACHE_DIR"] = os.path.join(out, "empty")
        torch.save({"first": first, "second": run(30)}, os.path.join(out, f"{rank}.pt"))
    finally:
        gc.collect()  # see tests/scaling/test_scaling_ddp.py: a DDP module alive at exit aborts the process
        dist.destroy_process_group()


@pytest.mark.ranks
@pytest.mark.parametrize("kind,label", [("ddp", "DistributedDataParallel"), ("fsdp2", "FSDPLinear")])
def test_every_rank_runs_the_same_path_at_every_iteration(tmp_path, kind, label):
    """Under torch.distributed the trial and its re-measurement end at the same iteration on every rank (rank 0's
    verdict is broadcast there), so no rank meets that broadcast with its gradient all-reduce; and a rank without a
    cached verdict starts from rank 0's rather than a trial only it runs."""
    r0, r1 = gloo.spawn(_ranks_worker, tmp_path, kind)
    ddp0 = r0["first"]["ran"][:len(r1["first"]["ran"])]  # rank 0's evaluation module ran after these
    assert ddp0 == r1["first"]["ran"] and ddp0[-1] == "low-precision-eager"
    c0, c1 = r0["first"]["choices"][0], r1["first"]["choices"][0]
    assert c0["module"] == c1["module"] == label
    assert c0["confirmed"] and c1["confirmed"]  # rank 0's timings started the re-measurement on both
    # one writer per job: rank 0's cache holds the verdicts, rank 1 wrote none to its own
    assert (tmp_path / "0" / "verdicts.json").exists() and not (tmp_path / "1" / "verdicts.json").exists()
    assert [c["module"] for c in r0["first"]["choices"]] == [label, "Linear"]
    # the next run: rank 1 finds no verdict in its cache and starts from rank 0's instead of a trial of its own
    assert r0["second"]["ran"][:30] == r1["second"]["ran"] == ["low-precision-eager"] * 30
    assert [c["cached"] for c in r1["second"]["choices"]] == [True]
