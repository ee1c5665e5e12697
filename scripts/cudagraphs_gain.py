"""Diagnostic: how much of a zoo model's step is the host's? The anchor (autocast-bf16 + torch.compile, Adam
as written), the same with fused Adam (what automp's autocast-compiled path runs), and that with CUDA graphs
(torch.compile mode="reduce-overhead"), in interleaved blocks in one process, with each loop's resident and
transient memory. On the H100 the Llama-style model's kernels take 20.4 ms per step under automp, yet its step ran
22 to 33 ms on different hosts of the same kind: the difference is host time, which CUDA graphs take away.

    python scripts/cudagraphs_gain.py llama,gpt2
"""
import statistics
import sys

import torch

from automp.bench.suites import zoo
from profile_dtype import CUDA, block

BLOCK, ROUNDS = 10, 6


def loops_for(name, dev):
    loops = {}
    for label in ("anchor", "fused", "graphed"):
        torch.manual_seed(0)
        loop = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "autocast-bf16-compile", dev)
        if label != "anchor" and CUDA:
            for opt in loop.work.optimizers.values():
                for g in opt.param_groups:
                    g["fused"], g["foreach"] = True, False
        if label == "graphed":
            loop.nets = {k: torch.compile(m, mode="reduce-overhead") for k, m in loop.work.modules.items()}
        before = torch.cuda.memory_allocated() if CUDA else 0
        block(loop, 4)
        loops[label] = loop, before
    return loops


def main(names):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if CUDA else "cpu"
    for name in names.split(","):
        loops = loops_for(name, dev)
        mem = {}
        for label, (loop, before) in loops.items():
            if CUDA:
                torch.cuda.synchronize()
                start = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            block(loop, 2)
            if CUDA:
                mem[label] = ((torch.cuda.memory_allocated() - before) / 2**30,
                              (torch.cuda.max_memory_allocated() - start) / 2**30)
        times = {label: [] for label in loops}
        order = list(loops)
        for r in range(ROUNDS):
            for label in (order if r % 2 == 0 else order[::-1]):
                times[label].append(block(loops[label][0], BLOCK))
        anchor = statistics.median(times["anchor"])
        for label, t in times.items():
            resident, transient = mem.get(label, (float("nan"), float("nan")))
            print(f"{name:8s} {label:8s} {statistics.median(t):7.2f} ms ({min(t):.2f}-{max(t):.2f}) ratio "
                  f"{anchor / statistics.median(t):.3f} | resident {resident:.2f} GiB, transient peak "
                  f"{transient:.2f} GiB", flush=True)
        del loops
        torch._dynamo.reset()
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1])
