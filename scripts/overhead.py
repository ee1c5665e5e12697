"""Diagnostic: automp's low-precision-eager path against the same loop hand-written with torch.autocast,
on the zoo's small scripts, in interleaved blocks (A B C, C B A, ...) so host-speed drift cancels.

    python scripts/overhead.py [--after-trial] gan lstm mlp
Variants: hand = autocast-bf16 eager as written; automp = `automp.enable(path="eager")` around the FP32 loop;
automp-nofuse = the same without switching Adam to fused. Prints median ms per step of each variant per model.

--after-trial: the same rounds again after a full automp trial of a fresh copy of the model (every candidate path,
compiled ones included, until it settles). The zoo measured DCGAN at 0.93x of the hand-written loop after its trial
where this script, with no trial in the process, measured 0.99x: if the second table is slower than the first (for
both variants, or for automp only), the trial leaves something behind that costs time afterwards."""
import statistics
import sys

import torch

import automp
from automp.bench.suites import zoo
from automp.bench.suites.zoo_interleave import block_ms

BLOCK, ROUNDS = 15, 6


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
            ms = block_ms(loops[k].step, BLOCK, "cuda")
            if k != "hand":
                automp.disable()
            if r:  # round 0 warms up
                times[k].append(ms)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"| {name} | " + " | ".join(f"{med[k]:.2f}" for k in order) +
          f" | {med['hand'] / med['automp']:.2f}x | {min(times['hand']):.2f}-{max(times['hand']):.2f} |", flush=True)


def trial(name):
    """A full trial (default path choice, empty verdict cache) of a fresh copy of the model, run until it settles."""
    import tempfile
    torch.manual_seed(0)
    loop = zoo.ModeLoop(zoo.MODELS[name][0](False, "cuda"), "fp32-eager", "cuda")
    automp.enable(dtype="bf16", cache_dir=tempfile.mkdtemp())
    try:
        for _ in range(200):
            loop.step()
            if automp.settled():
                break
    finally:
        report = automp.disable()
    print(f"trial of {name}: " + "; ".join(f"{c['module']} {c['path']}" for c in report.get("choices", [])))


def table(names):
    print("| model | hand autocast eager ms | automp eager ms | automp eager, no fused Adam ms | hand/automp | hand range |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        run(n)


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    after = "--after-trial" in sys.argv
    names = [a for a in sys.argv[1:] if a != "--after-trial"]
    table(names)
    if after:
        for n in names:
            trial(n)
        table(names)
