"""The FP8 loss guard under torch.distributed (gloo, 2 processes): a non-finite or spiking loss on one rank makes
every rank skip the same step and report the same divergence, so the ranks keep equal weights and leave FP8 together."""
import os

import pytest
import torch
import torch.nn as nn

from tests import gloo


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from automp.precision.fp8.guard import NONFINITE, SPIKE, LossWatch
    gloo.join(rank, port)
    try:
        results = {}
        for case, bad_step, rule in (("nan", 20, NONFINITE), ("spike", 24, SPIKE)):
            torch.manual_seed(0)
            net = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
            opt = torch.optim.SGD(net.parameters(), lr=0.01)
            seen = []
            watch = LossWatch(seen.append, ranks=True)
            undo = watch.install()
            gen = torch.Generator().manual_seed(100 + rank)
            for step in range(30):
                x = torch.randn(16, 8, generator=gen)
                loss = (net(x) - 1).pow(2).mean() + 1
                if rank == 1 and step in (bad_step, bad_step + 1):  # this rank's loss only
                    loss = loss * (float("nan") if case == "nan" else 40.0)
                opt.zero_grad()
                loss.backward()
                opt.step()
            undo()
            results[case] = {"fired": [(d.step, d.rule) for d in seen], "skipped": watch.skipped_steps,
                             "weight": net.module.weight.detach().clone(), "rule": rule, "bad_step": bad_step}
        torch.save(results, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.ranks
def test_every_rank_skips_and_reports_alike(tmp_path):
    r0, r1 = gloo.spawn(_worker, tmp_path)
    for case in ("nan", "spike"):
        a, b = r0[case], r1[case]
        assert a["fired"] == b["fired"] == [(a["bad_step"] + (1 if case == "spike" else 0), a["rule"])]
        assert torch.isfinite(a["weight"]).all() and torch.equal(a["weight"], b["weight"])
    # the non-finite losses' two steps were skipped on both ranks (a rank stepping on all-reduced NaN gradients
    # would hold NaN weights; a rank skipping alone would hold other weights than its peer)
    assert r0["nan"]["skipped"] == r1["nan"]["skipped"] == 2
    assert r0["spike"]["skipped"] == r1["spike"]["skipped"] == 0
