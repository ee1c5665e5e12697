"""Diagnostic: where is the GPU idle during a training step, and what was the host doing then?

automp's compiled paths ran fewer kernel-milliseconds than the hand-written loop on an H100 (BERT, GPT-2) yet their
step time was 4-5 ms above their kernel total, the anchor's about 1 ms: the GPU waits for something. This traces a
few steps (torch.profiler, chrome trace) of the anchor and of automp on one forced path, finds the gaps between
consecutive GPU kernels, and charges each gap to the host operation that launched the kernel after it (a gap whose
next kernel was launched late is host time; one launched early is a device-side wait).

    python scripts/gpu_gaps.py gpt2 [bf16|fp16] [autocast-compile|compile|eager] [anchor|no-anchor]

With `eager` the anchor is the hand-written autocast eager loop (the small scripts' bar), else autocast + compile.
"""
import collections
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from automp.bench.suites import zoo
from automp.config import PATHS
from compare_paths import settle_path  # the same forced-path set-up (scripts/ is on sys.path)
from profile_dtype import CUDA, block

GAP_US = 20.0  # shorter gaps are a kernel launch's own latency
STEPS = 3


def trace(loop, steps):
    """The chrome-trace events of `steps` steps (profiler started after the queue drained)."""
    torch.cuda.synchronize() if CUDA else None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            loop.step()
        torch.cuda.synchronize() if CUDA else None
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return json.load(f)["traceEvents"]


def gaps(events, steps):
    """Per step: GPU busy ms, idle ms, and the idle ms charged to the host op that launched the kernel after each
    gap (innermost named op; `late` when that launch came after the previous kernel ended)."""
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                     key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = sorted((e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")
                  and e.get("ph") == "X" and not e["name"].startswith("ProfilerStep")), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    syncs = collections.Counter()  # host calls that wait for the device, charged to the op they ran in
    for e in runtime:
        if any(w in e["name"] for w in ("Synchronize", "cudaMemcpy", "cudaStreamWaitEvent")) and e["dur"] > 5:
            inside = [o["name"][:70] for o in ops if o["ts"] <= e["ts"] <= o["ts"] + o["dur"]]
            syncs[(e["name"], " > ".join(inside[:1] + inside[-1:]))] += e["dur"]
    busy = sum(k["dur"] for k in kernels)
    by_op, late_total, idle = collections.Counter(), 0.0, 0.0
    for prev, nxt in zip(kernels, kernels[1:]):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap < GAP_US:
            continue
        idle += gap
        launch = launches.get(nxt["args"].get("correlation"))
        where, late = "?", False
        if launch is not None:
            late = launch["ts"] > prev["ts"] + prev["dur"]
            inside = [o for o in ops if o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]
            named = [o for o in inside if not o["name"].startswith(("cuda", "aten::empty"))]
            named = named if len(named) <= 3 else named[:1] + named[-2:]  # outermost, then the innermost two
            where = " > ".join(o["name"][:60] for o in named) if named else launch["name"]
        by_op[(where, late)] += gap
        late_total += gap if late else 0.0
    return busy / 1e3 / steps, idle / 1e3 / steps, late_total / 1e3 / steps, by_op, syncs


def report(label, loop):
    ms = block(loop, 10)
    busy, idle, late, by_op, syncs = gaps(trace(loop, STEPS), STEPS)
    print(f"{label}: step {ms:.2f} ms (unprofiled); profiled GPU busy {busy:.2f} ms/step, idle in gaps >= "
          f"{GAP_US:g} us {idle:.2f} ms/step, of which next kernel launched late (host-bound) {late:.2f}", flush=True)
    for (where, is_late), us in by_op.most_common(14):
        print(f"    {us / 1e3 / STEPS:6.2f} ms/step  {'host' if is_late else 'device'}  {where}")
    for (call, where), us in syncs.most_common(8):
        print(f"    host waits: {us / 1e3 / STEPS:6.2f} ms/step in {call} ({where})")


def main(name, dtype="bf16", path="autocast-compile", anchor_too="anchor"):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    if anchor_too == "anchor":
        mode = f"autocast-{dtype}-{'eager' if path == 'eager' else 'compile'}"  # eager: the small scripts' bar
        anchor = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), mode, dev)
        block(anchor, 3)
        report(f"anchor {mode}", anchor)
        del anchor
        torch.cuda.empty_cache() if CUDA else None
    loop = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "fp32-eager", dev)
    with settle_path(dtype, PATHS[path], loop):
        report(f"automp-{dtype} {path}", loop)


if __name__ == "__main__":
    main(*sys.argv[1:])
