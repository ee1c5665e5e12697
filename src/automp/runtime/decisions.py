"""The runtime's decision vocabulary: the routes a root module can run by, the sets the runtime reasons with, and the
verdict that records which one a root runs and why.

Kept apart from the trial (automp.runtime.trial) that produces most verdicts: the session, the caches, the watchers that
move a root to another route and the reports all speak this vocabulary, and none of them needs the trial's state
machine to do so.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Route(enum.Enum):
    """How a root module runs. The values are what reports and the verdict cache store."""

    FP32 = "fp32-eager"  # the user's code as written
    EAGER_LOW = "low-precision-eager"  # torch.autocast with automp's dtype: cuDNN/cuBLAS low-precision kernels
    COMPILED = "automp-compiled"  # automp's precision pass on the forward+backward graphs, then Inductor
    COMPILED_AUTOCAST = "autocast-compiled"  # stock Inductor under torch.autocast: the hand-written anchor's path
    GRAPHED = "autocast-graphed"  # the same graphs replayed as CUDA graphs (automp.runtime.compiled_paths.stock)
    FP8_COMPILED = "fp8-compiled"  # autocast-compiled with the chosen linear layers in FP8 (automp.precision.fp8)
    FP8_GRAPHED = "fp8-graphed"  # the same replayed as CUDA graphs


# Candidates a trial warms up only after its first round has dropped the clear losers. CUDA graphs record a memory
# pool that stays for the rest of the trial; recorded before that round, the pool sits beside FP32 eager's
# activations, the largest of any path and the path most often dropped in that round, and the trial's peak memory
# then exceeds both the steady state's and the FP32 script's. Recorded last, it stays below the FP32 script's
# (BENCHMARKS.md, "Measured on older code (one GPU)").
RECORD_LAST = frozenset({Route.GRAPHED, Route.FP8_GRAPHED})
EAGER_PATHS = (Route.FP32, Route.EAGER_LOW)  # no compilation: torch runs the module's calls as they come
GRAPHED_PATHS = frozenset({Route.GRAPHED, Route.FP8_GRAPHED})  # replayed as CUDA graphs
FP8_PATHS = frozenset({Route.FP8_COMPILED, Route.FP8_GRAPHED})
COMPILED_PATHS = frozenset({Route.COMPILED, Route.COMPILED_AUTOCAST, Route.GRAPHED}) | FP8_PATHS
AUTOCAST_PATHS = frozenset({Route.COMPILED_AUTOCAST, Route.GRAPHED}) | FP8_PATHS  # compiled, under torch.autocast
# each FP8 path's bf16 twin: the same compiled step without FP8 layers. FP8 changes numerics, so it must beat its twin
# by more than the noise (TrialConfig.anchor_margin); the twin is also where a diverging FP8 run goes back to.
BF16_TWIN = {Route.FP8_COMPILED: Route.COMPILED_AUTOCAST, Route.FP8_GRAPHED: Route.GRAPHED}
WITHOUT_GRAPHS = {Route.GRAPHED: Route.COMPILED_AUTOCAST, Route.FP8_GRAPHED: Route.FP8_COMPILED}


# Why a verdict's path was chosen (Verdict.rule): what reports, the verdict cache and tests key on; the reason beside
# it is for people. Each is set where its verdicts are built.
MEASURED = "measured-fastest"  # a trial's fastest path, ahead of the others by more than the margins (trial.Trial)
ONLY_LEFT = "only-candidate-left"  # every other candidate was taken out of the trial before it was timed
ANCHOR_KEPT = "anchor-kept"  # automp-compiled or autocast-graphed led autocast-compiled by noise only: the anchor kept
AS_WRITTEN = "as-written-kept"  # the winner led the script as written (FP32 eager, a setting's own value) by noise only
TWIN_KEPT = "bf16-twin-kept"  # an FP8 path led its bf16 twin by noise only: the step stays bf16
TWIN_FORECAST = "bf16-twin-forecast-slower"  # an FP8 path kept: its bf16 twin forecast slower, never run (trial)
CONFIRMED = "confirmed"  # re-measured in steady state (trial.confirmation): the verdict's path stood
REMEASURED = "remeasured-faster"  # re-measured in steady state: an eager path beat the verdict's path
ONLY_CANDIDATE = "only-candidate"  # the device offers one path (low precision does not pay there, or no calibration)
FORCED = "forced"  # AutoMPConfig.path forced it: nothing was timed
INPUT_GRADS = "input-grads-eager"  # forced onto a compiled path, but the script takes its input's gradient
DOUBLE_BACKWARD = "double-backward-eager"  # an earlier run crashed differentiating a compiled backward: eager only
RECOMPILES = "left-on-recompiles"  # its compiled path recompiled more than it saved (guards.recompile_watch)
GRAPHS_OFF = "left-cuda-graphs"  # off CUDA graphs after its verdict: new input shapes, or a second module
FP8_LEFT = "left-fp8-diverged"  # the loss diverged on FP8: its bf16 twin from then on (fp8_layers)
RANK0 = "rank0-verdict"  # rank 0's verdict, which every rank of a lockstep module runs (ranks.agreed)
ENDED = "ended-early"  # a setting decided without (the rest of) its trial (tuning.conv_tuning)
SCRIPTS_SETTING = "script-setting"  # a setting left as the script set it (tuning.conv_tuning.left_alone)
SHAPES_CHURN = "too-many-shapes"  # cuDNN's benchmark mode back off: too many input shapes (tuning.conv_tuning)
CACHED_LEGACY = "cached-legacy"  # a cached verdict written before verdicts carried a rule
UNSETTLED = "trial-unfinished"  # a report's choice only: the script ended before the trial did
# Why a module runs as written (a report's choice whose path is "as-written")
SCRIPTS_AUTOCAST = "script-autocast"  # the script runs it under its own torch.autocast (and maybe a GradScaler)
HALF_MODEL = "half-model"  # its parameters are already half precision
COMPILE_FAILED = "compile-failed"  # automp's compilation failed before any of the script's code ran
# Why a report's fallback entry (Recorder.add_fallback) is there, where the runtime records one
NO_ROOTS = "no-roots"  # no module with parameters was called as model(x)
SCALING_PAUSED = "scaling-paused"  # loss scaling off: every module runs FP32
FUNCTORCH = "functorch-transform"  # calls inside torch.func transforms: torch.compile cannot trace them from eager code
IN_TRANSFORM = ("is called inside a torch.func transform (grad, vmap, ...), which torch.compile cannot trace from "
                "eager code: on a compiled path its calls would run eagerly")  # the reason of FUNCTORCH's trial exit
GRAPH_BREAK = "graph-break"  # Dynamo broke a graph (guards.graph_breaks)
RNN_FUSED = "rnn-fused"  # the break automp makes at an RNN, by design (guards.rnn)
FP8_OFF = "fp8-off"  # FP8 not used for a module (no FP8 on its device, no GEMM times, none chosen)
FP8_SKIPPED = "fp8-skipped-steps"  # optimizer steps the FP8 loss watch skipped
TRIAL_OOM = "trial-out-of-memory"  # a candidate ran out of device memory in the trial and left it (paths.out_of_memory)
TRIAL_OVER_MEMORY = "trial-over-memory"  # an eager candidate held more than the anchor's peak: it left the trial
GRAPHS_DEVICE_BOUND = "graphs-device-bound"  # the host issued the compiled steps well ahead: no CUDA graphs recorded


@dataclass
class Verdict:
    path: Route  # or another enum for trials of something else than a path (automp.runtime.tuning.conv_tuning.Flag)
    reason: str
    timings_ms: dict[str, float]
    rule: str = field(kw_only=True)  # why this path (MEASURED, FORCED, ...): what reports and tests key on
    cached: bool = False
    # output fields detached when it ran (automp.runtime.guards.unread_outputs): cached, not reported
    detach: tuple[str, ...] = ()
    confirmed: bool = False  # re-measured in steady state (confirmation below)
    # a run crashed in a double backward on a compiled path (automp.runtime.guards.input_grads): a new trial of the eager
    # paths, not a verdict; cached, not reported
    eager_only: bool = False
    # what a lower bound said of a path before it ran, by the path's value: {"rule", and its figures}
    # (automp.runtime.fp32_bound); reported
    bounds: dict[str, dict[str, Any]] = field(default_factory=dict)
    # on CUDA, by path value: the device's peak allocated GiB that path rose to during the trial, where it raised it
    # (Trial.peaks); reported, so a trial whose peak is above the script's own names the candidate that set it
    peaks_gib: dict[str, float] = field(default_factory=dict)
    # by path value, per timed sample in order: the share of it the host took to issue it (Trial.launch_bound judges
    # by the largest); reported, so a rule that did not fire shows which samples kept it from firing
    host_shares: dict[str, list[float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path.value, "rule": self.rule, "reason": self.reason, "timings_ms": self.timings_ms,
                "cached": self.cached, "confirmed": self.confirmed, **({"bounds": self.bounds} if self.bounds else {}),
                **({"peaks_gib": self.peaks_gib} if self.peaks_gib else {}),
                **({"host_shares": self.host_shares} if self.host_shares else {})}


# The route each value of AutoMPConfig.path forces; None: "auto", a trial decides.
FORCED_ROUTES = {"auto": None, "compile": Route.COMPILED, "eager": Route.EAGER_LOW, "fp32": Route.FP32,
                 "autocast-compile": Route.COMPILED_AUTOCAST, "autocast-graphs": Route.GRAPHED,
                 "fp8-compile": Route.FP8_COMPILED, "fp8-graphs": Route.FP8_GRAPHED}


def forced(config: Any) -> Route | None:
    """The route `config` forces, or None where a trial decides."""
    return FORCED_ROUTES[config.path]
