"""Is the quantized module faster than the same module in plain fp16/bf16? Measured, not assumed.

Quantized kernels do not always pay: a W8A8 model can run slower than the fp16 model compiled the same way (small
GEMMs, an extra activation-quantization kernel per layer; BENCHMARKS.md, "Deployment and encoders" has the numbers). A
deployment engineer who asked for int8 may still want it (memory), but must not find out from production latency that it
is slower. So on CUDA, with calibration data, the result is timed against the float model built the same way (same dtype
boundary, same compile mode) on the first calibration batch, and the report says which was faster. The precision stays
the caller's choice; a slower result also raises a warning naming both timings.

On a CPU nothing is timed (the layers run a torch reference there, or the kernels under the Triton interpreter: a
timing would say nothing about a GPU), and the report says so.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from automp.deploy.quantized import boundary
from automp.timing import time_fn

Timer = Callable[[Callable[[], Any]], float]  # ms per call of the closure


def default_timer(fn: Callable[[], Any]) -> float:
    return time_fn(fn, warmup=5, iters=30)


@dataclass(frozen=True)
class SpeedCheck:
    quantized_ms: float | None = None
    float_ms: float | None = None
    float_dtype: str = "float16"
    skipped: str | None = None  # why nothing was timed

    @property
    def speedup(self) -> float | None:
        if self.quantized_ms is None or self.float_ms is None or self.quantized_ms <= 0:
            return None
        return self.float_ms / self.quantized_ms

    def to_dict(self) -> dict:
        if self.skipped is not None:
            return {"measured": False, "why": self.skipped}
        return {"measured": True, "quantized_ms": self.quantized_ms, f"{self.float_dtype}_ms": self.float_ms,
                "speedup": self.speedup, "faster": "quantized" if (self.speedup or 0) >= 1 else self.float_dtype}


def skipped_because(device: torch.device, calls: list, enabled: bool) -> str | None:
    """Why the check does not run here, or None when it does."""
    if not enabled:
        return "turned off (TorchQuantConfig.measure=False)"
    if device.type != "cuda":
        return f"not timed on {device.type}: the quantized kernels' speed only means something on a CUDA GPU"
    if not calls:
        return "no calibration data to time on"
    return None


def check(quantized: nn.Module, module: nn.Module, dtype: torch.dtype, io_dtype: torch.dtype, call: boundary.Call,
          build: Callable[[nn.Module], nn.Module], timer: Timer | None = None) -> SpeedCheck:
    """Time `quantized` and the float twin of `module` (`build` compiles it as the quantized one was) on `call`."""
    timer = timer or default_timer
    float_model = build(boundary.QuantizedModel(copy.deepcopy(module).to(dtype).requires_grad_(False), dtype,
                                                io_dtype).eval())
    args, kwargs = call
    with torch.no_grad():
        q_ms = timer(lambda: quantized(*args, **kwargs))
        f_ms = timer(lambda: float_model(*args, **kwargs))
    result = SpeedCheck(q_ms, f_ms, str(dtype).removeprefix("torch."))
    if (result.speedup or 1.0) < 1.0:
        warnings.warn(f"automp: the quantized module measured {q_ms:.3f} ms per call against {f_ms:.3f} ms for the "
                      f"same module in {result.float_dtype} on this GPU ({result.speedup:.2f}x): it saves memory, "
                      f"not time, here", stacklevel=3)
    return result
