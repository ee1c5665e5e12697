"""cuDNN's benchmark mode, switched on only where it measured faster.

Without `torch.backends.cudnn.benchmark`, cuDNN picks each convolution's algorithm from heuristics; with it, cuDNN
times the algorithms at a shape's first call and keeps the fastest. The flag makes some compiled convolutional
networks faster, leaves others and the eager loops unchanged, and makes some slower (BENCHMARKS.md, "cuDNN benchmark
mode"): it times each algorithm alone, not among the kernels around it. So it is a measured choice, like the path:
once every root module has its path, a script whose roots hold convolutions on a CUDA device runs a short trial of
the flag off and on (runtime.trial.Trial's timing: whole iterations, alternating rounds), and keeps it on only when
that leads by more than the anchor margin. The flag is process-wide and read when a convolution runs, forward and
backward, so the timed iteration sees it throughout. The outcome is cached with the verdicts, so a second run of the
script starts on it.

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

from automp.runtime.decisions import AS_WRITTEN, ENDED, MEASURED, SCRIPTS_SETTING, SHAPES_CHURN, Verdict
from automp.runtime.trial import Trial, TrialConfig
from automp.runtime.verdicts import VerdictCache

SETTING = "torch.backends.cudnn.benchmark"
MAX_SHAPES = 8  # distinct input shapes of the convolutional roots with the flag on, before it goes back off


class Flag(enum.Enum):
    OFF = "cudnn-heuristics"
    ON = "cudnn-benchmark"


class SettingTrial(Trial):
    """A Trial of a setting's two values. The script's value (`default`, the first member of the setting's enum)
    is kept unless the other leads by more than the anchor margin: the same noise margin a path must clear."""

    def _decide(self) -> None:
        timings, winner, parts = self._measured()
        default = next(iter(type(winner)))
        ours = timings.get(default.value)
        margin = self.config.anchor_margin
        rule = MEASURED
        if winner is not default and ours is not None and ours <= (1 + margin) * timings[winner.value]:
            winner, rule = default, AS_WRITTEN
            parts += f"; within {100 * margin:g}% (this measurement's noise), so {default.value} is kept"
        self.verdict = Verdict(winner, f"measured per iteration: {parts}", timings, rule=rule)


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


class SettingTuning:
    """One process-wide setting of the convolutional roots, decided by a trial once every root has its path.
    `call` is told of every root-module call from then on; `restore` gives the script its own value back.
    Subclasses name the setting, its enum (the script's value first), and how a value is put in force."""

    SETTING = ""
    KIND: type[enum.Enum] = Flag
    SUFFIX = ""
    WARMUP: dict[Any, int] = {}

    def __init__(self, config: TrialConfig, clock: Callable[[], float], cache: VerdictCache,
                 report: Callable[[dict[str, Any]], None], sync: Callable[[], None] | None = None):
        self.config, self.clock, self.cache, self.report = config, clock, cache, report
        self.sync = sync or torch.cuda.synchronize
        self.trial: SettingTrial | None = None
        self.key = ""
        self.done = not tunable(torch.device("cuda"))  # no GPU: nothing to decide, and no cost at any call
        self._convs: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

    # what a subclass decides
    def applies(self, module: nn.Module, device: torch.device, eager: bool) -> bool:
        return self._has_convs(module, device)

    def left_alone(self) -> str | None:
        """Why the script's own settings rule out the trial, or None."""
        return None

    def put(self, value: enum.Enum) -> None:
        """Put `value` in force."""

    def describe(self, value: enum.Enum) -> str:
        return value.value

    def value_of(self, value: enum.Enum) -> Any:
        """What the report's "value" says."""
        return value.value

    def watch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A call after the decision (only while `watching`)."""

    @property
    def watching(self) -> bool:
        return False

    # the trial
    @property
    def idle(self) -> bool:
        """Decided, and nothing left to do at a call."""
        return self.done and not self.watching

    def pending(self, roots: Iterable[tuple[nn.Module, torch.device, bool]]) -> bool:
        """Whether a trial runs or will start at the next call of one of `roots` (module, device, eager path)."""
        if self.trial is not None:
            return True
        return not self.done and self.left_alone() is None and any(self.applies(*r) for r in roots)

    def _has_convs(self, module: nn.Module, device: torch.device) -> bool:
        convs = self._convs.get(module)
        if convs is None:
            convs = self._convs[module] = tunable(device) and has_convolutions(module)
        return convs

    def call(self, module: nn.Module, device: torch.device, key: str, args: tuple, kwargs: dict,
             paths_settled: Callable[[], bool] = lambda: True, eager: bool = True) -> None:
        """A call of root `module`, which has its path (`eager`: one of the eager paths): start the trial once every
        root has one (`paths_settled`), advance or end it."""
        if self.trial is not None:
            self.trial.tick(id(module), torch.is_grad_enabled())
            if self.trial.verdict is not None:
                self._apply(self.trial.verdict, cached=False)
            else:
                self.put(self.trial.current)
            return
        if not self.applies(module, device, eager):
            return
        if self.done:
            if self.watching:
                self.watch(module, args, kwargs)
            return
        if not paths_settled():
            return
        why = self.left_alone()
        if why is not None:
            self.done = True
            self.report({"setting": self.SETTING, "value": self.scripts_value(), "rule": SCRIPTS_SETTING,
                         "reason": f"left as the script set it: {why}"})
            return
        self.begin()
        self.key = f"{key}:{self.SUFFIX}"
        cached = self.cache.get(self.key, kind=self.KIND)
        if cached is not None:
            self._apply(cached, cached=True)
            return
        # the other value's first iteration does the setting's one-off work; longer samples than a path trial's:
        # nothing to compile, and with two-iteration samples two trials of the same network's flag could find it
        # ahead, then behind
        config = replace(self.config, measure=max(self.config.measure, 6), block=max(self.config.block, 4))
        values = list(self.KIND)
        self.trial = SettingTrial(values[::-1], config, self.clock, self.sync, warmup=self.WARMUP)
        self.trial.tick(id(module), torch.is_grad_enabled())
        self.put(self.trial.current)

    def begin(self) -> None:
        """The trial (or the cached outcome) is about to take over."""

    def scripts_value(self) -> Any:
        return None

    def end(self, value: enum.Enum, reason: str, rule: str = ENDED) -> None:
        """Decided without (the rest of) a trial: cached, reported, put in force."""
        self._apply(Verdict(value, reason, {}, rule=rule), cached=False)

    def _apply(self, verdict: Verdict, cached: bool) -> None:
        if not cached:
            self.cache.put({self.key: verdict})
        self.trial, self.done = None, True
        self.put(verdict.path)
        self.report({"setting": self.SETTING, "value": self.value_of(verdict.path), "timings_ms": verdict.timings_ms,
                     "cached": cached, "rule": verdict.rule,
                     "reason": f"{self.describe(verdict.path)}; {verdict.reason}"})


class ConvTuning(SettingTuning):
    """cuDNN's benchmark flag (see the module's docstring)."""

    SETTING, KIND, SUFFIX = "torch.backends.cudnn.benchmark", Flag, "cudnn"
    WARMUP = {Flag.ON: 2, Flag.OFF: 1}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # the script's flag when automp first touched it: `automp run` enables automp before the script's first line,
        # where a script may set the flag itself
        self.user = torch.backends.cudnn.benchmark
        self.on = False  # the flag is on by automp's choice: input shapes are watched
        self.shapes: set[tuple[tuple[int, ...], ...]] = set()

    def left_alone(self) -> str | None:
        return left_alone()

    def scripts_value(self) -> Any:
        return torch.backends.cudnn.benchmark

    def begin(self) -> None:
        self.user = torch.backends.cudnn.benchmark

    def put(self, value: enum.Enum) -> None:
        self.on = value is Flag.ON
        torch.backends.cudnn.benchmark = self.on

    def value_of(self, value: enum.Enum) -> Any:
        return value is Flag.ON

    def describe(self, value: enum.Enum) -> str:
        return ("on: cuDNN times its algorithms per shape" if value is Flag.ON else
                "off: cuDNN's heuristics, as the script had it")

    @property
    def watching(self) -> bool:
        return self.on

    def watch(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        shapes = tuple(tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        if shapes in self.shapes:
            return
        self.shapes.add(shapes)
        if len(self.shapes) > MAX_SHAPES:
            self.on = False
            torch.backends.cudnn.benchmark = False
            self.report({"setting": SETTING, "value": False, "rule": SHAPES_CHURN,
                         "reason": f"back off: the convolutional modules were called with more than {MAX_SHAPES} "
                                   f"input shapes, and benchmark mode times cuDNN's algorithms again for each new "
                                   f"one"})

    def restore(self) -> None:
        """The script's flag back, unless the script set one itself since automp last did."""
        if self.trial is not None or self.done and torch.backends.cudnn.benchmark == self.on:
            torch.backends.cudnn.benchmark = self.user
