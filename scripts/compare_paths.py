"""Issue 11 diagnostic: one zoo model, the hand-written anchor against automp on each forced compiled path, with
and without detaching unread output fields (one eager call first, as in a trial), timed in blocks alternating with
the anchor (host drift shows as the anchor's own spread). Each automp variant is a fresh automp.enable() (its own
compile); its peak memory is counted above what was allocated before its model was built (the anchor's model stays
resident: without the subtraction, an H100 run read +1.6 GiB for automp that was the anchor's parameters and
optimizer state).

    python scripts/compare_paths.py bert [bf16] [paths|fused|stock]
"""
import statistics
import sys
import tempfile

import torch

import automp
import automp.session as session
from automp.bench.suites import zoo
from automp.choose import Path, TrialConfig
from automp.unread_outputs import detach_unread
from profile_dtype import CUDA, block  # the same block timing (scripts/ is on sys.path when run as a script)

BLOCK, ROUNDS = 10, 3


def variant(name, dev, dtype, path, detach, fuse=True):
    """automp running `path` after one eager call (the order of a real trial, so the reads of that call decide what
    is detached), without the trial's timing: the path's warm-up never ends within this script."""
    session.detach_unread = detach_unread if detach else (lambda out, fields: out)
    torch.manual_seed(0)
    base = torch.cuda.memory_allocated() / 2**30 if CUDA else 0.0  # the anchor's model, resident throughout
    loop = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "fp32-eager", dev)
    session.Session._candidates = lambda self, device, low: ([Path.EAGER_LOW, path], "diagnostic")
    automp.enable(dtype=dtype, cache_dir=tempfile.mkdtemp(), fuse_optimizers=fuse)  # no verdict from an earlier run
    automp._session.trial_config = TrialConfig(warmup={Path.EAGER_LOW: 1, path: 10**6})
    try:
        block(loop, 4)  # one eager call, then compile + warm-up
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        times = [block(loop, BLOCK) for _ in range(ROUNDS)]
        peak = torch.cuda.max_memory_allocated() / 2**30 - base if CUDA else float("nan")
    finally:
        rep = automp.disable()
        session.detach_unread = detach_unread
    return times, peak, rep


VARIANTS = {"paths": (("autocast-compile, detach", Path.COMPILED_AUTOCAST, True, True),
                      ("autocast-compile, no detach", Path.COMPILED_AUTOCAST, False, True),
                      ("compile, detach", Path.COMPILED, True, True),
                      ("compile, no detach", Path.COMPILED, False, True)),
            "fused": (("autocast-compile, fused Adam", Path.COMPILED_AUTOCAST, True, True),
                      ("autocast-compile, Adam as written", Path.COMPILED_AUTOCAST, True, False),
                      ("compile, Adam as written", Path.COMPILED, True, False)),
            "stock": (("autocast-compile", Path.COMPILED_AUTOCAST, True, True),)}


def main(name, dtype="bf16", which="paths"):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if CUDA else "cpu"
    torch.manual_seed(0)
    anchor = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), f"autocast-{dtype}-compile", dev)
    block(anchor, 3)
    rows = []
    for label, path, detach, fuse in VARIANTS[which]:
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        a = [block(anchor, BLOCK) for _ in range(ROUNDS)]
        a_peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else float("nan")
        times, peak, rep = variant(name, dev, dtype, path, detach, fuse)
        rows.append((label, statistics.median(times), peak, statistics.median(a), a_peak,
                     rep.get("unread_outputs"), rep.get("compiles")))
        print(f"{label:30s} automp {statistics.median(times):7.2f} ms ({min(times):.2f}-{max(times):.2f}) "
              f"peak {peak:.2f} GiB | anchor {statistics.median(a):7.2f} ms ({min(a):.2f}-{max(a):.2f}) peak "
              f"{a_peak:.2f} | ratio {statistics.median(a) / statistics.median(times):.3f} | "
              f"unread {rep.get('unread_outputs')} compiles {rep.get('compiles')}", flush=True)
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
