"""One configuration for a session, validated completely before anything is installed.

A bad argument must leave automp exactly as it was: no half-patched nn.Module, no scaler hooked into autograd.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from automp.runtime.trial import Path

DTYPES = ("auto", "fp16", "float16", "half", "bf16", "bfloat16")
INNERS = ("inductor", "eager")
PATHS = {"auto": None, "compile": Path.COMPILED, "eager": Path.EAGER_LOW, "fp32": Path.FP32,
         "autocast-compile": Path.COMPILED_AUTOCAST, "autocast-graphs": Path.GRAPHED}


@dataclass(frozen=True)
class AutoMPConfig:
    """dtype: "auto" (bf16 where supported, else fp16), "fp16" or "bf16".
    loss_scale: "dynamic", "off" (or None/0) or a positive constant; only fp16 uses it.
    report: path of the JSON precision report (made absolute now: the script may chdir).
    inner: "inductor" or "eager" (rewritten graphs run op by op: fast start, for tests and debugging).
    spec: plan casts for another device's costs ("h100", "cpu", ...).
    path: "auto" measures the candidate paths in the first iterations and keeps the fastest; "compile", "eager",
    "autocast-compile", "autocast-graphs" or "fp32" force automp's compiled pass, low-precision eager, stock Inductor
    under autocast, the same replayed as CUDA graphs, or the script as written.
    cache_dir: where calibration and verdicts are cached (default $AUTOMP_CACHE_DIR or ~/.cache/automp).
    fuse_optimizers: switch torch's Adam/AdamW left at their default implementation to fused=True on CUDA
    (same arithmetic, one kernel per step; see automp.runtime.tuning.fused_optimizers).
    tune_cudnn: on CUDA, time cuDNN's benchmark mode against its heuristics once the paths are chosen, and keep
    the faster (automp.runtime.tuning.conv_tuning); a script that set the flag itself is left alone.
    tune_layout: on CUDA, time channels_last activations for the convolutions of modules that run eagerly against
    the script's layout, and keep the faster (automp.runtime.tuning.conv_layout); parameters keep their layout.
    cuda_graphs: on CUDA, let the trial time autocast-compiled's graphs replayed as CUDA graphs (Path.GRAPHED); off
    for a script that needs the memory their pool takes."""

    dtype: str = "auto"
    loss_scale: Any = "dynamic"
    report: str | None = None
    inner: str = "inductor"
    spec: str | None = None
    path: str = "auto"
    cache_dir: str | None = None
    fuse_optimizers: bool = True
    tune_cudnn: bool = True
    tune_layout: bool = True
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}: expected 'auto', 'fp16' or 'bf16'")
        _check_loss_scale(self.loss_scale)
        if self.inner not in INNERS:
            raise ValueError(f"unknown inner compiler {self.inner!r}: expected 'inductor' or 'eager'")
        for flag in ("fuse_optimizers", "tune_cudnn", "tune_layout", "cuda_graphs"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.path not in PATHS:
            raise ValueError(f"unknown path {self.path!r}: expected one of {sorted(PATHS)}")
        if PATHS[self.path] is Path.GRAPHED and not self.cuda_graphs:
            raise ValueError(f"path {self.path!r} asks for the CUDA graphs that cuda_graphs=False turns off")
        if self.spec:
            from automp.precision import cost
            cost.spec_named(self.spec)
        if self.report is not None:
            if not isinstance(self.report, (str, os.PathLike)):
                raise TypeError(f"report must be a file path, got {type(self.report).__name__}")
            object.__setattr__(self, "report", os.path.abspath(os.fspath(self.report)))

    @property
    def forced_path(self) -> Path | None:
        return PATHS[self.path]

    @property
    def wants_fp16(self) -> bool:
        return self.dtype in ("fp16", "float16", "half")


def _check_loss_scale(spec: Any) -> None:
    if spec in ("dynamic", "off", None) or (isinstance(spec, (int, float)) and not isinstance(spec, bool)
                                            and spec == 0):
        return
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"loss_scale must be 'dynamic', 'off' or a positive number, got {spec!r}")
    try:
        value = float(spec)
    except ValueError:
        raise ValueError(f"loss_scale must be 'dynamic', 'off' or a positive number, got {spec!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"loss_scale must be a positive finite number, got {spec!r}")


def default_cache_dir() -> str:
    """Where calibration and verdicts are cached when the configuration names no directory: $AUTOMP_CACHE_DIR, else
    ~/.cache/automp. The one place that reads the variable, so every cache agrees on the directory."""
    return os.environ.get("AUTOMP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "automp")
