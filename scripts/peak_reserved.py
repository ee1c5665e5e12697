"""Diagnostic: peak device memory of one zoo model in one mode, in a process of its own, counted both ways:
max_memory_allocated (the zoo's peak column) and max_memory_reserved. CUDA graphs allocate from a private memory pool
that the allocated count misses once recorded, so automp's autocast-graphed rows need the reserved count to be
compared with the anchor's.

    python scripts/peak_reserved.py llama anchor|autocast-graphs|autocast-compile
"""
import sys

import torch

import automp
from automp.bench.suites import zoo


def main(name, mode, steps=10):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    anchor = mode == "anchor"
    loop = zoo.ModeLoop(zoo.MODELS[name][0](False, "cuda"), zoo.ANCHOR if anchor else "fp32-eager", "cuda")
    if not anchor:
        automp.enable(dtype="bf16", path=mode)
    for _ in range(steps):
        loop.step()
    torch.cuda.synchronize()
    if not anchor:
        automp.disable()
    print(f"{name} {mode}: peak allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB, peak reserved "
          f"{torch.cuda.max_memory_reserved() / 2**30:.3f} GiB", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
