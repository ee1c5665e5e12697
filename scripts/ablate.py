"""Diagnostic: which part of automp costs the time it loses to a hand-written loop, by switching parts off.

    python scripts/ablate.py fp16 gpt2     # bf16 vs fp16 on the forced autocast-compile path, loss scaling in parts
    python scripts/ablate.py fp16 resnet50 autocast-graphs   # the same on another forced path
    python scripts/ablate.py eager lstm    # automp's low-precision eager path vs the hand-written autocast loop

fp16: each variant is a fresh automp.enable on a model and optimizer of its own (the FX graph cache makes the
recompiles short), two rounds in alternating order, blocks of steps timed with a sync at each end. Variants: bf16;
fp16 as shipped; fp16 with the unscale pass replaced by a flag-only stub (what the pass itself costs on the device);
fp16 without loss scaling (what fp16 costs with no bookkeeping at all).

eager: the hand-written autocast loop and automp's forced eager path in alternating blocks, then both traced with
torch.profiler: kernels whose count or time differ, and the host wall time per step.
"""
import statistics
import sys
import tempfile

import torch

import automp
from automp.bench.suites import zoo
from automp.bench.suites.zoo_interleave import block_ms
from automp.scaling import overflow
from profile_dtype import CUDA, kernels  # scripts/ is on sys.path when run as a script

DEV = "cuda" if CUDA else "cpu"
BLOCK = 10


def block(step, n=BLOCK):
    return block_ms(step, n, DEV)


def _flag_only(tensors, inv_scale):
    return torch.zeros(1, dtype=torch.float32, device=tensors[0].device) if tensors else None


def fp16(name, path="autocast-compile", rounds=2):
    real = overflow.unscale_and_check_
    variants = {"bf16": ("bf16", "dynamic", real), "fp16": ("fp16", "dynamic", real),
                "fp16, no unscale pass": ("fp16", "dynamic", _flag_only),
                "fp16, no loss scaling": ("fp16", "off", real)}
    times = {k: [] for k in variants}
    loops = {}  # a model and optimizer per variant, as a user's run has: automp's optimizer switches happen at the
    # first step (SGD goes fused only under loss scaling), so variants sharing one optimizer would inherit the first's
    for label in variants:
        torch.manual_seed(0)
        loops[label] = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, DEV), "fp32-eager", DEV)
    for r in range(rounds):
        for label in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            dtype, scale, unscale = variants[label]
            overflow.unscale_and_check_ = unscale
            automp.enable(dtype=dtype, loss_scale=scale, path=path, cache_dir=tempfile.mkdtemp())
            try:
                block(loops[label].step, 3)
                times[label] += [block(loops[label].step) for _ in range(3)]
            finally:
                automp.disable()
                overflow.unscale_and_check_ = real
            print(f"round {r} {label}: {times[label][-3:]}", flush=True)
    ref = statistics.median(times["bf16"])
    print(f"| {name}, forced {path} | ms/step (median) | vs bf16 |\n|---|---:|---:|")
    for label, t in times.items():
        print(f"| {label} | {statistics.median(t):.2f} | {statistics.median(t) / ref:.3f} |", flush=True)


def eager(name, rounds=6):
    torch.manual_seed(0)
    hand = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, DEV), "autocast-bf16-eager", DEV)
    torch.manual_seed(0)
    loop = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, DEV), "fp32-eager", DEV)
    automp.enable(dtype="bf16", path="eager", cache_dir=tempfile.mkdtemp())
    try:
        sides = {"hand-written autocast": hand.step, "automp eager": loop.step}
        for s in sides.values():
            block(s, 5)
        times = {k: [] for k in sides}
        for r in range(rounds):
            for k in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                times[k].append(block(sides[k]))
        prof = {k: kernels(s, 3)[:2] for k, s in sides.items()}
    finally:
        report = automp.disable()
    print(f"{name}: " + ", ".join(f"{k} {statistics.median(v):.2f} ms" for k, v in times.items())
          + f"; optimizers {report.get('optimizers')}")
    (ha, hc), (aa, ac) = prof["hand-written autocast"], prof["automp eager"]
    print(f"kernel totals: hand {sum(ha.values()):.2f} ms/step in {sum(hc.values()):.0f} launches; automp "
          f"{sum(aa.values()):.2f} ms/step in {sum(ac.values()):.0f} launches")
    print("| kernel | hand n | automp n | hand ms | automp ms |\n|---|---:|---:|---:|---:|")
    keys = sorted(set(ha) | set(aa), key=lambda k: -(abs(ac[k] - hc[k]) * 0.01 + abs(aa[k] - ha[k])))
    for k in keys[:30]:
        print(f"| {k} | {hc[k]:.0f} | {ac[k]:.0f} | {ha[k]:.3f} | {aa[k]:.3f} |", flush=True)


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    {"fp16": fp16, "eager": eager}[sys.argv[1]](*sys.argv[2:])
