"""Diagnostic: does anything of a model outlive automp.disable()? (zoo LSTM on an H100: automp's second zoo
pass, right after its first, peaked 0.28 GiB above the first pass, the size of the LSTM's parameters plus their
gradients, as if the first pass's model were still alive.)

    python scripts/cast_cache_leak.py MODEL PATH STEPS [cpu]
Runs the zoo workload under automp (PATH: auto, eager, compile, ...) for STEPS steps, disables automp, drops the
model and prints whether one of its parameters is still alive after gc, and the device memory still allocated,
before and after torch.clear_autocast_cache()."""
import gc
import sys
import tempfile
import weakref

import torch

import automp
from automp.bench.suites import zoo


def main(name: str, path: str, steps: int, device: str) -> None:
    cuda = device == "cuda"
    gc.collect()
    base = torch.cuda.memory_allocated() if cuda else 0
    torch.manual_seed(0)
    loop = zoo.ModeLoop(zoo.MODELS[name][0](not cuda, device), "fp32-eager", device)
    ref = weakref.ref(next(next(iter(loop.work.modules.values())).parameters()))
    automp.enable(dtype="bf16", path=path, cache_dir=tempfile.mkdtemp())
    for _ in range(steps):
        loop.step()
    rep = automp.disable()
    del loop
    gc.collect()
    mib = (lambda: (torch.cuda.memory_allocated() - base) / 2**20) if cuda else (lambda: 0.0)
    alive, left = ref() is not None, mib()
    torch.clear_autocast_cache()
    gc.collect()
    print(f"| {name} | {path} | {steps} | {[c['path'] for c in rep['choices']]} | alive {alive}, {left:.1f} MiB | "
          f"alive {ref() is not None}, {mib():.1f} MiB |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "cuda")
