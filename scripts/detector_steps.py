"""Issue 11 diagnostic: per-step wall time and graphs compiled of the zoo detector under automp
(python scripts/detector_steps.py <path: auto|compile|eager|fp32> <steps>): does a compiled detector keep
recompiling as its proposals change, and where does automp's recompile watch (automp.recompile_watch) move it?"""
import sys
import time

import torch

import automp
from automp.bench.suites import zoo


def main(path: str, steps: int) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    loop = zoo.ModeLoop(zoo.MODELS["detector"][0](dev == "cpu", dev), "fp32-eager", dev)
    automp.enable(dtype="bf16", path=path)
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
    print("compiles", report.get("compiles"))
    for c in report.get("choices", []):
        print("choice", c["module"], c["path"], "|", c["reason"])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
