"""Diagnostic: what `torch.backends.cudnn.benchmark = True` is worth on the zoo's models, per mode.

    python scripts/cudnn_benchmark.py resnet50:autocast-bf16-compile gan:autocast-bf16-eager ...

One model and loop per argument; the flag is read when a convolution runs (forward and backward, eager or Inductor's
extern kernel), so one loop serves both sides: blocks of steps alternate flag off / on (the order flips each round),
each side's median block and its peak memory are printed. cuDNN's benchmark cache is filled in the warm-up.
"""
import statistics
import sys

import torch

from automp.bench.suites import zoo
from automp.bench.suites.zoo_interleave import block_ms

BLOCK, ROUNDS = 10, 6


def measure(name: str, mode: str) -> None:
    torch.manual_seed(0)
    loop = zoo.ModeLoop(zoo.MODELS[name][0](False, "cuda"), mode, "cuda")
    for flag in (True, False):
        torch.backends.cudnn.benchmark = flag
        block_ms(loop.step, 3, "cuda")
    times: dict[bool, list[float]] = {False: [], True: []}
    peak = {False: 0.0, True: 0.0}
    for r in range(ROUNDS):
        for flag in ((False, True) if r % 2 == 0 else (True, False)):
            torch.backends.cudnn.benchmark = flag
            torch.cuda.reset_peak_memory_stats()
            times[flag].append(block_ms(loop.step, BLOCK, "cuda"))
            peak[flag] = max(peak[flag], torch.cuda.max_memory_allocated() / 2**30)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"| {name} | {mode} | {off:.2f} | {on:.2f} | {off / on:.3f} | {peak[False]:.3f} | {peak[True]:.3f} |",
          flush=True)
    torch.backends.cudnn.benchmark = False


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    print("| model | mode | benchmark off ms | on ms | off/on | peak GiB off | on |\n|---|---|---:|---:|---:|---:|---:|")
    for arg in sys.argv[1:]:
        name, mode = arg.split(":")
        try:
            measure(name, mode)
        except Exception as e:  # noqa: BLE001 - one model's failure must not lose the others' rows
            print(f"| {name} | {mode} | error: {type(e).__name__}: {str(e)[:150]} |", flush=True)
        torch._dynamo.reset()
        torch.cuda.empty_cache()
