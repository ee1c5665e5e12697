"""Which weight-only kernel serves a 2..64-row product (a decode batch), by measurement.

Three kernels can: `quant_gemv_rows` (up to 16 rows) reads the packed weights once for all rows but multiplies on
the CUDA cores; `quant_planes` decodes each int32 word of codes once onto the tensor cores (fp16 / bf16, whole words,
groups of >= 128 int4 / 64 int8 codes); `quant_gemm` takes any shape, padding the rows to a tensor-core tile. Which
wins depends on M, the shape, the bits and the GPU, so the first call of each (device, N, K, bits, group, M, dtype)
outside CUDA graph capture and torch.compile tracing times every kernel that applies and keeps the fastest for the
life of the process. The clock is a CUDA graph of CALLS calls, replayed REPS times (median per call), as the decode
step runs them: timed one eager call at a time, a short kernel measured mostly its Python launch (many times the
kernel's own time), and the choice followed launch overhead instead of the GPU. A candidate that raises (e.g. fails to
compile), or whose result disagrees with the GEMM's on the measured input, is out, with its error kept in the
decision. While capturing or tracing with no decision yet, the GEMM serves; nothing is recorded, so the next eager
call measures.

`TIMER` is the clock: timer(label, fn) -> milliseconds per call of fn. Tests replace it with a fake; None is the
CUDA-event timer on CUDA tensors and no measurement elsewhere (the CPU's only kernel path is the interpreter).
"""
from __future__ import annotations

from typing import Callable

import torch

from automp.kernels import ops  # noqa: F401 - registers torch.ops.automp.*
from automp.kernels import planes, quant_batched
from automp.kernels.quant import kernel_group
from automp.timing import time_fn

WARMUP, CALLS, REPS = 3, 10, 5
MIN_ROWS, MAX_ROWS = 2, planes.MAX_ROWS
Timer = Callable[[str, Callable[[], object]], float]
TIMER: Timer | None = None
# label -> the call timed under that label, (a, qw, scales) -> y; a table so a test can make one of them fail
KERNELS: dict[str, Callable[..., torch.Tensor]] = {
    "rows": lambda a, qw, scales: torch.ops.automp.quant_gemv_rows(qw, scales, a),
    "planes": lambda a, qw, scales: torch.ops.automp.quant_planes(qw, scales, a),
    "gemm": lambda a, qw, scales: torch.ops.automp.quant_gemm(a, qw, scales),
}
_DECISIONS: dict[tuple, dict] = {}


def cuda_graph_timer(label: str, fn: Callable[[], object]) -> float:
    """Milliseconds per call of `fn` on the GPU: WARMUP eager calls (autotuning and compilation happen there), then a
    CUDA graph of CALLS calls replayed REPS times from a flushed L2, median. Where capture fails, CUDA events
    around eager calls."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                fn()
    except RuntimeError:
        return time_fn(fn, warmup=0, iters=REPS)
    graph.replay()
    return time_fn(graph.replay, warmup=0, iters=REPS, flush_l2=True) / CALLS


def decisions() -> dict[tuple, dict]:
    """Every decision so far: (device, N, K, bits, group, M, dtype) -> {"kernel": the label chosen, "ms": {label:
    milliseconds} of the kernels timed, "errors": {label: why it was out}}."""
    return {key: {"kernel": d["kernel"], "ms": dict(d["ms"]), "errors": dict(d["errors"])}
            for key, d in _DECISIONS.items()}


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


def candidates(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> list[str]:
    """The kernels besides the GEMM that can compute this product."""
    out = ["rows"] if a.shape[0] <= quant_batched.MAX_ROWS else []
    if planes.unsupported(qw, scales, a) is None and not planes.misaligned(qw):
        out.append("planes")
    return out


AGREE = 1e-2  # ‖kernel − gemm‖ / ‖gemm‖ above this: the kernel computed something else, and is not used


def _measure(timer: Timer, a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> dict:
    """Every applicable kernel timed, and its result compared once on the real input with the GEMM's (all accumulate
    in fp32 from the same dequantized weights) before it may serve."""
    ms: dict[str, float] = {}
    errors: dict[str, str] = {}
    ref: torch.Tensor | None = None
    for label in candidates(a, qw, scales):
        try:
            took = timer(label, lambda: KERNELS[label](a, qw, scales))
            if ref is None:
                ref = KERNELS["gemm"](a, qw, scales).float()
            error = float((KERNELS[label](a, qw, scales).float() - ref).norm() / ref.norm().clamp_min(1e-30))
            if not error <= AGREE:  # nan included
                raise ArithmeticError(f"its result differs from quant_gemm's by {error:.3g} (relative), above {AGREE}")
            ms[label] = took
        except Exception as exc:  # noqa: BLE001 - any failure of a candidate leaves the others in charge
            errors[label] = f"{type(exc).__name__}: {exc}"
    if ms:  # the GEMM needs no timing where it is the only choice left
        ms["gemm"] = timer("gemm", lambda: KERNELS["gemm"](a, qw, scales))
    return {"kernel": min(ms, key=ms.get) if ms else "gemm", "ms": ms, "errors": errors}


def choose(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> str:
    """Which kernel ("rows", "planes" or "gemm") should compute a [M, K] @ dequant(qw, scales)^T for MIN_ROWS <= M
    <= MAX_ROWS, measuring the shape the first time it is met where measuring is possible (module docstring); "gemm"
    outside that range."""
    if not MIN_ROWS <= a.shape[0] <= MAX_ROWS:
        return "gemm"
    key = shape_key(a, qw, scales)
    decision = _DECISIONS.get(key)
    if decision is None:
        timer = TIMER if TIMER is not None else (cuda_graph_timer if a.is_cuda else None)
        if timer is None or _deferred(a):
            return "gemm"
        decision = _DECISIONS[key] = _measure(timer, a, qw, scales)
    return decision["kernel"]
