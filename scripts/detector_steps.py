"""Diagnostic: per-step wall time and graphs compiled of the zoo detector (or another zoo model) under
automp (python scripts/detector_steps.py <path: auto|compile|eager|fp32|autocast-graphs> <steps> [model]): does a
compiled detector keep recompiling as its proposals change, and where does automp's recompile watch
(automp.runtime.guards.recompile_watch) move it? Path `reduce-overhead`: no automp, the hand-written autocast loop compiled
with torch.compile(mode="reduce-overhead"), to compare automp's CUDA-graph path with torch's own."""
import sys
import time

import torch

import automp
from automp.bench.suites import zoo


def main(path: str, steps: int, model: str = "detector") -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    plain = path == "reduce-overhead"
    loop = zoo.ModeLoop(zoo.MODELS[model][0](dev == "cpu", dev), "autocast-bf16-eager" if plain else "fp32-eager", dev)
    if plain:
        loop.nets = {k: torch.compile(m, mode="reduce-overhead") for k, m in loop.work.modules.items()}
    automp.enable(dtype="bf16", path="fp32" if plain else path)  # fp32 forced: the script's autocast is left alone
    roots = automp._session.roots
    for i in range(steps):
        t = time.perf_counter()
        loop.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        paths = ",".join(str(r.path.value if r.path else "trial") for r in roots.values())
        print(f"step {i}: {1e3 * (time.perf_counter() - t):.1f} ms, graphs {sum(r.graphs for r in roots.values())}, "
              f"{paths}", flush=True)
    report = automp.disable()
    from torch._dynamo.utils import counters
    print("compiles", report.get("compiles"), "| cudagraph counters",
          {k: v for k, v in counters["inductor"].items() if "cudagraph" in k})
    for c in report.get("choices", []):
        print("choice", c["module"], c["path"], "|", c["reason"])


if __name__ == "__main__":
    main(*sys.argv[1:2], int(sys.argv[2]), *sys.argv[3:])
