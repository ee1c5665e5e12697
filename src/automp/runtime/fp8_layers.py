"""The FP8 side of a session under dtype="fp8": which linear layers of each root run FP8 (chosen on its first call),
installed with their undo, and the loss watch that takes the model back to bf16 if training diverges.

The choice needs the real shapes, so it is made at a root's first call, before its trial: one forward of that batch
in bf16 without gradients (automp.precision.fp8.choice.probe) gives each layer's GEMM shape and FP8 error, the
device's timing table (automp.precision.fp8.table, measured once per device and cached) predicts each layer's gain,
and the chosen layers are made FP8-capable. They run FP8 only on the FP8 paths, which the trial then times against
their bf16 twins (automp.runtime.decisions.BF16_TWIN): a prediction that does not hold on the whole step loses there.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from automp.config import AutoMPConfig
from automp.precision import fp8
from automp.precision.fp8.guard import Divergence, LossWatch
from automp.runtime.report import Recorder, notices_from_warnings
from automp.runtime.ranks import from_rank0
from automp.runtime.decisions import BF16_TWIN, FP8_LEFT, FP8_OFF, FP8_PATHS, FP8_SKIPPED, Verdict



class Fp8Unavailable(RuntimeError):
    """dtype="fp8" on a machine that cannot run FP8 GEMMs (`automp run` prints it in one line, exit code 2)."""


class Fp8Layers:
    """check: why FP8 cannot run on a device, or None (automp.precision.fp8.layers.unavailable); table: the timing table's
    loader; both injectable, so a CPU test runs the whole decision with an emulated device and a made-up table."""

    def __init__(self, config: AutoMPConfig, recorder: Recorder, *,
                 check: Callable[[torch.device], str | None] = fp8.layers.unavailable,
                 table: fp8.TableLoader = fp8.table.load_or_measure) -> None:
        self.config, self.recorder, self.check, self.table = config, recorder, check, table
        self.conversions: list[fp8.Conversion] = []
        self.gathers: dict[str, fp8.gather.Fp8Gather] = {}  # per root label, under FSDP2
        self._gathering: set[str] = set()  # the roots `gather` has been called for
        self.watch: LossWatch | None = None
        self._unwatch: Callable[[], None] | None = None
        self.diverged: Divergence | None = None  # set by the watch; the session moves the model at its next call

    def require(self) -> None:
        """At install: a run that asks for FP8 on a machine whose GPU has none fails now, in one line, rather than
        training in bf16 while the user believes it is FP8."""
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        why = self.check(device)
        if why is not None:
            raise Fp8Unavailable(f"dtype fp8 is not available: {why}. Use --dtype bf16 (or auto).")

    def prepare(self, module: nn.Module, label: str, device: torch.device, run: Callable[[], Any],
                shared: bool = False) -> tuple[tuple[str, ...], float | None]:
        """Choose and install the FP8 layers of a new root; `run()` calls it once on the script's first batch, as
        written. Returns the chosen layers' names (empty: the root runs bf16, and the report says why) and the
        milliseconds per step they are predicted to save (fp8.Conversion.saving_ms; the trial's twin forecast).

        shared: a root every rank calls in lockstep (DDP, FSDP): every rank installs rank 0's choice. Each rank
        measures its own batch and (without a cached table) its own GEMM times; ranks that chose apart would run
        different graphs around the same collectives, and their verdict keys would differ."""
        why = self.check(device)
        if why is not None:
            self.recorder.add_fallback(label, f"FP8 not used: {why}; runs bf16", FP8_OFF)
            return (), None
        config = self.config
        with notices_from_warnings():  # the FP8 timing table's doubts and cache trouble: one line each
            conversion = fp8.convert(module, run, device=device, recipe=config.fp8_recipe,
                                     low=config.low_dtype(device), cache_dir=config.cache_dir, table_loader=self.table,
                                     keep=config.fp8_keep, output_fp8=config.fp8_output,
                                     all_gather=config.fp8_all_gather, agree=from_rank0 if shared else None,
                                     siblings=config.fuse_siblings)
        if conversion.table_error is not None:
            self.recorder.add_fallback(label, f"FP8 GEMM times could not be measured ({conversion.table_error}): "
                                              "runs bf16", FP8_OFF)
        self.conversions.append(conversion)
        if conversion.all_gather is not None:
            self.gathers[label] = conversion.all_gather
        self.recorder.fp8[label] = conversion.as_dict()
        return conversion.chosen, conversion.saving_ms

    def gather(self, label: str, on: bool) -> None:
        """At each call of a root, on every rank alike: FSDP2 all-gathers the root's FP8 layers' weights in FP8 while
        the root runs its settled FP8 path (automp.precision.fp8.gather), and in bf16 while it is timed against its
        bf16 twin or after it left FP8, so that the trial's bf16 step does not run on FP8-rounded weights. A change
        takes effect after the next optimizer step (a backward may be pending now), or at once at the root's first
        call: a run that starts on its cached FP8 verdict compiles its step once, with FP8 weights."""
        gather = self.gathers.get(label)
        if gather is not None:  # at its first call a root has no backward pending: a switch may happen at once
            gather.want(on, now=label not in self._gathering)
            self._gathering.add(label)

    @staticmethod
    def key(chosen: tuple[str, ...], recipe: str) -> str:
        """The verdict cache's extra key: another set of FP8 layers is another trial."""
        return f"fp8:{recipe}:" + hashlib.sha256("|".join(chosen).encode()).hexdigest()[:12]

    def watch_loss(self, lockstep: bool = False) -> None:
        """Once a root runs FP8: watch the loss for the rest of the run (automp.precision.fp8.guard); a root every rank
        calls in lockstep has every rank judge the same losses at the same calls."""
        if self.watch is None:
            self.watch = LossWatch(self._diverged, ranks=lockstep)
            self._unwatch = self.watch.install()

    def _diverged(self, divergence: Divergence) -> None:
        self.diverged = divergence  # acted on between steps: this backward still runs the FP8 graph it recorded
        self.recorder.fp8_fallback = divergence.as_dict()

    def leave(self, roots: Iterable[Any], move: Callable[[Any, Verdict], None]) -> None:
        """After a divergence, at the next module call (between steps): every root on an FP8 path moves to its bf16
        twin for the rest of the run (`move`: RootPaths.move, which also caches it for the next run of the script)."""
        divergence, self.diverged = self.diverged, None
        for root in list(roots):
            if root.path not in FP8_PATHS:
                continue
            verdict = Verdict(BF16_TWIN[root.path], f"left FP8 at backward {divergence.step}: {divergence.rule} "
                                                    f"(loss {divergence.loss:.4g}, recent median {divergence.median});"
                                                    f" bf16 from the next step",
                              dict(root.verdict.timings_ms) if root.verdict else {}, rule=FP8_LEFT)
            move(root, verdict)
            self.recorder.add_fallback(root.label, verdict.reason, FP8_LEFT)

    def uninstall(self) -> None:
        if self.watch is not None:
            self.watch.flush()
            skipped = self.watch.skipped_steps
            if skipped:
                self.recorder.add_fallback("fp8", f"{skipped} optimizer step(s) skipped: their loss was not finite",
                                           FP8_SKIPPED)
            self._unwatch()
            self.watch = self._unwatch = None
        for conversion in self.conversions:
            conversion.undo()
        self.conversions.clear()
        self.gathers.clear()
        self._gathering.clear()
