"""Issue 11 diagnostic: automp's low-precision-eager path against the same loop hand-written with torch.autocast,
on the zoo's small scripts, in interleaved blocks (A B C, C B A, ...) so host-speed drift cancels.

    python scripts/overhead.py gan lstm mlp
Variants: hand = autocast-bf16 eager as written; automp = `automp.enable(path="eager")` around the FP32 loop;
automp-nofuse = the same without switching Adam to fused. Prints median ms per step of each variant per model."""
import statistics
import sys
import time

import torch

import automp
from automp.bench.suites import zoo

BLOCK, ROUNDS = 15, 6


def block(loop, steps, device):
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(steps):
        loop.step()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / steps * 1e3


def run(name):
    torch.manual_seed(0)
    loops = {"hand": zoo.ModeLoop(zoo.MODELS[name][0](False, "cuda"), "autocast-bf16-eager", "cuda"),
             "automp": zoo.ModeLoop(zoo.MODELS[name][0](False, "cuda"), "fp32-eager", "cuda"),
             "automp-nofuse": zoo.ModeLoop(zoo.MODELS[name][0](False, "cuda"), "fp32-eager", "cuda")}
    times = {k: [] for k in loops}
    order = list(loops)
    for r in range(ROUNDS + 1):
        for k in (order if r % 2 else order[::-1]):
            if k != "hand":
                automp.enable(dtype="bf16", path="eager", fuse_optimizers=(k == "automp"))
            ms = block(loops[k], BLOCK, "cuda")
            if k != "hand":
                automp.disable()
            if r:  # round 0 warms up
                times[k].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"| {name} | " + " | ".join(f"{med[k]:.2f}" for k in order) +
          f" | {med['hand'] / med['automp']:.2f}x | {min(times['hand']):.2f}-{max(times['hand']):.2f} |", flush=True)


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    print("| model | hand autocast eager ms | automp eager ms | automp eager, no fused Adam ms | hand/automp | hand range |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in sys.argv[1:]:
        run(n)
