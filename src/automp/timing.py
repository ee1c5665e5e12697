"""Wall-clock timing of a callable: what the library's own measured choices (the quantized module against its float
twin, 2:4 sparse kernels against dense) and the benchmark suites both use.

It lives at the bottom of the package so library code can time things without importing automp.bench (bench
imports the library, never the other way round), and without importing Triton.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def time_fn(fn: Callable[[], Any], warmup: int = 10, iters: int = 50, flush_l2: bool = False,
            device: str | torch.device | None = None) -> float:
    """Median milliseconds per call: CUDA events on a GPU, perf_counter on the CPU.

    Median, not mean, so one preempted iteration does not move the figure; an optional L2 flush between iterations
    keeps bandwidth-bound kernels from being measured out of cache. `device` is where `fn` runs: None means CUDA
    where it is available; a CPU device is timed on the host clock even on a GPU machine (CUDA events would see none
    of its work).
    """
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        scratch = torch.empty(64 * 2**20, dtype=torch.int8, device="cuda") if flush_l2 else None
        times = []
        for _ in range(iters):
            if scratch is not None:
                scratch.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
