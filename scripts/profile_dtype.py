"""Diagnostic: where does automp-fp16 spend the time automp-bf16 does not? One zoo model, one forced path,
bf16 then fp16 (automp.enable starts afresh: no interleaving), each timed and then traced with torch.profiler for a
few steps: the CUDA kernels that differ most in total time, and the host time per step.

    python scripts/profile_dtype.py bert compile
"""
import statistics
import sys
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

import automp
from automp.bench.suites import zoo
from automp.bench.suites.zoo_interleave import block_ms

BLOCK, ROUNDS, PROFILED = 10, 4, 3
CUDA = torch.cuda.is_available()  # a CPU run (tiny configs) only checks the script


def sync():
    if CUDA:
        torch.cuda.synchronize()


def block(loop, steps):
    """ms per step of `steps` back-to-back steps (the zoo's interleaved block timing)."""
    return block_ms(loop.step, steps, "cuda" if CUDA else "cpu")


def kernels(step, steps):
    """Per step: {kernel: device ms}, {kernel: launches}, host wall ms, host syncs. On a CPU (tiny configs, a check
    of the script) aten ops stand in for kernels. Profiler ranges (Optimizer.step#..., user annotations) are skipped:
    their device time spans kernels counted already."""
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = (time.perf_counter() - t) / steps * 1e3
    ms, count = Counter(), Counter()
    for e in prof.key_averages():
        if getattr(e, "is_user_annotation", False) or "#" in e.key:
            continue
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if CUDA and us and e.device_type.name == "CUDA" or not CUDA and e.self_cpu_time_total and "aten::" in e.key:
            ms[e.key[:90]] += (us or e.self_cpu_time_total) / 1e3 / steps
            count[e.key[:90]] += e.count / steps
    syncs = sum(e.count for e in prof.key_averages() if "Synchronize" in e.key or e.key == "aten::item"
                or e.key == "aten::_local_scalar_dense")
    return ms, count, wall, syncs / steps


def main(name, path):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    dev = "cuda" if CUDA else "cpu"
    loops = {d: zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "fp32-eager", dev) for d in ("bf16", "fp16")}
    times, prof = {}, {}
    for d, loop in loops.items():  # automp.enable() starts fresh (a recompile), so each dtype runs in one piece
        automp.enable(dtype=d, path=path)
        block(loop, BLOCK)  # compile, trial-free (forced path), warm-up
        times[d] = [block(loop, BLOCK) for _ in range(ROUNDS)]
        per, _, wall, syncs = kernels(loop.step, PROFILED)
        report = automp.disable()
        fused = [(type(o).__name__, [g.get("fused") for g in o.param_groups]) for o in loop.work.optimizers.values()]
        print(f"{d}: optimizers {fused}; automp switched {report.get('optimizers')}; "
              f"loss scale {report.get('loss_scale')}", flush=True)
        prof[d] = per, wall, syncs
        print(f"{d}: median ms/step {statistics.median(times[d]):.2f}; profiled wall {wall:.2f} ms/step, CUDA kernel "
              f"total {sum(per.values()):.2f} ms/step, {len(per)} distinct kernels, host syncs/step {syncs:.1f}",
              flush=True)
    a, b = prof["bf16"][0], prof["fp16"][0]
    diff = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))[:40]
    print("| kernel | bf16 ms/step | fp16 ms/step |\n|---|---:|---:|")
    for k in diff:
        print(f"| {k} | {a.get(k, 0):.3f} | {b.get(k, 0):.3f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "compile")
