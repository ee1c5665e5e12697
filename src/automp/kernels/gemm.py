"""fp16/bf16 tensor-core GEMM `c = a @ b` (like torch.mm) in Triton, autotuned per shape.

The kernel is the classic tiled one: each program owns a BLOCK_M x BLOCK_N tile of c, walks K with a software
pipeline (num_stages) and lets Triton pick the tensor-core instruction (wgmma on Hopper, mma elsewhere). Programs are
ordered in GROUP_M super-rows so that consecutive programs share tiles of b in L2.

Two config families: square-ish tiles for compute-bound shapes, and short-and-wide tiles for skinny M (<= 64),
where the product is bound by streaming b and a 128-row tile would waste most of its tensor-core work and SMs.
Configs are pruned by M before tuning so a shape never compiles the family it cannot use. No TMA / persistent
variant: the plain kernel is portable across Triton 3.6-3.9 (the descriptor APIs moved between them).

Arbitrary strides are handled (a transposed operand costs bandwidth, not correctness).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from automp.kernels.gemv import INTERPRET, half_dot, k_range

SKINNY_M = 64
MID_M = 512  # up to here both tile families are tuned (see prune_by_m)
# Above MID_M, the tiles tuned: a 64x128 tile still re-reads each operand few enough times, and at K = 3072 (an
# encoder's second MLP GEMM, M = 8192) the int8 GEMM's 64x128 tile measured fastest of all.
WIDE_TILE = 64 * 128


def graph_bench(kernel_call, quantiles, calls: int = 32, replays: int = 5) -> float | list[float]:
    """The autotuner's timing of one config (its do_bench): `calls` launches captured in one CUDA graph, replayed
    `replays` times; the quantiles of the per-launch milliseconds.

    An encoder's GEMMs take a few microseconds at batch 1, about what a launch costs the host. Triton's default timing
    launches each call on its own, so its figures were mostly launch time and noise, and the int8 GEMM's tuner picked
    configs far slower than the best, while the encoder runs the GEMM inside its own CUDA graph. Short on purpose:
    tuning every shape of a model is part of its quantization set-up, and Triton's own do_bench_cudagraph spends
    ten replays of a fixed span on each config."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        kernel_call()  # compiles outside the capture; a config that does not fit raises here, for the tuner
        graph.capture_begin()
        try:
            for _ in range(calls):
                kernel_call()
        finally:
            graph.capture_end()
        graph.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for start, end in events:
            start.record()
            graph.replay()
            end.record()
    stream.synchronize()
    times = torch.tensor([start.elapsed_time(end) / calls for start, end in events])
    if quantiles is None:
        return times.median().item()
    return [torch.quantile(times, q).item() for q in quantiles]


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, persistent: int | None = None) -> triton.Config:
    """A config from a (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, PERSISTENT]) tuple; only kernels that loop over
    tiles (kernels/int8_gemm.py) take the sixth."""
    kwargs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}
    if persistent is not None:
        kwargs["PERSISTENT"] = persistent
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


def mm_configs(square: list[tuple], skinny: list[tuple], tiny: tuple,
               interpret: bool = INTERPRET) -> list[triton.Config]:
    """All configs for a matmul family; under the interpreter only `tiny` (tuning would run each on the CPU)."""
    if interpret:
        return [_cfg(*tiny)]
    return [_cfg(*c) for c in square + skinny]


def prune_by_m(configs: list[triton.Config], nargs: dict, **_: object) -> list[triton.Config]:
    """Skinny M tunes only tiles with BLOCK_M <= 64, large M only tiles of >= WIDE_TILE, and the band between both.

    The band: at M = 128 (one 128-token sequence) the square tiles leave most SMs idle (N=768 in 128x256 tiles is 3
    programs), and for int8 a 16-row tile measured clearly faster there than the square family (at 128x768x768).

    Persistent configs (PERSISTENT >= 1) are tuned above the band only: a persistent grid differs from the plain one
    only where there are more tiles than programs, which needs many rows of tiles."""
    if len(configs) == 1:
        return configs
    m = nargs["M"]
    if m <= MID_M:
        configs = [c for c in configs if not c.kwargs.get("PERSISTENT", 0)]
    skinny = [c for c in configs if c.kwargs["BLOCK_M"] <= SKINNY_M]
    wide = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] >= WIDE_TILE]
    if m <= SKINNY_M:
        fit = [c for c in skinny if c.kwargs["BLOCK_M"] >= min(m, 16) and c.kwargs["BLOCK_M"] < 2 * max(m, 16)]
        return fit or skinny
    if m <= MID_M:
        return configs
    return wide or configs


_SQUARE = [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 4),
           (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
           (128, 256, 32, 8, 4)]
_SKINNY = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3), (32, 64, 128, 4, 4),
           (32, 128, 128, 4, 4), (32, 64, 256, 4, 3), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
           (64, 32, 128, 4, 4), (64, 128, 128, 4, 3)]


@triton.jit
def tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row, column) of tile number `pid` in tile_ids' order: a persistent program's tiles follow the same order."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped program ordering: GROUP_M row-tiles share each column tile of b while it is hot in L2."""
    return tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def tile_dot(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, INT8: tl.constexpr):
    """a[rm, :] @ b[:, rn]: int32 for int8 operands (INT8), else fp32 for half ones. Rows/columns past the edge wrap
    to valid ones (their results are never stored), so the hot loop loads unmasked but for a partial last K-step."""
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rm % M)[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + (rn % N)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if INT8 else tl.float32)
    for k0 in k_range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0)
            b = tl.load(b_ptrs, mask=rk[:, None] < K - k0, other=0)
        if INT8:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            acc = half_dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.autotune(configs=mm_configs(_SQUARE, _SKINNY, (16, 16, 32, 4, 1)), key=["M", "N", "K"],
                 prune_configs_by={"early_config_prune": prune_by_m})
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 EVEN_K: tl.constexpr):
    pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tile_dot(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K,
                   EVEN_K, False)
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c = a @ b for a [M, K], b [K, N] of one half dtype; c has that dtype, fp32 accumulation."""
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemm_kernel[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                       c.stride(0), c.stride(1))
    return c
