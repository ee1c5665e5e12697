"""Quantized matrix kernels: the weight-only W8A16 / W4A16 layout, its quantizers and tiled GEMM, and the int8
activation quantizers. The weight-only GEMV (one activation row) is kernels/gemv_quant.py, the few-row product
kernels/quant_batched.py.

Weight-only layout (weights W [N, K] as in nn.Linear, y = x @ W^T):
  * int8:  qw int8 [N, K], w = qw * s.
  * int4:  qw uint8 [N, ceil(K/2)]; byte j of a row holds k = 2j in the low nibble and k = 2j+1 in the high
           nibble, each stored as q + 8 (q in -8..7), w = q * s. An odd K leaves the last high nibble unused.
  * scales s float [N, ceil(K/G)]: one per row and group of G consecutive k. G is a power of two >= 32 (so the
    partial dots the kernels scale never straddle a group), or a single column (per-channel).
Dequantization happens in registers right after the load: the weight bytes cross memory once, at 1 or 0.5 byte per
element, which is the whole point for memory-bound decoding. The scale is applied to partial dots that lie inside one
group (a GEMM K-tile, a GEMV thread's 16-byte vector), not once per element.

Batched decoding (M = 16..64 rows) makes the GEMM a weight stream too, and its tile grid alone is then too small for
the GPU (M=32, N=4096: 64 tiles for 132 SMs, each streaming all of K). So K is split across programs as the GEMV
splits it (`_gemm_split`): fp32 partials, summed in a fixed order by `_split_sum_kernel` (shared with the GEMV).

The W8A8 int8 GEMM is kernels/int8_gemm.py; its activation quantizers (per row, and the static per-tensor one its
epilogue reproduces) are here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from automp.kernels.gemm import SKINNY_M, mm_configs, prune_by_m, tile_ids
from automp.kernels.gemv import half_dot, k_range, num_sms

MIN_GROUP = 32


# ----------------------------------------------------------------------------------------------- quantizers
def _grouped_absmax(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    ng = triton.cdiv(k, group)
    padded = torch.nn.functional.pad(w.float().abs(), (0, ng * group - k))
    return padded.view(n, ng, group).amax(dim=2)


def _check_group(k: int, group_size: int | None) -> int:
    if group_size is None:
        return k
    if group_size < MIN_GROUP or group_size & (group_size - 1):
        raise ValueError(f"automp quantize: group_size must be a power of two >= {MIN_GROUP} or None "
                         f"(per-channel), got {group_size}")
    return group_size


def _scaled_codes(w: torch.Tensor, group_size: int | None, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"automp quantize: expected a floating [N, K] weight, got {tuple(w.shape)} {w.dtype}")
    n, k = w.shape
    group = _check_group(k, group_size)
    scales = (_grouped_absmax(w, group) / qmax).clamp_min(torch.finfo(torch.float32).tiny)
    expanded = scales.repeat_interleave(group, dim=1)[:, :k]
    codes = torch.round(w.float() / expanded).clamp_(-qmax, qmax)
    return codes, scales


def quantize_weight_int8(w: torch.Tensor, group_size: int | None = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group int8: returns (qw int8 [N, K], scales fp32 [N, ceil(K/G)])."""
    codes, scales = _scaled_codes(w, group_size, 127)
    return codes.to(torch.int8).contiguous(), scales


def quantize_weight_int4(w: torch.Tensor, group_size: int | None = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-group int4 packed two per byte (layout in the module docstring)."""
    codes, scales = _scaled_codes(w, group_size, 7)
    n, k = codes.shape
    u = torch.nn.functional.pad(codes + 8, (0, k % 2), value=8).to(torch.uint8).view(n, -1, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous(), scales


def dequantize_weight(qw: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """float32 [N, K] weights back from either layout (the reference the kernels must match)."""
    if qw.dtype == torch.uint8:
        codes = torch.stack([(qw & 15), (qw >> 4)], dim=2).view(qw.shape[0], -1)[:, :k].float() - 8
    else:
        codes = qw.float()
    group = kernel_group(k, scales.shape[1]) if scales.shape[1] > 1 else k
    return codes * scales.float().repeat_interleave(group, dim=1)[:, :k]


def quantize_rowwise_int8(x: torch.Tensor, asymmetric: bool = False):
    """Per-row int8 for activations (or b^T of int8_gemm): (q, scale [M]) or, asymmetric, (q, scale, zero [M]).

    The asymmetric scheme maps [min, max] of each row onto -128..127, so one-signed data (post-ReLU) keeps all
    256 levels: q = round(x / s) + z, x ~= s * (q - z).
    """
    xf = x.float()
    if not asymmetric:
        s = (xf.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        # times the reciprocal, not divided by s: an fp32 division per element is several instructions, and on the
        # GPU the fused GELU + quantization kernel of a 3072-wide MLP row was compute-bound (kernel profile)
        return torch.round(xf * (1.0 / s)[:, None]).clamp_(-127, 127).to(torch.int8), s
    lo = xf.amin(dim=1).clamp(max=0)
    hi = xf.amax(dim=1).clamp(min=0)
    s = ((hi - lo) / 255).clamp_min(torch.finfo(torch.float32).tiny)
    z = (-128 - torch.round(lo / s)).clamp_(-128, 127).to(torch.int32)
    q = (torch.round(xf / s[:, None]) + z[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, s, z


def quantize_static_int8(x: torch.Tensor, mult: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    """Static (calibrated) int8: clamp(round(x * mult) + zero, -127 (-128 with a zero point), 127). mult: one
    multiplier per channel (last dim) or one for all (1 / scale, times SmoothQuant's factors); zero: an integer
    tensor, or None for the symmetric scheme. The one formula of static activation quantization: Int8Linear
    quantizes its input with it, the requant op's CPU reference uses it, and automp.deploy.quantized.requant
    matches the form it traces to."""
    q = torch.round(x.float() * mult)  # a multiply per element, see quantize_rowwise_int8
    if zero is None:
        return q.clamp_(-127, 127).to(torch.int8)
    return (q + zero).clamp_(-128, 127).to(torch.int8)


# ----------------------------------------------------------------------------------------------- dequantization
@triton.jit
def _i8_to_f32(q):
    """int8 -> fp32 without the quarter-rate I2F: the float with bits 0x4B000000 + 128 + q is 2^23 + 128 + q."""
    return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _u4_to_f32(u):
    """Stored nibble u (int32, 0..15) -> code u - 8, by the same exponent trick."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0


def kernel_group(k: int, n_groups: int) -> int:
    """The constexpr group the kernels see: the real one, or any power of two >= K for per-channel scales."""
    if n_groups == 1:
        return max(MIN_GROUP, triton.next_power_of_2(k))
    g = MIN_GROUP
    while triton.cdiv(k, g) > n_groups:
        g *= 2
    if triton.cdiv(k, g) != n_groups:
        raise ValueError(f"automp quant: {n_groups} scale columns fit no power-of-two group >= {MIN_GROUP} "
                         f"for K={k}")
    return g


# ----------------------------------------------------------------------------------------------- split-K
# Shared by every weight-only kernel (the GEMV and rows kernel import them): when the output alone gives too few
# programs, K is split across programs too; each writes an fp32 partial and _split_sum_kernel adds them in a fixed
# order (deterministic, unlike atomics, and nothing to zero first).
_WAVES = 2  # programs the choosers aim at, in SM counts: every SM busy, with a second program to hide the tail
# No split below this K: measured in a CUDA graph at Llama-1B shapes, a GEMV of K=2048 is mostly launch latency, and
# the split's second launch cost more than its extra programs gave back; at K=5632 six splits won.
_SPLIT_MIN_K = 4096
_SUM_BLOCK = 256
_CPU_SMS = 132  # a Hopper GPU's SM count: CPU runs (the interpreter) split like the GPU they stand in for


@triton.jit
def _split_sum_kernel(part_ptr, y_ptr, N, SPLIT_K: tl.constexpr, SPLIT_P2: tl.constexpr, BLOCK: tl.constexpr):
    """y = the column sums of the [SPLIT_K, N] partials, all loaded at once (one L2 round trip, not SPLIT_K)."""
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rs = tl.arange(0, SPLIT_P2)
    mask = (rs < SPLIT_K)[:, None] & (rn < N)[None, :]
    part = tl.load(part_ptr + rs[:, None] * N + rn[None, :], mask=mask, other=0.0)
    tl.store(y_ptr + rn, tl.sum(part, axis=0).to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _split_tiles(pid_k, K, K_SPAN, BLOCK_K: tl.constexpr):
    """The K-tiles [t_lo, t_hi) of split program pid_k: K_SPAN is a whole number of tiles, the last range ends at K."""
    tiles = tl.cdiv(K_SPAN, BLOCK_K)
    t_lo = pid_k * tiles
    return t_lo, tl.minimum(t_lo + tiles, tl.cdiv(K, BLOCK_K))


# ----------------------------------------------------------------------------------------------- weight-only GEMM
def _qgemm_prune(configs: list[triton.Config], nargs: dict, **kw: object) -> list[triton.Config]:
    """Skinny/square family by M, and tiles no deeper than a group (one scale per column per tile) nor, when K is
    split, than the largest power of two dividing a program's K range (a last tile reaching past it would add the
    next program's K a second time)."""
    a = {**nargs, **kw}
    deepest = a["GROUP"] if a["K_SPAN"] >= a["K"] else min(a["GROUP"], a["K_SPAN"] & -a["K_SPAN"])
    by_m = prune_by_m(configs, nargs)
    fit = [c for c in by_m if c.kwargs["BLOCK_K"] <= deepest]
    if fit:
        return fit
    # No tile of this family is shallow enough: the same tiles cut to that depth (never a straddling tile).
    return [triton.Config({**c.kwargs, "BLOCK_K": deepest}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in by_m]


@triton.jit
def _weight_tile_t(q_ptr, rqn, k0, K, KP, stride_qn, BITS: tl.constexpr, A_FP16: tl.constexpr, dt: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Dequantized-code tile [BLOCK_K, BLOCK_N] in the activation dtype (exact: codes are small integers).

    fp16 builds the halves directly (0x6400 | u is the half 1024 + u), skipping two quarter-rate conversions.
    """
    if BITS == 8:
        rk = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_ptr + rqn[:, None] * stride_qn + rk[None, :], mask=(rk < K)[None, :], other=0)
        if A_FP16:
            w = (q.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
        else:
            w = _i8_to_f32(q).to(dt)
    else:
        rj = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        p = tl.load(q_ptr + rqn[:, None] * stride_qn + rj[None, :], mask=(rj < KP)[None, :], other=0)
        if A_FP16:
            p = p.to(tl.int16)
            lo = ((p & 15) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
            hi = ((p >> 4) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        else:
            p = p.to(tl.int32)
            lo = _u4_to_f32(p & 15).to(dt)
            hi = _u4_to_f32(p >> 4).to(dt)
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    return tl.trans(w)


_Q_SQUARE = [(128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 64, 128, 4, 4)]
_Q_SKINNY = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 32, 128, 4, 4), (32, 64, 128, 4, 4),
             (32, 128, 64, 4, 4), (32, 32, 128, 4, 4), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4),
             (64, 32, 128, 4, 4)]
_Q_MAX_BK = max(c[2] for c in _Q_SQUARE + _Q_SKINNY)  # every BLOCK_K offered (powers of two) divides it
_SPLIT_TILE_N = 64  # tile width the split chooser counts programs with (the middle skinny BLOCK_N)


def _split_unit(k: int, group: int) -> int:
    """The K a split range is a whole number of: scale groups and _Q_MAX_BK (see _gemm_split)."""
    return _Q_MAX_BK if group >= k else max(group, _Q_MAX_BK)


def _gemm_split(m: int, n: int, k: int, group: int, sms: int, split_k: int | None = None,
                waves: int = _WAVES) -> tuple[int, int]:
    """(programs along K, K range of each) for the [M, N, K] weight-only GEMM.

    A range is a whole number of scale groups and of _Q_MAX_BK, so every offered tile depth tiles it exactly and no
    two programs share a group. The heuristic splits only where the tile grid alone leaves SMs idle: M <= SKINNY_M (a
    decode batch: one row of min(next_pow2(M), 64) x _SPLIT_TILE_N tiles, a weight stream whose speed is the number
    of programs streaming), fewer tiles than SMs, and K >= _SPLIT_MIN_K (below it the second launch costs more than
    the split gives, as measured for the GEMV). It then cuts K into even ranges for about `waves` * sms programs.
    Larger M is not split: its square tiles are tuned too, and it turns compute-bound (2 * M flops per weight).
    `split_k` asks for that many programs instead, as even as whole units allow (so possibly fewer).
    """
    unit = _split_unit(k, group)
    if split_k is None:
        tiles = triton.cdiv(m, min(triton.next_power_of_2(m), SKINNY_M)) * triton.cdiv(n, _SPLIT_TILE_N)
        if m > SKINNY_M or k < _SPLIT_MIN_K or tiles >= sms:
            return 1, k
        split_k = triton.cdiv(waves * sms, tiles)
    span = triton.cdiv(triton.cdiv(k, max(split_k, 1)), unit) * unit
    if span >= k:
        return 1, k
    return triton.cdiv(k, span), span


@triton.autotune(configs=mm_configs(_Q_SQUARE, _Q_SKINNY, (16, 16, 32, 4, 1)),
                 key=["M", "N", "K", "K_SPAN", "GROUP", "BITS"], prune_configs_by={"early_config_prune": _qgemm_prune})
@triton.jit
def _wq_gemm_kernel(a_ptr, q_ptr, s_ptr, c_ptr, M, N, K, KP, K_SPAN, stride_am, stride_ak, stride_qn, stride_sn,
                    GROUP: tl.constexpr, BITS: tl.constexpr, A_FP16: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Program (tile, j): the [BLOCK_M, BLOCK_N] tile over K in [j * K_SPAN, +K_SPAN), a whole number of tiles;
    SPLIT: write the fp32 partial [M, N] slab j of c [SPLIT_K, M, N], else c [M, N] itself."""
    pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rqn = rn % N
    a_rows = a_ptr + (rm % M)[:, None] * stride_am
    dt = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_SPAN
    for k0 in k_range(k_lo, tl.minimum(k_lo + K_SPAN, K), BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + rk[None, :] * stride_ak, mask=rk[None, :] < K, other=0.0)
        w = _weight_tile_t(q_ptr, rqn, k0, K, KP, stride_qn, BITS, A_FP16, dt, BLOCK_N, BLOCK_K)
        s = tl.load(s_ptr + rqn * stride_sn + k0 // GROUP).to(tl.float32)
        acc += half_dot(a, w, tl.zeros((BLOCK_M, BLOCK_N), tl.float32)) * s[None, :]
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT:
        tl.store(c_ptrs + pid_k * M * N, acc, mask=mask)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def quant_gemm(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """c [M, N] = a [M, K] @ dequant(qw)^T in a's dtype. `split_k` forces the K split (tests, sweeps)."""
    m, k = a.shape
    n = qw.shape[0]
    bits = 4 if qw.dtype == torch.uint8 else 8
    group = kernel_group(k, scales.shape[1])
    split, span = _gemm_split(m, n, k, group, num_sms(a.device, cpu=_CPU_SMS), split_k)
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    out = c if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
    _wq_gemm_kernel[grid](a, qw, scales, out, m, n, k, qw.shape[1], span, a.stride(0), a.stride(1), qw.stride(0),
                          scales.stride(0), group, bits, a.dtype == torch.float16, split > 1)
    if split > 1:  # the [SPLIT, M, N] partials are [SPLIT, M * N] to the column-sum kernel
        _split_sum_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](out, c, m * n, split, triton.next_power_of_2(split),
                                                             BLOCK=_SUM_BLOCK)
    return c
