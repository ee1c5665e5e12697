"""Diagnostic: does the trial's way of timing rank a small script's paths the way settled training does?

The trial times one iteration per candidate, synchronizing the device at each call, and switches path at every
iteration. Settled training runs one path back to back with no sync, so host and device overlap. On the H100 the
LSTM's trial timed autocast-compiled at 10.93 ms while 20 settled steps on it took 12.5 ms, and the trial's pick
moved between runs. Here every path runs in one automp session (forced by hand, no trial), in alternating rounds,
and each round takes three measures of it: the first iteration after a switch (synced, what the trial times), the
iteration after that (synced, same path), and a block of steps without syncs inside (what settled training gets).
The script's hand-written autocast eager loop is measured the same way. Then a fresh session runs its real trial,
and its verdict is printed next to the settled block timing of the path it chose.

    python scripts/trial_timing.py lstm [rounds] [no-trial]
"""
import statistics
import sys
import tempfile
import time

import torch

import automp
from automp.bench.suites import zoo
from automp.runtime.trial import Path
from ablate import BLOCK, block  # scripts/ is on sys.path when run as a script
from profile_dtype import CUDA, sync


def synced_step(step):
    sync()
    t = time.perf_counter()
    step()
    sync()
    return (time.perf_counter() - t) * 1e3


def force(path):
    for root in automp._session.roots.values():
        root.path, root.trial = path, None
    automp._session.paths.unfinished.clear()


def main(name, rounds="6", trial="trial"):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    anchor = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "autocast-bf16-eager", dev)
    torch.manual_seed(0)
    plain = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "fp32-eager", dev)
    torch.manual_seed(0)
    loop = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "fp32-eager", dev)
    automp.enable(dtype="bf16", cache_dir=tempfile.mkdtemp())
    sides = {p.value: (lambda p=p: (force(p), loop.step())[1]) for p in Path}
    sides["hand-written autocast eager"] = anchor.step
    outside = block(plain.step, 5), block(plain.step, BLOCK)  # the plain FP32 loop before automp is enabled
    measures = {k: {"after switch": [], "second": [], "block": []} for k in sides}
    try:
        loop.step()  # the roots exist from here on (the anchor's: automp leaves it to the script's autocast)
        anchor.step()
        for label, step in sides.items():
            block(step, 5)  # compile and warm up each path once
        order = list(sides)
        for r in range(int(rounds)):
            for label in (order if r % 2 == 0 else order[::-1]):
                m = measures[label]
                m["after switch"].append(synced_step(sides[label]))
                m["second"].append(synced_step(sides[label]))
                m["block"].append(block(sides[label], BLOCK))
    finally:
        automp.disable()
    print(f"{name}: median ms/iteration over {rounds} alternating rounds (device: "
          f"{torch.cuda.get_device_name() if CUDA else 'cpu'})")
    print("| path | after a switch, synced (the trial) | second, synced | block of 10, no sync (settled) |")
    print("|---|---:|---:|---:|")
    for label, m in measures.items():
        print(f"| {label} | " + " | ".join(f"{statistics.median(v):.2f}" for v in m.values()) + " |", flush=True)
    print(f"the plain FP32 loop before automp.enable(): block of {BLOCK} {outside[1]:.2f} ms", flush=True)
    if trial == "no-trial":
        return

    torch.manual_seed(0)
    fresh = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "fp32-eager", dev)
    automp.enable(dtype="bf16", cache_dir=tempfile.mkdtemp())
    try:
        n = 0
        while (n < 2 or not automp.settled()) and n < 200:
            fresh.step()
            n += 1
        settled = [block(fresh.step, BLOCK) for _ in range(3)]
        anchor_ms = [block(anchor.step, BLOCK) for _ in range(3)]
    finally:
        report = automp.disable()
    for c in report.get("choices", []):
        print(f"real trial ({n} iterations): {c.get('module')} -> {c.get('path')}: {c.get('reason')}")
    print(f"settled on its choice: {statistics.median(settled):.2f} ms; hand-written autocast eager "
          f"{statistics.median(anchor_ms):.2f} ms", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
