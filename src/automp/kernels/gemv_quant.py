"""Weight-only GEMV for decoding (one activation row): W8A16 / W4A16 in the layout of automp.kernels.quant.

A decode step multiplies every weight by one activation, so the GEMV is a pure weight stream and its speed is the
number of weight bytes in flight. N alone often gives too few programs for that (N=2048 in 16-row blocks is one
program per SM, each streaming its rows serially), so K is split across programs as well: each writes an fp32 partial
row and a second tiny kernel sums them in a fixed order (deterministic, unlike atomics, and nothing to zero first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from automp.kernels.gemm import INTERPRET
from automp.kernels.gemv import k_range, num_sms
from automp.kernels.quant import _i8_to_f32, _u4_to_f32, kernel_group

_SUB = tl.constexpr(16)  # bytes of one thread's vector load, reduced in its registers and then scaled once
_MIN_SPAN = 128  # fewest K per split program: the smallest BLOCK_K below, so some config always tiles a span exactly
_SPLIT_ROWS = 32  # rows per program the split chooser counts with (a middle BLOCK_N)
_WAVES = 2  # programs the chooser aims at, in SM counts: every SM busy, with a second program to hide the tail
# No split below this K: measured on an H100 in a CUDA graph (scripts/qgemv_sweep.py, Llama-1B shapes), a GEMV of K=2048
# takes 4-6 us, mostly launch latency, and the split's second launch cost more than its extra programs gave back
# (int4 2048x2048: 4.2 us unsplit, 5.4-5.7 split); at K=5632 six splits won (8.0 us vs 9.8).
_SPLIT_MIN_K = 4096
_SUM_BLOCK = 256
_CPU_SMS = 132  # an H100: CPU runs (the interpreter) split like the GPU they stand in for


def _qgemv_configs() -> list[triton.Config]:
    if INTERPRET:  # BLOCK_K 64: group 32 takes the multi-group path, 64 and per-channel the one-group path
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64}, num_warps=4)]
    # No num_stages: Triton 3.6-3.9 do not software-pipeline this loop (checked in the compiled code; no tl.dot
    # consumes its loads), so the bytes in flight come from the tile size and the programs per SM (split-K).
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
            for bn, bk, w in [(16, 128, 4), (32, 128, 4), (64, 128, 4), (16, 256, 4), (32, 256, 4), (16, 512, 4),
                              (32, 512, 8), (8, 1024, 4), (16, 1024, 8)]]


def _qgemv_prune(configs: list[triton.Config], nargs: dict, **kw: object) -> list[triton.Config]:
    """Tiles that divide a split's K range (else the last tile of every program is partly wasted) and that give every
    thread at least one full 16-byte load (smaller tiles leave threads holding copies)."""
    a = {**nargs, **kw}
    split = a["K_SPAN"] < a["K"]
    fit = [c for c in configs
           if (not split or a["K_SPAN"] % c.kwargs["BLOCK_K"] == 0)
           and c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] * a["BITS"] // 8 >= c.num_warps * 32 * _SUB.value]
    return fit or configs


@triton.jit
def _tile_sums(q_rows, x_ptr, t, K, KP, stride_xk, BITS: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Unscaled sums of code * x over each 16-byte sub-block of K-tile t: [BLOCK_N, bytes per tile row // 16] fp32.

    A sub-block is what one thread loads as one vector, so its sum stays in that thread's registers (no shuffles, no
    layout change). int4 keeps the two nibbles of a byte apart rather than interleaving them along K (a layout
    shuffle per tile): x comes as (even, odd) pairs, and the high nibble is decoded in place as 16 * code against an
    x divided by 16 (exact), which saves a shift per byte.
    """
    BW: tl.constexpr = BLOCK_K * BITS // 8
    rb = t * BW + tl.arange(0, BW)
    if BITS == 8:
        if EVEN_K:
            q = tl.load(q_rows + rb[None, :])
            x = tl.load(x_ptr + rb * stride_xk)
        else:
            q = tl.load(q_rows + rb[None, :], mask=(rb < K)[None, :], other=0)
            x = tl.load(x_ptr + rb * stride_xk, mask=rb < K, other=0.0)
        prod = _i8_to_f32(q) * x.to(tl.float32)[None, :]
        return tl.sum(tl.reshape(prod, (BLOCK_N, BW // _SUB, _SUB)), axis=2)
    rk = 2 * rb[:, None] + tl.arange(0, 2)[None, :]
    if EVEN_K:
        p = tl.load(q_rows + rb[None, :])
        x = tl.load(x_ptr + rk * stride_xk)
    else:  # bytes masked by KP, not by 2 * rb < K: a mask on a strided index would break the vector load
        p = tl.load(q_rows + rb[None, :], mask=(rb < KP)[None, :], other=0)
        x = tl.load(x_ptr + rk * stride_xk, mask=rk < K, other=0.0)
    p = p.to(tl.int32)
    x_even, x_odd = tl.split(x.to(tl.float32))
    lo = _u4_to_f32(p & 15)
    hi16 = ((p & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    return (tl.sum(tl.reshape(lo * x_even[None, :], (BLOCK_N, BW // _SUB, _SUB)), axis=2)
            + tl.sum(tl.reshape(hi16 * (x_odd * 0.0625)[None, :], (BLOCK_N, BW // _SUB, _SUB)), axis=2))


@triton.autotune(configs=_qgemv_configs(), key=["N", "K", "K_SPAN", "GROUP", "BITS"],
                 prune_configs_by={"early_config_prune": _qgemv_prune})
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit
def _wq_gemv_kernel(q_ptr, s_ptr, x_ptr, out_ptr, N, K, KP, K_SPAN, stride_qn, stride_sn, stride_xk,
                    GROUP: tl.constexpr, BITS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Program (i, j): rows [i * BLOCK_N, +BLOCK_N), K range [j * K_SPAN, +K_SPAN) in whole tiles; SPLIT: write the
    fp32 partial row j of out [SPLIT_K, N], else y itself."""
    pid_k = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = rn % N  # rows past N wrap to real ones (never stored), so the loads need no row mask
    q_rows = q_ptr + rows[:, None] * stride_qn
    s_rows = s_ptr + rows * stride_sn
    SUB_K: tl.constexpr = _SUB * 8 // BITS  # K per sub-block, <= MIN_GROUP: a sub-block never straddles groups
    tiles = tl.cdiv(K_SPAN, BLOCK_K)
    t_lo = pid_k * tiles
    t_hi = tl.minimum(t_lo + tiles, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_N, BLOCK_K // SUB_K), dtype=tl.float32)
    for t in k_range(t_lo, t_hi, 1):
        part = _tile_sums(q_rows, x_ptr, t, K, KP, stride_xk, BITS, BLOCK_N, BLOCK_K, EVEN_K)
        if BLOCK_K <= GROUP:  # the tile lies in one group: one scale per row
            s = tl.load(s_rows + t * BLOCK_K // GROUP).to(tl.float32)
            acc += part * s[:, None]
        else:  # one scale per row and sub-block
            g = (t * BLOCK_K + tl.arange(0, BLOCK_K // SUB_K) * SUB_K) // GROUP
            if EVEN_K:
                s = tl.load(s_rows[:, None] + g[None, :])
            else:
                s = tl.load(s_rows[:, None] + g[None, :], mask=(g < tl.cdiv(K, GROUP))[None, :], other=0.0)
            acc += part * s.to(tl.float32)
    y = tl.sum(acc, axis=1)
    if SPLIT:
        tl.store(out_ptr + pid_k * N + rn, y, mask=rn < N)
    else:
        tl.store(out_ptr + rn, y.to(out_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, N, SPLIT_K: tl.constexpr, SPLIT_P2: tl.constexpr, BLOCK: tl.constexpr):
    """y = the column sums of the [SPLIT_K, N] partials, all loaded at once (one L2 round trip, not SPLIT_K)."""
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rs = tl.arange(0, SPLIT_P2)
    mask = (rs < SPLIT_K)[:, None] & (rn < N)[None, :]
    part = tl.load(part_ptr + rs[:, None] * N + rn[None, :], mask=mask, other=0.0)
    tl.store(y_ptr + rn, tl.sum(part, axis=0).to(y_ptr.dtype.element_ty), mask=rn < N)


def _gemv_split(n: int, k: int, group: int, sms: int, split_k: int | None = None) -> tuple[int, int]:
    """(programs along K, K range of each) for an [N, K] GEMV.

    A range is a whole number of scale groups (so no two programs share one) and of _MIN_SPAN. The heuristic takes
    the largest power-of-two range that still gives _WAVES * sms programs with _SPLIT_ROWS-row blocks, so every
    BLOCK_K up to it tiles it exactly; N that fills the SMs alone, or K below _SPLIT_MIN_K, gets no split.
    `split_k` asks for that many programs instead, as even as whole units allow (so possibly fewer).
    """
    unit = _MIN_SPAN if group >= k else max(group, _MIN_SPAN)
    if split_k is not None:
        span = triton.cdiv(triton.cdiv(k, max(split_k, 1)), unit) * unit
    elif k < _SPLIT_MIN_K:
        span = k
    else:
        want = triton.cdiv(_WAVES * sms, max(1, triton.cdiv(n, _SPLIT_ROWS)))
        span = unit
        while span < k and triton.cdiv(k, 2 * span) >= want:
            span *= 2
    if span >= k:
        return 1, k
    return triton.cdiv(k, span), span


def quant_gemv(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """y [N] = dequant(qw) @ x for x [K]; y has x's dtype. `split_k` forces the K split (tests, sweeps)."""
    k = x.shape[0]
    n = qw.shape[0]
    bits = 4 if qw.dtype == torch.uint8 else 8
    group = kernel_group(k, scales.shape[1])
    split, span = _gemv_split(n, k, group, num_sms(x.device, cpu=_CPU_SMS), split_k)
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty((split, n), dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
    _wq_gemv_kernel[grid](qw, scales, x, out, n, k, qw.shape[1], span, qw.stride(0), scales.stride(0), x.stride(0),
                          group, bits, split > 1)
    if split > 1:
        _split_sum_kernel[(triton.cdiv(n, _SUM_BLOCK),)](out, y, n, split, triton.next_power_of_2(split),
                                                         BLOCK=_SUM_BLOCK)
    return y
