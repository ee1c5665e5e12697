"""Weight-only W8A16 / W4A16 product for a few rows: y [M, N] = a [M, K] @ dequant(qw, scales)^T, 1 <= M <= 16.

Decoding a batch of 2..16 sequences is still a weight stream: every weight is used M times, so M * 2 flops per
weight byte (int8) stays far below what the memory bandwidth feeds. The tile GEMM (`quant.quant_gemm`) pads M to a
16-row tensor-core tile and is tuned for large M; the GEMV (`gemv_quant.quant_gemv`) takes one row. This kernel reads
each packed weight tile once, dequantizes it in registers and applies it to all M rows (padded to a power of two,
M_P2): a broadcast product [M_P2, 1, K-tile] * [1, BLOCK_N, K-tile] summed over K, on the CUDA cores, because tl.dot
needs 16 rows. Its fp32 multiply-adds grow with M while the bytes do not, so at some M the tensor-core GEMM wins
again; automp.kernels.crossover measures where, per shape.

Layouts are quant's (module docstring there). A K-tile never straddles a scale group (the configs are pruned to
BLOCK_K <= group), so each row's partial dot over a tile is scaled once. K is split across programs exactly as the
GEMV splits it (`gemv_quant._gemv_split`), with the fp32 partials summed by `quant._split_sum_kernel` in a fixed
order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from automp.kernels.gemm import INTERPRET
from automp.kernels.gemv import k_range, num_sms
from automp.kernels.quant import (_CPU_SMS, _SUM_BLOCK, _i8_to_f32, _split_sum_kernel, _split_tiles, _u4_to_f32,
                                  kernel_group)
from automp.kernels.gemv_quant import _gemv_split

MAX_ROWS = 16
# fp32 values of the broadcast product per thread a config may hold (M_P2 * BLOCK_N * BLOCK_K / threads). Checked in
# ptxas's resource usage of Triton 3.6's sm_90 code for every config below at M_P2 1..16, int4 and int8: up to 128
# none spills (the largest reach 255 registers); at 256 most spill to the stack.
_PRODUCT_PER_THREAD = 128


def _rows_configs(interpret: bool = INTERPRET) -> list[triton.Config]:
    if interpret:  # BLOCK_K 32: every group size (>= 32) has several tiles per group or several groups per row
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
            for bn, bk, w in [(16, 32, 2), (32, 32, 4), (64, 32, 4), (128, 32, 4), (16, 64, 2), (16, 64, 4),
                              (32, 64, 4), (64, 64, 4), (16, 128, 4), (32, 128, 4), (64, 128, 8), (32, 256, 8)]]


def _rows_prune(configs: list[triton.Config], nargs: dict, **kw: object) -> list[triton.Config]:
    """Tiles no deeper than a group, dividing a split's K range, and whose product fits the registers at this M."""
    a = {**nargs, **kw}
    split = a["K_SPAN"] < a["K"]
    deep = [c for c in configs if c.kwargs["BLOCK_K"] <= a["GROUP"]
            and (not split or a["K_SPAN"] % c.kwargs["BLOCK_K"] == 0)]
    fit = [c for c in deep if a["M_P2"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"]
           <= _PRODUCT_PER_THREAD * 32 * c.num_warps]
    # BLOCK_K 32 always passes the first filter (groups and split ranges are multiples of 32); the smallest of
    # those is the fallback when no tile fits the register budget.
    return fit or sorted(deep, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"])[:1]


@triton.jit
def _rows_tile_dots(q_rows, a_rows, t, K, KP, stride_ak, BITS: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr):
    """Unscaled dots of every row of `a` with every weight row over K-tile t: [M_P2, BLOCK_N] fp32.

    int4 keeps a byte's two nibbles apart rather than interleaving them along K (a layout shuffle per tile): the
    activations come as (even k, odd k) pairs and each nibble plane gets its own product.
    """
    BW: tl.constexpr = BLOCK_K * BITS // 8
    rb = t * BW + tl.arange(0, BW)
    if BITS == 8:
        if EVEN_K:
            q = tl.load(q_rows + rb[None, :])
            x = tl.load(a_rows + rb[None, :] * stride_ak)
        else:
            q = tl.load(q_rows + rb[None, :], mask=(rb < K)[None, :], other=0)
            x = tl.load(a_rows + rb[None, :] * stride_ak, mask=(rb < K)[None, :], other=0.0)
        w = _i8_to_f32(q)
        return tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    rk = 2 * rb[:, None] + tl.arange(0, 2)[None, :]
    if EVEN_K:
        p = tl.load(q_rows + rb[None, :])
        x = tl.load(a_rows[:, :, None] + rk[None, :, :] * stride_ak)
    else:  # bytes masked by KP, activations by K: the padding nibble of an odd K meets a zero
        p = tl.load(q_rows + rb[None, :], mask=(rb < KP)[None, :], other=0)
        x = tl.load(a_rows[:, :, None] + rk[None, :, :] * stride_ak, mask=(rk < K)[None, :, :], other=0.0)
    p = p.to(tl.int32)
    x_even, x_odd = tl.split(x.to(tl.float32))
    lo = _u4_to_f32(p & 15)
    hi = _u4_to_f32(p >> 4)
    return (tl.sum(x_even[:, None, :] * lo[None, :, :], axis=2)
            + tl.sum(x_odd[:, None, :] * hi[None, :, :], axis=2))


@triton.autotune(configs=_rows_configs(), key=["M_P2", "N", "K", "K_SPAN", "GROUP", "BITS"],
                 prune_configs_by={"early_config_prune": _rows_prune})
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit
def _wq_rows_kernel(q_ptr, s_ptr, a_ptr, out_ptr, M, N, K, KP, K_SPAN, stride_qn, stride_sn, stride_am, stride_ak,
                    GROUP: tl.constexpr, BITS: tl.constexpr, SPLIT: tl.constexpr, M_P2: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Program (i, j): weight rows [i * BLOCK_N, +BLOCK_N) against all M activation rows over the K range
    [j * K_SPAN, +K_SPAN); SPLIT: write the fp32 partial [M, N] slab j of out [SPLIT_K, M, N], else y [M, N]."""
    pid_k = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_P2)
    rows = rn % N  # padding rows and columns wrap to real ones (never stored), so the loads need no row mask
    q_rows = q_ptr + rows[:, None] * stride_qn
    s_rows = s_ptr + rows * stride_sn
    a_rows = a_ptr + (rm % M)[:, None] * stride_am
    t_lo, t_hi = _split_tiles(pid_k, K, K_SPAN, BLOCK_K)
    acc = tl.zeros((M_P2, BLOCK_N), dtype=tl.float32)
    for t in k_range(t_lo, t_hi, 1):
        part = _rows_tile_dots(q_rows, a_rows, t, K, KP, stride_ak, BITS, BLOCK_K, EVEN_K)
        s = tl.load(s_rows + t * BLOCK_K // GROUP).to(tl.float32)  # the tile lies in one group
        acc += part * s[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def quant_gemv_rows(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor,
                    split_k: int | None = None) -> torch.Tensor:
    """y [M, N] = a [M, K] @ dequant(qw, scales)^T in a's dtype, for 1 <= M <= 16 (inputs validated by ops.py;
    `a` may have any strides). `split_k` forces the K split (tests, sweeps)."""
    m, k = a.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"automp.kernels.quant_gemv_rows: a must have 1..{MAX_ROWS} rows, got {m}")
    n = qw.shape[0]
    bits = 4 if qw.dtype == torch.uint8 else 8
    group = kernel_group(k, scales.shape[1])
    split, span = _gemv_split(n, k, group, num_sms(a.device, cpu=_CPU_SMS), split_k)
    y = torch.empty((m, n), dtype=a.dtype, device=a.device)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
    _wq_rows_kernel[grid](qw, scales, a, out, m, n, k, qw.shape[1], span, qw.stride(0), scales.stride(0),
                          a.stride(0), a.stride(1), group, bits, split > 1, triton.next_power_of_2(m))
    if split > 1:  # the [SPLIT, M, N] partials are [SPLIT, M * N] to the column-sum kernel
        _split_sum_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](out, y, m * n, split, triton.next_power_of_2(split),
                                                             BLOCK=_SUM_BLOCK)
    return y
