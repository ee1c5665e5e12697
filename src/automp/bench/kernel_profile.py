"""Where a step's device time goes: one call under torch.profiler, its kernels' time summed by category.

A suite names its categories as (name, pattern) pairs, first match wins, the rest "other"; the largest kernels by
name are kept so that a category can be checked against what ran. Annotations the profiler places on the GPU's
timeline (`record_function` ranges such as `Optimizer.step#AdamW.step`) are not kernels and are left out: they span
the kernels they annotate, whose time they would count twice. On a CPU the aten ops' own CPU time stands in for
kernels (a smoke run's figures, not a profile).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

Patterns = Sequence[tuple[str, "re.Pattern[str]"]]


def category(name: str, patterns: Patterns) -> str:
    return next((cat for cat, pattern in patterns if pattern.search(name)), "other")


def kernels(prof: Any, cuda: bool) -> list[tuple[str, float]]:
    """(name, microseconds) of every kernel the profile saw (aten ops' self time on the CPU)."""
    from torch.autograd import DeviceType
    if cuda:
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
                if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    return [(e.name, e.self_cpu_time_total) for e in prof.events()
            if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]


def profiled(fn: Callable[[], object], device: torch.device | str) -> list[tuple[str, float]]:
    """The kernels of one fn() call, the device synchronized around it."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    return kernels(prof, cuda)


def summed(found: list[tuple[str, float]], patterns: Patterns, top: int = 12) -> dict[str, Any]:
    """{"<category>_ms": ..., "kernel_ms": total, "kernels": count, "top": the `top` largest kernels by name}."""
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = {}
    for name, us in found:
        cat = category(name, patterns)
        by_cat[cat] += us / 1e3
        entry = by_name.setdefault(name, [name[:120], 0.0, 0, cat])
        entry[1] += us / 1e3
        entry[2] += 1
    largest = sorted(by_name.values(), key=lambda e: -e[1])[:top]
    names = [cat for cat, _ in patterns] + ["other"]
    return {**{f"{c}_ms": by_cat.get(c, 0.0) for c in names}, "kernel_ms": sum(by_cat.values()), "kernels": len(found),
            "top": [{"name": n, "ms": round(ms, 4), "count": k, "category": c} for n, ms, k, c in largest]}


# Collective kernels by name: NCCL's (ncclDevKernel_AllGather_RING_LL, ncclKernel_ReduceScatter...).
COMM = re.compile(r"nccl", re.IGNORECASE)


def kernel_spans(prof: Any) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every CUDA kernel the profile saw, annotations left out (see the docstring)."""
    from torch.autograd import DeviceType
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _uncovered(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the (disjoint, sorted) `spans` outside the (disjoint, sorted) `cover`."""
    left, i = 0.0, 0
    for start, end in spans:
        while i < len(cover) and cover[i][1] <= start:
            i += 1
        t, j = start, i
        while j < len(cover) and cover[j][0] < end:
            left += max(0.0, cover[j][0] - t)
            t = max(t, cover[j][1])
            j += 1
        left += max(0.0, end - t)
    return left


def comm_overlap(spans: list[tuple[str, float, float]], comm: "re.Pattern[str]" = COMM) -> dict[str, float | None]:
    """How much of the collectives' device time other kernels hide: {"comm_ms": the time any collective kernel runs,
    "comm_exposed_ms": the part of it during which no other kernel runs, "comm_overlap": 1 - exposed / comm (None
    without collectives)}. FSDP2 prefetches the next layer's all-gather on its own stream so that it runs under the
    current layer's compute; a step whose collectives are mostly exposed waits for the network instead. Times are
    unions over streams, so two collectives at once count once."""
    collective = _union([(s, e) for name, s, e in spans if comm.search(name)])
    compute = _union([(s, e) for name, s, e in spans if not comm.search(name)])
    total = sum(e - s for s, e in collective)
    exposed = _uncovered(collective, compute)
    return {"comm_ms": round(total / 1e3, 4), "comm_exposed_ms": round(exposed / 1e3, 4),
            "comm_overlap": round(1 - exposed / total, 4) if total > 0 else None}
