"""One mode of one model in `automp bench fp8` (automp.bench.suites.fp8, whose docstring says what is measured and
why): its loop, its warm-up and first run, its timed blocks, its second run, and its row."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import Counter
from typing import Any, Callable

import torch

from automp.bench import kernel_profile
from automp.bench.fp8_workloads import LOOPS, MODELS, automp_options
from automp.bench.harness import cold_compiles, free, one_line
from automp.bench.harness import block_ms
from automp.bench.zoo_modes import time_limit

ROUNDS = 6  # even: every mode leads as often as it trails
# --profile's kernel categories, first match wins (kernel_profile): attention (cuDNN's, flash, memory-efficient),
# GEMMs (cuBLAS's nvjet/xmma, CUTLASS, torch._scaled_mm's FP8 GEMMs, Inductor's templates), the optimizer's
# multi-tensor kernels; "other" is the rest: Inductor's fused pointwise and reductions (norms, rotary, the loss,
# FP8 casts and amax), copies
PROFILE = (("attention", re.compile(r"attention|attn|flash|fmha|sdpa", re.I)),
           ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|matmul|scaled_mm|splitk|triton_tem|"
                                 r"(^|[_:])(b|add)?mm(_|$)", re.I)),
           ("optimizer", re.compile(r"multi_tensor|adam", re.I)))
ROW_KEYS = ("model", "mode", "step_ms", "spread", "peak_gib", "peak_reserved_gib", "loss", "first_run_s",
            "second_run_s", "second_peak_gib", "second_peak_reserved_gib", "ratio_vs_bf16", "automp_paths",
            "fp8_layers", "blocks")


def _calls() -> Counter:
    """The root calls automp's session has counted so far, by the path they ran (all modules and phases): the
    difference over one step says which path, or paths, that step ran (`warmup_paths`)."""
    import automp
    recorder = automp.recorder()
    counts: Counter = Counter()
    for phases in getattr(recorder, "calls", {}).values():
        for by_path in phases.values():
            counts.update(by_path)
    return counts


class Peak:
    """A mode's own peak memory from now on: torch.cuda's allocated and reserved peaks above what was there when it
    started (the other resident modes). Reserved counts CUDA graphs' pools whole; allocated does not count the
    blocks a captured graph reuses at replay, which the allocator holds as free in the graph's private pool."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.top = self.top_reserved = 0  # the peaks before the last `step` reset torch's
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.allocated, self.reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()

    def step(self) -> float | None:
        """The peak allocated since the last call (or the start), above the start, in GiB; None on a CPU. Which
        step of a trial raised the mode's peak is what says which candidate did: the trial's own figures
        (`trial_peaks_gib`) cover only its timed and warm-up intervals, not the calls it aborted or ran again."""
        if not self.cuda:
            return None
        top = torch.cuda.max_memory_allocated()
        self.top, self.top_reserved = max(self.top, top), max(self.top_reserved, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        return round((top - self.allocated) / 2**30, 3)

    def into(self, row: dict[str, Any], prefix: str) -> None:
        """Write `<prefix>peak_gib` and `<prefix>peak_reserved_gib` (a CPU: nothing)."""
        if self.cuda:
            torch.cuda.synchronize()
            top = max(self.top, torch.cuda.max_memory_allocated())
            reserved = max(self.top_reserved, torch.cuda.max_memory_reserved())
            row[f"{prefix}peak_gib"] = round((top - self.allocated) / 2**30, 3)
            row[f"{prefix}peak_reserved_gib"] = round((reserved - self.reserved) / 2**30, 3)


class Run:
    """One mode of one model: its loop, its step count, its block times and its row."""

    def __init__(self, model: str, mode: str, opts: argparse.Namespace, blocks: str):
        self.mode, self.opts, self.device = mode, opts, opts.device
        self.row: dict[str, Any] = {k: None for k in ROW_KEYS}
        self.row.update(model=model, mode=mode, blocks=blocks)
        self.common = max(opts.warmup, opts.first_steps) + ROUNDS * opts.steps  # where every mode reads its loss
        self.step_fn: Callable[[], torch.Tensor] | None = None
        self.n, self.spent = 0, 0.0
        self.loss: torch.Tensor | None = None
        self.means: list[float] = []
        self.cache: tempfile.TemporaryDirectory | None = None  # automp modes: their verdict cache
        # this mode's Inductor cache directory (both of its runs with --second-run): empty at its first build
        self.inductor: tempfile.TemporaryDirectory | None = tempfile.TemporaryDirectory(prefix="automp-bench-inductor-")

    @property
    def live(self) -> bool:
        return "skipped" not in self.row

    def skip(self, reason: str) -> None:
        self.row["skipped"] = reason
        self.step_fn = None  # its model, optimizer state and graphs go

    def guarded(self, work: Callable[[], None]) -> None:
        """work() under what is left of this mode's --mode-timeout; a timeout or any exception skips the mode."""
        if not self.live:
            return
        limit = self.opts.mode_timeout
        if limit > 0 and self.spent >= limit:
            return self.skip(f"timeout: the mode ran past --mode-timeout {limit:g} s")
        t0 = time.perf_counter()
        try:
            with time_limit(limit - self.spent if limit > 0 else 0) as expired:
                work()
                if expired:  # swallowed by the code it interrupted
                    raise expired[0]
        except Exception as e:  # noqa: BLE001 - a failing mode (OOM, compile error) must not lose the others' rows
            self.skip(str(expired[0]) if expired else one_line(e))
        finally:
            self.spent += time.perf_counter() - t0

    def step(self) -> None:
        loss = self.step_fn()
        self.n += 1
        if self.n == self.common:  # a copy: a CUDA graph's replay overwrites its output
            self.loss = loss.clone()

    def compiling(self) -> contextlib.AbstractContextManager[None]:
        """This mode's compiles on its own caches (harness.cold_compiles)."""
        return cold_compiles(self.inductor.name) if self.inductor is not None else contextlib.nullcontext()

    def build(self, quick: bool, layers: int) -> None:
        """Build the loop and warm it up (automp: until settled); first_run_s at --first-steps steps."""
        import automp

        def go() -> None:
            peak = Peak(self.device)
            t0 = time.perf_counter()
            torch.manual_seed(0)
            self.step_fn = LOOPS[self.mode](MODELS[self.row["model"]][0](quick, self.device, layers), self.device)
            target = max(self.opts.warmup, self.opts.first_steps)
            steps = self.row["warmup_peaks_gib"] = [] if self.device == "cuda" else None
            paths = self.row["warmup_paths"] = [] if self.mode.startswith("automp") else None
            seen = _calls()
            while self.n < target or (self.mode.startswith("automp") and not automp.settled()
                                      and self.n < self.opts.max_warmup):
                self.step()
                if steps is not None:
                    steps.append(peak.step())
                if paths is not None:
                    now = _calls()
                    paths.append("+".join(sorted(now - seen)))
                    seen = now
                if self.n == self.opts.first_steps:
                    if self.device == "cuda":  # the steps' kernels done, not only queued
                        torch.cuda.synchronize()
                    self.row["first_run_s"] = round(time.perf_counter() - t0, 2)
            if self.mode.startswith("automp"):
                self.row["settled"] = bool(automp.settled())
            peak.into(self.row, "")
        with self.compiling():
            self.guarded(go)

    def second(self, quick: bool, layers: int) -> None:
        """--second-run: the mode built again from nothing, its first --first-steps steps timed (second_run_s) with
        its own caches warm; automp's modes on their verdict cache. A failure is noted, the first run's row kept."""
        import automp
        if not self.live:
            return
        self.step_fn = None
        free(dynamo=True)  # the first run's model, optimizer state and compiled graphs
        expired: list[BaseException] = []
        try:
            if self.mode.startswith("automp"):
                automp.enable(**automp_options(self.mode), cache_dir=self.cache.name)
            with self.compiling(), time_limit(self.opts.mode_timeout) as expired:
                peak = Peak(self.device)
                t0 = time.perf_counter()
                torch.manual_seed(0)
                step = LOOPS[self.mode](MODELS[self.row["model"]][0](quick, self.device, layers), self.device)
                for _ in range(self.opts.first_steps):
                    step()
                peak.into(self.row, "second_")
                self.row["second_run_s"] = round(time.perf_counter() - t0, 2)
        except Exception as e:  # noqa: BLE001 - the first run's figures stand; say why the second has none
            self.row["second_run_error"] = str(expired[0]) if expired else one_line(e)
        finally:
            if self.mode.startswith("automp") and automp.is_enabled():
                report = automp.disable()
                self.row["second_paths"] = {c["module"]: c["path"] for c in report.get("choices", [])}
            step = None
            free(dynamo=True)

    def block(self, steps: int, timed: bool = True) -> None:
        def go() -> None:
            ms = block_ms(self.step, steps, self.device)
            if timed:
                self.means.append(ms)
        self.guarded(go)

    def profile(self) -> None:
        """--profile: one more step under torch.profiler, its kernel time by category (PROFILE) in the row; once per
        mode, after its timed blocks (an automp mode inside its session, on the path it settled on)."""
        if not self.live or "kernel_ms" in self.row:
            return
        self.guarded(lambda: self.row.update(kernel_profile.summed(
            kernel_profile.profiled(self.step, self.device), PROFILE, top=8)))

    def note_report(self, report: dict[str, Any] | None) -> None:
        report = report or {}
        self.row["automp_paths"] = {c["module"]: c["path"] for c in report.get("choices", [])}
        for key, field in (("trial_ms", "timings_ms"), ("trial_peaks_gib", "peaks_gib"),
                           ("trial_host_shares", "host_shares")):  # what the trial timed,
            # and which candidate raised the device's peak memory to what
            found = {c["module"]: c[field] for c in report.get("choices", []) if c.get(field)}
            if found:
                self.row[key] = found
        self.row["verdict_rules"] = {c["module"]: c.get("rule") for c in report.get("choices", [])}
        bounds = {c["module"]: c["bounds"] for c in report.get("choices", []) if c.get("bounds")}
        if bounds:  # what ruled a candidate out before it ran, by what figures: FP32 eager's FLOP bound, the FP8
            # step's bf16 twin forecast, CUDA graphs on a device-bound step (Verdict.bounds)
            self.row["trial_bounds"] = bounds
        if self.mode.startswith("automp-fp8"):
            self.row["fp8_layers"] = report.get("fp8", {})
        rules = Counter(r["rule"] for r in report.get("rewrites", []))
        if rules:  # the graph rewrites that ran (automp-bf16-siblings: how many groups were joined)
            self.row["rewrites"] = dict(rules)
        if report.get("compile_times"):  # where the first run's compile time went, per path (runtime.compile_log)
            self.row["compile_times"] = report["compile_times"]

    def finish(self) -> dict[str, Any]:
        for tmp in (self.inductor, self.cache):  # both runs done
            if tmp is not None:
                tmp.cleanup()
        self.inductor = self.cache = None
        if self.live and self.means:
            self.row["step_ms"] = round(statistics.median(self.means), 3)
            self.row["spread"] = [round(min(self.means), 3), round(max(self.means), 3)]
            loss = float(self.loss) if self.loss is not None else math.nan
            self.row["loss"] = loss if math.isfinite(loss) else None
        self.step_fn = None
        return self.row

def cold_cache() -> tempfile.TemporaryDirectory:
    """A cache directory without verdicts, so automp's trial runs as on a model's first run and first_run_s counts
    it; the environment's device measurements (GEMM rates, the FP8 table) are copied in: those are paid once per
    machine, not per model."""
    from automp.config import AutoMPConfig
    src = AutoMPConfig.from_env().cache_dir
    tmp = tempfile.TemporaryDirectory(prefix="automp-bench-fp8-")
    for name in os.listdir(src) if src and os.path.isdir(src) else []:
        if not name.startswith("verdicts.") and os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), tmp.name)
    return tmp
