"""automp.bench.kernel_profile: the collectives' overlap with compute, against a brute-force count over time."""
import random

import pytest
import torch

from automp.bench import kernel_profile as kp


def _brute(spans):
    """Exposed and total collective time by walking every microsecond (integer spans)."""
    comm = exposed = 0
    for t in range(0, 1 + max(e for _, _, e in spans)):
        busy = [n for n, s, e in spans if s <= t < e]
        if any("nccl" in n for n in busy):
            comm += 1
            exposed += not any("nccl" not in n for n in busy)
    return comm, exposed


@pytest.mark.parametrize("seed", range(20))
def test_overlap_matches_a_count_over_time(seed):
    rng = random.Random(seed)
    spans = []
    for _ in range(rng.randint(1, 12)):
        s = rng.randint(0, 200)
        name = rng.choice(["ncclDevKernel_AllGather_RING_LL", "ncclKernel_ReduceScatter", "gemm", "triton_poi_add"])
        spans.append((name, s, s + rng.randint(1, 60)))
    spans.append(("ncclDevKernel_AllGather_RING_LL", 250, 260))  # at least one collective, partly alone
    comm, exposed = _brute(spans)
    got = kp.comm_overlap([(n, float(s), float(e)) for n, s, e in spans])
    assert got["comm_ms"] == pytest.approx(comm / 1e3, abs=1e-9)
    assert got["comm_exposed_ms"] == pytest.approx(exposed / 1e3, abs=1e-9)
    assert got["comm_overlap"] == pytest.approx(1 - exposed / comm, abs=1e-4)


def test_hidden_exposed_and_absent_collectives():
    hidden = kp.comm_overlap([("gemm", 0.0, 100.0), ("ncclDevKernel_AllGather", 10.0, 60.0)])
    assert hidden == {"comm_ms": 0.05, "comm_exposed_ms": 0.0, "comm_overlap": 1.0}
    alone = kp.comm_overlap([("gemm", 0.0, 10.0), ("ncclKernel_AllReduce", 10.0, 30.0)])  # touching, not overlapping
    assert alone == {"comm_ms": 0.02, "comm_exposed_ms": 0.02, "comm_overlap": 0.0}
    # two collectives at once count once
    both = kp.comm_overlap([("ncclA", 0.0, 10.0), ("ncclB", 5.0, 15.0), ("gemm", 0.0, 5.0)])
    assert both == {"comm_ms": 0.015, "comm_exposed_ms": 0.01, "comm_overlap": pytest.approx(1 / 3, abs=1e-4)}
    assert kp.comm_overlap([("gemm", 0.0, 5.0)])["comm_overlap"] is None


def test_a_cpu_profile_has_no_kernel_spans():
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert kp.kernel_spans(prof) == []
