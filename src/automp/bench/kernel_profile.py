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
