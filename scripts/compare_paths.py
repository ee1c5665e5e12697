"""Diagnostic: one zoo model, the hand-written anchor against automp on each forced compiled path, with
and without detaching unread output fields (one eager call first, as in a trial), timed in blocks alternating with
the anchor (host drift shows as the anchor's own spread). Each automp variant is a fresh automp.enable() (its own
compile); its peak memory is counted above what was allocated before its model was built (the anchor's model stays
resident: without the subtraction, an H100 run read +1.6 GiB for automp that was the anchor's parameters and
optimizer state).

    python scripts/compare_paths.py bert [bf16] [paths|fused|stock|profile|profile-one|interleave] [anchor dtype]

`profile` also traces a few steps of the anchor and of each variant with torch.profiler and prints the CUDA kernels
whose time differs most (scripts/profile_dtype.py's method), and adds a variant that compiles the module the way
the anchor does (torch.compile(module), autocast entered outside it) inside automp's session machinery: if that one
matches the anchor, the gap is in how automp's compiled function is built, not in the session around it.

`profile-one` profiles the autocast-compiled path alone; with `fp16 profile-one bf16` the anchor is the bf16 loop, so
the kernel diff is what fp16 (loss scaling) adds.

`interleave` (or `interleave-no-tune_cudnn,no-tune_layout`: those automp.enable flags off; `interleave-profile`:
each side traced after its last block) runs automp as a user
does (its own trial, then the path it chose) and then alternates blocks of automp and of the anchor (A B, B A, ...)
in the same process: automp.bench.suites.zoo_interleave, which `automp bench zoo --interleave` also uses.
"""
import contextlib
import statistics
import sys
import tempfile

import torch

import automp
import automp.runtime.session as session
from automp.runtime import compiled_paths
from automp.bench.suites import zoo, zoo_interleave
from automp.runtime.trial import Path, TrialConfig
from automp.runtime.guards.unread_outputs import detach_unread
from profile_dtype import CUDA, block, kernels  # the same block timing (scripts/ is on sys.path when run as a script)

BLOCK, ROUNDS = 10, 3


def _module_compiled(module, root):
    """The anchor's form: torch.compile of the module itself, autocast entered outside the compiled call."""
    compiled = torch.compile(module)

    def call(*args, **kwargs):
        with torch.autocast(root.device.type, dtype=root.low):
            return compiled(*args, **kwargs)
    return call


@contextlib.contextmanager
def settle_path(dtype, path, loop, fuse=True):
    """automp enabled around `loop`: one eager call (the order of a real trial, so the reads of that call decide what
    is detached), then compile and warm-up of `path`, then settled on `path` by hand: a trial synchronizes the device
    at every call it times, and a path left in an endless warm-up (this script's first version) was timed with a sync
    per step, which charged each step the host's launch latency the anchor hides. Yields the report, filled in when
    the block ends."""
    factory = session.open_session  # the session enable() opens: these candidates and warm-ups
    session.open_session = lambda config, recorder: session.Session(
        config, recorder, candidates=lambda device, low: ([Path.EAGER_LOW, path], "diagnostic"),
        trial_config=TrialConfig(warmup={Path.EAGER_LOW: 1, path: 10**6}))
    automp.enable(dtype=dtype, cache_dir=tempfile.mkdtemp(), fuse_optimizers=fuse)  # no verdict from an earlier run
    report = {}
    try:
        block(loop, 4)
        for root in automp._session.roots.values():
            root.path, root.trial = path, None
        automp._session.paths.unfinished.clear()
        yield report
    finally:
        report.update(automp.disable())
        session.open_session = factory


def variant(name, dev, dtype, path, detach, fuse=True, module_form=False, profiled=0):
    """One automp variant on a fresh model: its block timings, peak memory, report and (profiled > 0) kernels."""
    compiled_paths.detach_unread = detach_unread if detach else (lambda out, fields: out)
    stock = compiled_paths.stock
    if module_form:
        compiled_paths.stock = _module_compiled
    torch.manual_seed(0)
    base = torch.cuda.memory_allocated() / 2**30 if CUDA else 0.0  # the anchor's model, resident throughout
    loop = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), "fp32-eager", dev)
    try:
        with settle_path(dtype, path, loop, fuse) as rep:
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            times = [block(loop, BLOCK) for _ in range(ROUNDS)]
            peak = torch.cuda.max_memory_allocated() / 2**30 - base if CUDA else float("nan")
            prof = kernels(loop.step, profiled) if profiled else None
    finally:
        compiled_paths.detach_unread = detach_unread
        compiled_paths.stock = stock
    return times, peak, rep, prof


VARIANTS = {"paths": (("autocast-compile, detach", Path.COMPILED_AUTOCAST, True, True),
                      ("autocast-compile, no detach", Path.COMPILED_AUTOCAST, False, True),
                      ("compile, detach", Path.COMPILED, True, True),
                      ("compile, no detach", Path.COMPILED, False, True)),
            "fused": (("autocast-compile, fused Adam", Path.COMPILED_AUTOCAST, True, True),
                      ("autocast-compile, Adam as written", Path.COMPILED_AUTOCAST, True, False),
                      ("compile, Adam as written", Path.COMPILED, True, False)),
            "stock": (("autocast-compile", Path.COMPILED_AUTOCAST, True, True),),
            "profile-one": (("autocast-compile", Path.COMPILED_AUTOCAST, True, True),),
            "profile": (("autocast-compile", Path.COMPILED_AUTOCAST, True, True),
                        ("torch.compile(module) in automp", Path.COMPILED_AUTOCAST, False, True, True),
                        ("compile", Path.COMPILED, True, True))}
PROFILED = 3


def diff_table(a, b, top=25):
    print("| kernel | anchor ms/step | automp ms/step |\n|---|---:|---:|")
    for k in sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))[:top]:
        print(f"| {k} | {a.get(k, 0):.3f} | {b.get(k, 0):.3f} |")


def interleaved(name, dev, dtype, options):
    if dtype != "bf16":
        raise SystemExit("interleave: bf16 only (automp steps aside for the fp16 anchor's autocast, and its loss "
                         "scaling with it)")
    profiles, calls = {}, {}

    def timer(step, steps, device):  # `profile` in the flags: each side traced after its last block, automp still on
        took = zoo_interleave.block_ms(step, steps, device)
        calls[step] = calls.get(step, 0) + 1
        if profile and calls[step] == 9:
            profiles[len(profiles)] = kernels(step, PROFILED)
        return took

    profile = options.pop("profile", True) is False
    got = zoo_interleave.interleaved(name, not CUDA, dev, BLOCK, 3, 200, rounds=8, options=options, timer=timer)
    b = got["blocks"]
    print("blocks, in order: " + " | ".join(f"{side} {' '.join(f'{t:.1f}' for t in ts)}" for side, ts in b.items()))
    if profiles:
        first, second = profiles[0], profiles[1]  # round 8 runs automp first, then the anchor
        for who, (per, _, wall, syncs) in (("automp", first), ("anchor", second)):
            print(f"  {who}: profiled wall {wall:.2f} ms/step, CUDA kernel total {sum(per.values()):.2f} ms/step, "
                  f"{len(per)} distinct kernels, host syncs/step {syncs:.1f}", flush=True)
        diff_table(second[0], first[0])
    print(f"interleaved, 8 rounds of {BLOCK} steps after automp's trial (settled: {got['settled']}): automp "
          f"{got['automp_ms']:.2f} ms ({min(b['automp']):.2f}-{max(b['automp']):.2f}) | anchor {got['anchor_ms']:.2f} "
          f"ms ({min(b['anchor']):.2f}-{max(b['anchor']):.2f}) | ratio {got['ratio']:.3f} | paths {got['paths']}",
          flush=True)


def main(name, dtype="bf16", which="paths", anchor_dtype=None):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if CUDA else "cpu"
    if which.startswith("interleave"):  # interleave-no-tune_cudnn,no-fuse_optimizers: those automp.enable flags off
        flags = which.partition("-")[2]
        interleaved(name, dev, dtype, {f.removeprefix("no-"): False for f in flags.split(",") if f})  # profile: False
        return
    torch.manual_seed(0)
    anchor = zoo.ModeLoop(zoo.MODELS[name][0](not CUDA, dev), f"autocast-{anchor_dtype or dtype}-compile", dev)
    block(anchor, 3)
    profiled = PROFILED if which.startswith("profile") else 0
    for label, path, detach, fuse, *module_form in VARIANTS[which]:
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        a = [block(anchor, BLOCK) for _ in range(ROUNDS)]
        a_peak = torch.cuda.max_memory_allocated() / 2**30 if CUDA else float("nan")
        times, peak, rep, prof = variant(name, dev, dtype, path, detach, fuse, bool(module_form), profiled)
        print(f"{label:30s} automp {statistics.median(times):7.2f} ms ({min(times):.2f}-{max(times):.2f}) "
              f"peak {peak:.2f} GiB | anchor {statistics.median(a):7.2f} ms ({min(a):.2f}-{max(a):.2f}) peak "
              f"{a_peak:.2f} | ratio {statistics.median(a) / statistics.median(times):.3f} | "
              f"unread {rep.get('unread_outputs')} compiles {rep.get('compiles')}", flush=True)
        if prof is not None:
            ref = kernels(anchor.step, profiled)
            for who, (per, _, wall, syncs) in (("anchor", ref), ("automp", prof)):
                print(f"  {who}: profiled wall {wall:.2f} ms/step, CUDA kernel total {sum(per.values()):.2f} ms/step, "
                      f"{len(per)} distinct kernels, host syncs/step {syncs:.1f}", flush=True)
            diff_table(ref[0], prof[0])
        if CUDA:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
