"""Which weight-only kernel serves a 2..16-row product: `quant_gemv_rows` or `quant_gemm`, by measurement.

The rows kernel reads the packed weights once for all rows but multiplies on the CUDA cores; the GEMM pads the rows
to a tensor-core tile. Which wins depends on M, the shape, the bits and the GPU, so the first call of each
(device, N, K, bits, group, M, dtype) outside CUDA graph capture and torch.compile tracing times both (CUDA events,
a few warm-up and timed calls, median) and keeps the faster for the life of the process. A rows kernel that raises
(e.g. fails to compile), or whose result disagrees with the GEMM's on the measured input, loses, with the error kept
in its decision. While capturing or tracing with no decision yet,
the GEMM serves, as it did before the rows kernel existed; nothing is recorded, so the next eager call measures.

`TIMER` is the clock: timer(label, fn) -> milliseconds per call of fn. Tests replace it with a fake; None is the
CUDA-event timer on CUDA tensors and no measurement elsewhere (the CPU's only kernel path is the interpreter).
"""
from __future__ import annotations

from typing import Callable

import torch

from automp.kernels import ops  # noqa: F401 - registers torch.ops.automp.*
from automp.kernels.quant import kernel_group
from automp.kernels.quant_batched import MAX_ROWS
from automp.timing import time_fn

WARMUP, REPS = 3, 5
Timer = Callable[[str, Callable[[], object]], float]
TIMER: Timer | None = None
# label -> the call timed under that label, (a, qw, scales) -> y; a table so a test can make one of them fail
KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "rows": lambda a, qw, scales: torch.ops.automp.quant_gemv_rows(qw, scales, a),
    "gemm": lambda a, qw, scales: torch.ops.automp.quant_gemm(a, qw, scales),
}
_DECISIONS: dict[tuple, dict] = {}


def cuda_event_timer(label: str, fn: Callable[[], object]) -> float:
    """Median milliseconds of `fn` over REPS calls after WARMUP (which also absorb autotuning and compilation)."""
    return time_fn(fn, warmup=WARMUP, iters=REPS)


def decisions() -> dict[tuple, dict]:
    """Every decision so far: (device, N, K, bits, group, M, dtype) -> {"kernel": "rows" | "gemm", "rows_ms",
    "gemm_ms", "error"} (a time is None where that kernel was not timed; error is the rows kernel's, or None)."""
    return {key: dict(value) for key, value in _DECISIONS.items()}


def reset() -> None:
    """Forget every decision (the next call of each shape measures again)."""
    _DECISIONS.clear()


def _deferred(a: torch.Tensor) -> bool:
    """Whether timing now is impossible: torch.compile is tracing, or the current CUDA stream is being captured."""
    if torch.compiler.is_compiling():
        return True
    return a.is_cuda and torch.cuda.is_current_stream_capturing()


def shape_key(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> tuple:
    k = a.shape[1]
    group = None if scales.shape[1] == 1 else kernel_group(k, scales.shape[1])
    bits = 4 if qw.dtype == torch.uint8 else 8
    return str(a.device), qw.shape[0], k, bits, group, a.shape[0], str(a.dtype).removeprefix("torch.")


AGREE = 1e-2  # ‖rows − gemm‖ / ‖gemm‖ above this: the rows kernel computed something else, and is not used


def _measure(timer: Timer, a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> dict:
    """Both kernels timed, and their results compared once on the real input: the rows kernel must agree with the
    GEMM (both accumulate in fp32 from the same dequantized weights) before it may serve."""
    try:
        rows_ms = timer("rows", lambda: KERNELS["rows"](a, qw, scales))
        got, ref = KERNELS["rows"](a, qw, scales).float(), KERNELS["gemm"](a, qw, scales).float()
        error = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
        if not error <= AGREE:  # nan included
            raise ArithmeticError(f"its result differs from quant_gemm's by {error:.3g} (relative), above {AGREE}")
    except Exception as exc:  # noqa: BLE001 - any failure of the new kernel leaves the GEMM in charge
        return {"kernel": "gemm", "rows_ms": None, "gemm_ms": None, "error": f"{type(exc).__name__}: {exc}"}
    gemm_ms = timer("gemm", lambda: KERNELS["gemm"](a, qw, scales))
    return {"kernel": "rows" if rows_ms < gemm_ms else "gemm", "rows_ms": rows_ms, "gemm_ms": gemm_ms,
            "error": None}


def rows_kernel_wins(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether `quant_gemv_rows` should compute a [M, K] @ dequant(qw, scales)^T (2 <= M <= 16), measuring the
    shape the first time it is met where measuring is possible (module docstring)."""
    if not 2 <= a.shape[0] <= MAX_ROWS:
        return False
    key = shape_key(a, qw, scales)
    decision = _DECISIONS.get(key)
    if decision is None:
        timer = TIMER if TIMER is not None else (cuda_event_timer if a.is_cuda else None)
        if timer is None or _deferred(a):
            return False
        decision = _DECISIONS[key] = _measure(timer, a, qw, scales)
    return decision["kernel"] == "rows"
