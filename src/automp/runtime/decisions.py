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
# activations, the largest of any path and the path most often dropped in that round. On an H100 ResNet-50's trial
# reserved 18.2 GiB that way, against 6.7 GiB in steady state; recorded last, its whole-run peak (11.3 GiB) is below
# the FP32 script's 12.5 (BENCHMARKS.md, "Large models").
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


@dataclass
class Verdict:
    path: Route  # or another enum for trials of something else than a path (automp.runtime.tuning.conv_tuning.Flag)
    reason: str
    timings_ms: dict[str, float]
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

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path.value, "reason": self.reason, "timings_ms": self.timings_ms, "cached": self.cached,
                "confirmed": self.confirmed, **({"bounds": self.bounds} if self.bounds else {})}




# The route each value of AutoMPConfig.path forces; None: "auto", a trial decides.
FORCED = {"auto": None, "compile": Route.COMPILED, "eager": Route.EAGER_LOW, "fp32": Route.FP32,
          "autocast-compile": Route.COMPILED_AUTOCAST, "autocast-graphs": Route.GRAPHED,
          "fp8-compile": Route.FP8_COMPILED, "fp8-graphs": Route.FP8_GRAPHED}


def forced(config: Any) -> Route | None:
    """The route `config` forces, or None where a trial decides."""
    return FORCED[config.path]
