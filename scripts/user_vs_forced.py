"""Diagnostic: automp as a user runs it (its own trial, then the path it chose) against the same path settled
by hand (scripts/compare_paths.py's method) and the hand-written anchor, all three in one process and one automp
session, timed in interleaved blocks and then traced (kernels, host wall, syncs per step). On the H100 the Llama-style
model ran 1.34x the anchor settled by hand and 0.98x as a user runs it: this shows which side moved.

    python scripts/user_vs_forced.py llama
"""
import statistics
import sys
import tempfile

import torch

import automp
from automp.bench.suites import zoo
from automp.runtime.trial import Path
from profile_dtype import CUDA, block, kernels

BLOCK, ROUNDS, PROFILED = 10, 4, 3


def main(name):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    loops = {"anchor": zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "autocast-bf16-compile", dev)}
    block(loops["anchor"], 3)
    for side in ("user", "forced"):
        torch.manual_seed(0)
        loops[side] = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "fp32-eager", dev)
    automp.enable(dtype="bf16", cache_dir=tempfile.mkdtemp())  # a first run: no verdict from an earlier one
    session = automp._session
    n = 0
    while n < 3 or not automp.settled() and n < 200:
        loops["user"].step()
        n += 1
    print(f"user: settled after {n} steps: {automp.report().get('choices')}", flush=True)
    candidates = session.candidates
    session.candidates = lambda device, low: ([Path.EAGER_LOW, Path.COMPILED_AUTOCAST], "diagnostic")
    block(loops["forced"], 1)  # its trial's eager call: the reads that decide what is detached
    for module in loops["forced"].work.modules.values():  # a verdict the user's run cached (same key) is overridden
        root = session.roots[module]
        root.path, root.trial, root.confirm, root.watch = Path.COMPILED_AUTOCAST, None, None, None
    session.paths.unfinished.clear()
    session.candidates = candidates
    block(loops["forced"], 4)
    for m, r in session.roots.items():
        print(f"root {r.label}: path {r.path} watch {r.watch} confirm {r.confirm} aside {r.aside} graphs {r.graphs} "
              f"fields {r.fields.detach}", flush=True)
    for side, loop in loops.items():
        fused = [[g.get("fused") for g in o.param_groups] for o in loop.work.optimizers.values()]
        print(f"{side}: optimizer fused {fused}", flush=True)
    print(f"cudnn.benchmark {torch.backends.cudnn.benchmark}; dynamo counters "
          f"{ {k: dict(v) for k, v in torch._dynamo.utils.counters.items() if k in ('stats', 'graph_break')} }",
          flush=True)
    times = {side: [] for side in loops}
    order = list(loops)
    for r in range(ROUNDS):
        for side in (order if r % 2 == 0 else order[::-1]):
            times[side].append(block(loops[side], BLOCK))
    anchor = statistics.median(times["anchor"])
    for side, t in times.items():
        print(f"{side:7s} {statistics.median(t):7.2f} ms ({min(t):.2f}-{max(t):.2f}) ratio "
              f"{anchor / statistics.median(t):.3f}", flush=True)
    profiles = {side: kernels(loop.step, PROFILED) for side, loop in loops.items()}
    for side, (per, _, wall, syncs) in profiles.items():
        print(f"  {side}: profiled wall {wall:.2f} ms/step, CUDA kernel total {sum(per.values()):.2f} ms/step, "
              f"{len(per)} distinct kernels, host syncs/step {syncs:.1f}", flush=True)
    a, u, f = (profiles[s][0] for s in ("anchor", "user", "forced"))
    print("| kernel | anchor | user | forced |\n|---|---:|---:|---:|")
    for k in sorted(set(a) | set(u) | set(f), key=lambda k: -abs(u.get(k, 0) - f.get(k, 0)))[:20]:
        print(f"| {k} | {a.get(k, 0):.3f} | {u.get(k, 0):.3f} | {f.get(k, 0):.3f} |")
    automp.disable()


if __name__ == "__main__":
    main(sys.argv[1])
