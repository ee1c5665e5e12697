"""cuDNN's benchmark mode, switched on only where it measured faster.

Without `torch.backends.cudnn.benchmark`, cuDNN picks each convolution's algorithm from heuristics; with it, cuDNN
times the algorithms at a shape's first call and keeps the fastest. On an H100 (scripts/cudnn_benchmark.py,
BENCHMARKS.md) the flag made ResNet-50 under autocast + torch.compile 7.7% faster and ConvNeXt-T 3%, left a DCGAN and
the eager loops unchanged, and made EfficientNet-B0 10% slower: it times each algorithm alone, not among the kernels
around it. So it is a measured choice, like the path: once every root module has its path, a script whose roots
hold convolutions on a CUDA device runs a short trial of the flag off and on (choose.Trial's timing: whole
iterations, alternating rounds), and keeps it on only when that leads by more than the anchor margin. The flag is
process-wide and read when a convolution runs, forward and backward, so the timed iteration sees it throughout. The
outcome is cached with the verdicts, so a second run of the script starts on it.

Left alone: a script that turned the flag on itself, one that asked for deterministic algorithms (benchmark picks
by timing, which is not reproducible), and one that disabled cuDNN. With the flag on, every new input shape is
benchmarked at its first call; a script whose shapes keep changing (a detector's image sizes, NLP's dynamic
padding) would pay that again and again, so after MAX_SHAPES distinct input shapes the flag goes back off, and the
report says why.
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import replace
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from automp.choose import Trial, TrialConfig, Verdict, VerdictCache

SETTING = "torch.backends.cudnn.benchmark"
MAX_SHAPES = 8  # distinct input shapes of the convolutional roots with the flag on, before it goes back off


class Flag(enum.Enum):
    OFF = "cudnn-heuristics"
    ON = "cudnn-benchmark"


class FlagTrial(Trial):
    """A Trial of the two flag values. The flag is kept off (cuDNN's default, the script as written) unless on leads
    by more than the anchor margin: the same noise margin a path must clear."""

    def _decide(self) -> None:
        timings, winner, parts = self._measured()
        off = timings.get(Flag.OFF.value)
        margin = self.config.anchor_margin
        if winner is Flag.ON and off is not None and off <= (1 + margin) * timings[Flag.ON.value]:
            winner = Flag.OFF
            parts += f"; within {100 * margin:g}% (this measurement's noise), so cuDNN's heuristics are kept"
        self.verdict = Verdict(winner, f"measured per iteration: {parts}", timings)


def left_alone() -> str | None:
    """Why the script's own cuDNN settings rule out the trial, or None."""
    if not torch.backends.cudnn.enabled:
        return "the script disabled cuDNN"
    if torch.backends.cudnn.benchmark:
        return "the script turned it on itself"
    if torch.backends.cudnn.deterministic or torch.are_deterministic_algorithms_enabled():
        return "the script asked for deterministic algorithms"
    return None


def has_convolutions(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())


def tunable(device: torch.device) -> bool:
    """cuDNN runs the convolutions of this device's modules (tests stand a CPU in for it)."""
    return device.type == "cuda" and torch.cuda.is_available()


class ConvTuning:
    """The session's one cuDNN benchmark decision. `call` is told of every root-module call once every root has its
    path; the flag the script set is restored by `restore`."""

    def __init__(self, config: TrialConfig, clock: Callable[[], float], cache: VerdictCache,
                 report: Callable[[dict[str, Any]], None], sync: Callable[[], None] | None = None):
        self.config, self.clock, self.cache, self.report = config, clock, cache, report
        self.sync = sync or torch.cuda.synchronize
        # the script's flag when automp first touched it: `automp run` enables automp before the script's first line,
        # where a script may set the flag itself
        self.user = torch.backends.cudnn.benchmark
        self.trial: FlagTrial | None = None
        self.key = ""
        self.done = not tunable(torch.device("cuda"))  # no GPU: nothing to decide, and no cost at any call
        self.on = False  # the flag is on by automp's choice: input shapes are watched
        self.shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._convs: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    @property
    def idle(self) -> bool:
        """Decided, and off: nothing left to do at a call."""
        return self.done and not self.on

    def pending(self, roots: Iterable[tuple[nn.Module, torch.device]]) -> bool:
        """Whether a trial runs or will start at the next call (a root with convolutions on a CUDA device)."""
        if self.trial is not None:
            return True
        return not self.done and left_alone() is None and any(self._has_convs(m, d) for m, d in roots)

    def _has_convs(self, module: nn.Module, device: torch.device) -> bool:
        convs = self._convs.get(module)
        if convs is None:
            convs = self._convs[module] = tunable(device) and has_convolutions(module)
        return convs

    def call(self, module: nn.Module, device: torch.device, key: str, args: tuple, kwargs: dict,
             paths_settled: Callable[[], bool] = lambda: True) -> None:
        """A call of root `module`, which has its path: start the trial once every root has one (`paths_settled`),
        advance or end it; watch the input shapes while the flag is on."""
        if self.trial is not None:
            self.trial.tick(id(module), torch.is_grad_enabled())
            if self.trial.verdict is not None:
                self._apply(self.trial.verdict, cached=False)
            else:
                torch.backends.cudnn.benchmark = self.trial.current is Flag.ON
            return
        if not self._has_convs(module, device):
            return
        if self.on:
            self._watch(args, kwargs)
            return
        if self.done or not paths_settled():
            return
        why = left_alone()
        if why is not None:
            self.done = True
            self.report({"setting": SETTING, "value": torch.backends.cudnn.benchmark,
                         "reason": f"left as the script set it: {why}"})
            return
        self.user = torch.backends.cudnn.benchmark
        self.key = f"{key}:cudnn"
        cached = self.cache.get(self.key, kind=Flag)
        if cached is not None:
            self._apply(cached, cached=True)
            return
        # ON's first iteration benchmarks every shape; longer samples than a path trial's: nothing to compile, and
        # on an H100 two trials of ResNet-50 with two-iteration samples found the flag 7% ahead, then 6% behind
        config = replace(self.config, measure=max(self.config.measure, 6), block=max(self.config.block, 4))
        self.trial = FlagTrial([Flag.ON, Flag.OFF], config, self.clock, self.sync, warmup={Flag.ON: 2, Flag.OFF: 1})
        self.trial.tick(id(module), torch.is_grad_enabled())
        torch.backends.cudnn.benchmark = self.trial.current is Flag.ON

    def _apply(self, verdict: Verdict, cached: bool) -> None:
        if not cached:
            self.cache.put({self.key: verdict})
        self.trial, self.done, self.on = None, True, verdict.path is Flag.ON
        torch.backends.cudnn.benchmark = self.on
        self.report({"setting": SETTING, "value": self.on, "timings_ms": verdict.timings_ms, "cached": cached,
                     "reason": ("on: cuDNN times its algorithms per shape" if self.on else
                                "off: cuDNN's heuristics, as the script had it") + f"; {verdict.reason}"})

    def _watch(self, args: tuple, kwargs: dict) -> None:
        shapes = tuple(tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        if shapes in self.shapes:
            return
        self.shapes.add(shapes)
        if len(self.shapes) > MAX_SHAPES:
            self.on = False
            torch.backends.cudnn.benchmark = False
            self.report({"setting": SETTING, "value": False,
                         "reason": f"back off: the convolutional modules were called with more than {MAX_SHAPES} "
                                   f"input shapes, and benchmark mode times cuDNN's algorithms again for each new "
                                   f"one"})

    def restore(self) -> None:
        """The script's flag back, unless the script set one itself since automp last did."""
        if self.trial is not None or self.done and torch.backends.cudnn.benchmark == self.on:
            torch.backends.cudnn.benchmark = self.user
