"""Is the quantized module faster than the same module in plain fp16/bf16? Measured, not assumed.

Quantized kernels do not always pay: a W8A8 model can run slower than the fp16 model compiled the same way (small
GEMMs, an extra activation-quantization kernel per layer; BENCHMARKS.md, "Deployment and encoders" has the numbers). A
deployment engineer who asked for int8 may still want it (memory), but must not find out from production latency that it
is slower. So on CUDA, with calibration data, the result is timed against the float model built the same way (same dtype
boundary, same compile mode) on the first calibration batch, and the report says which was faster. The precision stays
the caller's choice; a slower result also raises a warning naming both timings.

Timed as a serving loop runs the model, so that the verdict agrees with the user's own timing: each sample is a block
of calls back to back, the device synchronized at the block's ends only (a call-by-call synchronized timing adds a
launch latency to every call, which a small compiled model's call is mostly made of), and the two models take turns
in alternating order (Q F, F Q, ...), so that clock and host drift bias neither. The verdict is the median of the
rounds' ratios, reported with their spread.

On a CPU nothing is timed (the layers run a torch reference there, or the kernels under the Triton interpreter: a
timing would say nothing about a GPU), and the report says so.
"""
from __future__ import annotations

import copy
import warnings
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from automp.quant.ptq import boundary

Timer = Callable[[Callable[[], Any]], float]  # ms per call of the closure
ROUNDS = 6  # even: each model leads as often as it trails
WARMUP, BLOCK = 3, 20  # calls before each sample (compile and CUDA-graph recording settle), calls in it


def default_timer(fn: Callable[[], Any]) -> float:
    """ms per call of `fn` over BLOCK calls back to back, synchronized at the block's ends only, after WARMUP."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(BLOCK):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / BLOCK


def first_call_s(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call of `fn`, the device synchronized after it: a compiled model's first call of a shape
    is its compile (and CUDA-graph recording)."""
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return round(time.perf_counter() - start, 2)


@dataclass(frozen=True)
class SpeedCheck:
    quantized_ms: float | None = None  # medians of the rounds' samples
    float_ms: float | None = None
    float_dtype: str = "float16"
    skipped: str | None = None  # why nothing was timed
    ratios: tuple[float, ...] = ()  # each round's float ms / quantized ms
    first_call_s: tuple[float, float] | None = None  # (quantized, float): compiling and recording, on a compiled model

    @property
    def speedup(self) -> float | None:
        """The median round's float ms / quantized ms (> 1: the quantized module is faster)."""
        return statistics.median(self.ratios) if self.ratios else None

    def to_dict(self) -> dict:
        if self.skipped is not None:
            return {"measured": False, "why": self.skipped}
        return {"measured": True, "quantized_ms": self.quantized_ms, f"{self.float_dtype}_ms": self.float_ms,
                "speedup": self.speedup, "spread": [min(self.ratios), max(self.ratios)], "rounds": len(self.ratios),
                "faster": "quantized" if (self.speedup or 0) >= 1 else self.float_dtype,
                "first_call_s": {"quantized": self.first_call_s[0], self.float_dtype: self.first_call_s[1]}
                if self.first_call_s else None}


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
    calls = {"q": lambda: quantized(*args, **kwargs), "f": lambda: float_model(*args, **kwargs)}
    ms: dict[str, list[float]] = {"q": [], "f": []}
    with torch.no_grad():
        first = {side: first_call_s(calls[side]) for side in ("q", "f")}  # compiles, timed apart from the rounds
        for r in range(ROUNDS):
            for side in ("q", "f") if r % 2 == 0 else ("f", "q"):
                ms[side].append(timer(calls[side]))
    result = SpeedCheck(statistics.median(ms["q"]), statistics.median(ms["f"]), str(dtype).removeprefix("torch."),
                        ratios=tuple(f / q for q, f in zip(ms["q"], ms["f"]) if q > 0),
                        first_call_s=(first["q"], first["f"]))
    if (result.speedup or 1.0) < 1.0:
        warnings.warn(f"automp: the quantized module measured {result.quantized_ms:.3f} ms per call against "
                      f"{result.float_ms:.3f} ms for the same module in {result.float_dtype} on this GPU "
                      f"({result.speedup:.2f}x, rounds {min(result.ratios):.2f}-{max(result.ratios):.2f}x): it saves "
                      f"memory, not time, here", stacklevel=3)
    return result
