"""Where a new root's path comes from, before it runs: forced by the configuration, the verdict cache of an earlier
run, or a trial over the candidates its device and dtype allow (by default CalibratedCandidates, from the device's
measured GEMM rates). Kept apart from the session, which holds the roots and
runs them: this is the one place that says which candidates a root starts with, and why."""
from __future__ import annotations

from typing import Any, Callable

import torch

from automp.runtime.decisions import (BF16_TWIN, COMPILED_PATHS, DOUBLE_BACKWARD, FORCED, FP8_OFF, FP8_PATHS,
                                      WITHOUT_GRAPHS, Route, Verdict, forced)
from automp.runtime.guards import input_grads
from automp.runtime.ranks import rank0_start
from automp.runtime.report import notices_from_warnings


# A device must run low-precision GEMMs at least this much faster than FP32 (measured) for a trial to be worth it.
MIN_GAIN = 1.2


def candidate_paths(device_type: str, gain: float, dtype: str) -> tuple[list[Route], str]:
    """Which paths can win on a device whose `dtype` GEMMs run `gain` times FP32's rate, and why. A device where low
    precision is not clearly faster gets FP32 at once. On a CPU, Inductor's C++ compile takes longer than a script's
    compiled graphs can save, so only the eager paths are timed. The GEMM rate alone does not decide: a step is more
    than its GEMMs (casts, launches, the rest of the model), so the trial times whole steps and may still keep FP32."""
    rate = gemm_speed(dtype, gain, {"cpu": "CPU", "cuda": "GPU"}.get(device_type, device_type))
    if gain < MIN_GAIN:
        return [Route.FP32], (f"{rate}: low precision does not pay here (it needs GEMMs at least {MIN_GAIN}x as "
                              f"fast), kept FP32")
    if device_type != "cuda":
        return [Route.FP32, Route.EAGER_LOW], (f"{rate}; whole steps timed as written and in low precision eager "
                                             f"(GEMMs are only part of a step); compiled graphs not tried on a CPU "
                                             f"(compile time)")
    return list(GPU_CANDIDATES), rate


# A GPU trial's candidates, in the order they first run (after the graphed path's first warm-up iteration where
# TrialConfig.early_warmup asks for it). The anchor's path first: its iteration's peak memory is the budget of the eager
# candidates after it (automp.runtime.guards.memory_budget). Not automp's own graph pass
# (Route.COMPILED, still there as path="compile"): interleaved with other paths in a trial, its step computed a wrong
# loss on a GPU, tenths above plain autocast eager's from the same weights (forced from the first call, or left out,
# every path tracked the plain loop; tests/runtime/test_trial_parity_gpu.py), and it led the anchor by noise at best
# (BENCHMARKS.md, "Loss parity of the trial").
GPU_CANDIDATES = (Route.COMPILED_AUTOCAST, Route.EAGER_LOW, Route.GRAPHED, Route.FP32)


def gemm_speed(dtype: str, gain: float, where: str) -> str:
    """`gain` (low precision's GEMM rate over FP32's) in words that say which way it goes."""
    if gain <= 0:
        return f"{dtype} GEMMs were not measured on this {where}"
    if gain >= 1:
        return f"{dtype} GEMMs ran {gain:.1f}x as fast as FP32 on this {where}"
    return f"{dtype} GEMMs took {1 / gain:.1f}x as long as FP32 on this {where}"


def forced_verdict(config: Any, root: Any, recorder: Any) -> Verdict | None:
    """The path the configuration forces (config.path), or None; an FP8 path forced where no layer was chosen for FP8
    runs its bf16 twin, reported."""
    route = forced(config)
    if route in FP8_PATHS and not root.fp8_layers:
        route = BF16_TWIN[route]
        recorder.add_fallback(root.label, f"path {config.path!r} forced, but no linear layer was chosen for FP8: runs "
                                          f"{route.value}", FP8_OFF)
    if route is None:
        return None
    return Verdict(route, f"path forced by configuration (path={config.path!r})", {}, rule=FORCED)


def trial_start(config: Any, root: Any, cache: Any, candidates: Callable[..., tuple[list[Route], str]],
                recorder: Any) -> tuple[Verdict | None, list[Route], str]:
    """(the cached verdict, or None; the trial's candidates, empty with a cached verdict; why those). A verdict cached
    after a crash on a compiled path (input_grads) leaves the compiled candidates out instead; FP8 layers make the
    trial the FP8 step against its bf16 twin; without CUDA graphs (config, or a root every rank calls in lockstep)
    each graphed candidate becomes its plain twin; under torch.distributed rank 0's start is every rank's."""
    cached = cache.get(root.key)
    if cached is not None and cached.eager_only:  # an earlier run crashed on a compiled path: a trial without them
        root.eager_only, cached = True, None
        recorder.add_fallback(root.label, input_grads.REASON_CRASHED, DOUBLE_BACKWARD)
    if cached is not None:
        routes, why = [], ""
    elif root.fp8_layers:  # the FP8 step against the same step in bf16, its twin (decisions.BF16_TWIN)
        routes = [Route.GRAPHED, Route.FP8_GRAPHED]
        why = (f"{len(root.fp8_layers)} linear layer(s) predicted faster in FP8 ({config.fp8_recipe}); the whole step "
               f"timed in FP8, and in bf16 unless forecast clearly slower")
    else:
        routes, why = candidates(root.device, root.low)
    if root.eager_only and routes:
        routes = [c for c in routes if c not in COMPILED_PATHS] or [Route.EAGER_LOW]
    # under DDP, CUDA graphs' memory check and moves would be a rank's own: every rank must run rank 0's path
    if root.lockstep or not config.cuda_graphs:
        routes = list(dict.fromkeys(WITHOUT_GRAPHS.get(c, c) for c in routes))
    if root.lockstep:
        cached, routes, why = rank0_start(cached, routes, why)
    return cached, routes, why


Candidates = Callable[[torch.device, torch.dtype], "tuple[list[Route], str]"]  # (device, low dtype) -> (paths, why)


class CalibratedCandidates:
    """The default candidates: which paths can win on a device (candidate_paths), from its GEMM rates,
    measured once per device and cached on disk under `cache_dir` (automp.precision.calibrate)."""

    def __init__(self, cache_dir: str) -> None:
        self.cache_dir, self.calibrations = cache_dir, {}

    def __call__(self, device: torch.device, low: torch.dtype) -> tuple[list[Route], str]:
        from automp.precision import calibrate
        try:
            if device not in self.calibrations:  # once per session and device, not per module
                with notices_from_warnings():
                    self.calibrations[device] = calibrate.load_or_measure(device, self.cache_dir)
            gain = calibrate.low_precision_gain(self.calibrations[device], low)
        except (RuntimeError, ValueError) as e:
            return [Route.FP32], f"could not measure this device ({e}): kept FP32"
        paths, why = candidate_paths(device.type, gain, str(low).replace("torch.", ""))
        doubts = self.calibrations[device].doubts
        if doubts:  # the report says what a warning said: this run decided on figures not trusted beyond it
            why += f" (device calibration used for this run only, not cached: {'; '.join(doubts)})"
        return paths, why

    def fp32_tflops(self, device: torch.device) -> float | None:
        """The fastest FP32 GEMM rate this device's calibration measured (TFLOP/s, its best size): the rate that bounds
        FP32 eager's step from below (automp.runtime.fp32_bound). None, so no bound: off CUDA (the bound is for a GPU
        trial's peak memory; a CPU's trial times the two eager paths only), before calibration, and where the
        calibration is doubted (a disturbed measurement reads slow, and a rate read slow would put the bound too
        high)."""
        cal = self.calibrations.get(device)
        rates = cal.gemm_tflops.get("float32") if cal is not None and not cal.doubts else None
        return max(rates.values()) if device.type == "cuda" and rates else None
