"""Quantized matrix kernels: weight-only W8A16 / W4A16 (GEMV and GEMM) and W8A8 int8 GEMM, plus their quantizers.

Weight-only layout (weights W [N, K] as in nn.Linear, y = x @ W^T):
  * int8:  qw int8 [N, K], w = qw * s.
  * int4:  qw uint8 [N, ceil(K/2)]; byte j of a row holds k = 2j in the low nibble and k = 2j+1 in the high
           nibble, each stored as q + 8 (q in -8..7), w = q * s. An odd K leaves the last high nibble unused.
  * scales s float [N, ceil(K/G)]: one per row and group of G consecutive k. G is a power of two >= 32 (so a
    kernel tile never straddles a group), or a single column (per-channel).
Dequantization happens in registers right after the load: the weight bytes cross memory once, at 1 or 0.5 byte per
element, which is the whole point for memory-bound decoding. Because a K-tile lies inside one group, the scale is
applied once per tile (to the tile's partial dot), not once per element.

W8A8 (`int8_gemm`): int8 a [M, K] @ int8 b [K, N] accumulated in int32 on the tensor cores, then one fused
epilogue: out = sa[m] * sb[n] * (acc - za[m] * sum_k b[k, n]) + bias[n]. za is the activation zero point of the
asymmetric scheme (a = sa * (a_q - za), e.g. za = -128 for post-ReLU activations spread over the full int8 range).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from automp.kernels.gemm import INTERPRET, mm_configs, prune_by_m, tile_ids
from automp.kernels.gemv import half_dot

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
        return torch.round(xf / s[:, None]).clamp_(-127, 127).to(torch.int8), s
    lo = xf.amin(dim=1).clamp(max=0)
    hi = xf.amax(dim=1).clamp(min=0)
    s = ((hi - lo) / 255).clamp_min(torch.finfo(torch.float32).tiny)
    z = (-128 - torch.round(lo / s)).clamp_(-128, 127).to(torch.int32)
    q = (torch.round(xf / s[:, None]) + z[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, s, z


# ----------------------------------------------------------------------------------------------- weight-only GEMV
def _group_prune(configs: list[triton.Config], nargs: dict, **kw: object) -> list[triton.Config]:
    group = {**nargs, **kw}["GROUP"]
    fit = [c for c in configs if c.kwargs["BLOCK_K"] <= group]
    return fit or configs[:1]


def _qgemv_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in [(16, 128, 4, 3), (32, 128, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3),
                                 (32, 64, 4, 4), (64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 2)]]


@triton.autotune(configs=_qgemv_configs(), key=["N", "K", "GROUP", "BITS"],
                 prune_configs_by={"early_config_prune": _group_prune})
@triton.jit
def _wq_gemv_kernel(q_ptr, s_ptr, x_ptr, y_ptr, N, K, stride_qn, stride_sn, stride_xk,
                    GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K // (8 // BITS)), dtype=tl.float32)
    if BITS == 8:
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < K
            q = tl.load(q_ptr + rn[:, None] * stride_qn + rk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0)
            s = tl.load(s_ptr + rn * stride_sn + k0 // GROUP, mask=n_mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + rk * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
            acc += q.to(tl.float32) * x[None, :] * s[:, None]
    else:
        kp = (K + 1) // 2
        for j0 in range(0, kp, BLOCK_K // 2):
            rj = j0 + tl.arange(0, BLOCK_K // 2)
            p = tl.load(q_ptr + rn[:, None] * stride_qn + rj[None, :], mask=n_mask[:, None] & (rj < kp)[None, :],
                        other=0)
            s = tl.load(s_ptr + rn * stride_sn + (2 * j0) // GROUP, mask=n_mask, other=0.0).to(tl.float32)
            xe = tl.load(x_ptr + 2 * rj * stride_xk, mask=2 * rj < K, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + (2 * rj + 1) * stride_xk, mask=2 * rj + 1 < K, other=0.0).to(tl.float32)
            lo = (p & 15).to(tl.float32) - 8.0
            hi = (p >> 4).to(tl.float32) - 8.0
            acc += (lo * xe[None, :] + hi * xo[None, :]) * s[:, None]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)


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


def quant_gemv(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y [N] = dequant(qw) @ x for x [K]; y has x's dtype."""
    k = x.shape[0]
    n = qw.shape[0]
    bits = 4 if qw.dtype == torch.uint8 else 8
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _wq_gemv_kernel[grid](qw, scales, x, y, n, k, qw.stride(0), scales.stride(0), x.stride(0),
                          kernel_group(k, scales.shape[1]), bits)
    return y


# ----------------------------------------------------------------------------------------------- weight-only GEMM
def _qgemm_prune(configs: list[triton.Config], nargs: dict, **kw: object) -> list[triton.Config]:
    return _group_prune(prune_by_m(configs, nargs), nargs, **kw)


_Q_SQUARE = [(128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4)]
_Q_SKINNY = [(16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
             (64, 64, 128, 4, 3), (64, 128, 64, 4, 4), (16, 64, 64, 4, 4)]


@triton.autotune(configs=mm_configs(_Q_SQUARE, _Q_SKINNY, (16, 16, 32, 4, 1)), key=["M", "N", "K", "GROUP", "BITS"],
                 prune_configs_by={"early_config_prune": _qgemm_prune})
@triton.jit
def _wq_gemm_kernel(a_ptr, q_ptr, s_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_qn, stride_sn,
                    GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + (rm % M)[:, None] * stride_am
    q_cols = q_ptr + (rn % N)[None, :] * stride_qn
    s_cols = s_ptr + (rn % N) * stride_sn
    dt = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS == 8:
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_rows + rk[None, :] * stride_ak, mask=rk[None, :] < K, other=0.0)
            q = tl.load(q_cols + rk[:, None], mask=rk[:, None] < K, other=0)
            s = tl.load(s_cols + k0 // GROUP).to(tl.float32)
            acc += half_dot(a, q.to(tl.float32).to(dt), tl.zeros((BLOCK_M, BLOCK_N), tl.float32)) * s[None, :]
    else:
        kp = (K + 1) // 2
        for j0 in range(0, kp, BLOCK_K // 2):
            rj = j0 + tl.arange(0, BLOCK_K // 2)
            p = tl.load(q_cols + rj[:, None], mask=rj[:, None] < kp, other=0)
            ae = tl.load(a_rows + (2 * rj)[None, :] * stride_ak, mask=(2 * rj)[None, :] < K, other=0.0)
            ao = tl.load(a_rows + (2 * rj + 1)[None, :] * stride_ak, mask=(2 * rj + 1)[None, :] < K, other=0.0)
            lo = ((p & 15).to(tl.float32) - 8.0).to(dt)  # via fp32: exact, and the interpreter
            hi = ((p >> 4).to(tl.float32) - 8.0).to(dt)  # cannot convert ints to bf16 directly
            s = tl.load(s_cols + (2 * j0) // GROUP).to(tl.float32)
            acc += half_dot(ao, hi, half_dot(ae, lo, tl.zeros((BLOCK_M, BLOCK_N), tl.float32))) * s[None, :]
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def quant_gemm(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """c [M, N] = a [M, K] @ dequant(qw)^T in a's dtype."""
    m, k = a.shape
    n = qw.shape[0]
    bits = 4 if qw.dtype == torch.uint8 else 8
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _wq_gemm_kernel[grid](a, qw, scales, c, m, n, k, a.stride(0), a.stride(1), qw.stride(0), scales.stride(0),
                          kernel_group(k, scales.shape[1]), bits)
    return c


# ----------------------------------------------------------------------------------------------- W8A8 int8 GEMM
_I8_SQUARE = [(128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 4, 4),
              (128, 256, 64, 8, 4), (64, 128, 128, 4, 4)]
_I8_SKINNY = [(16, 64, 256, 4, 4), (32, 64, 256, 4, 3), (32, 128, 128, 4, 4), (64, 64, 256, 4, 3),
              (64, 128, 128, 4, 4)]


@triton.autotune(configs=mm_configs(_I8_SQUARE, _I8_SKINNY, (16, 16, 32, 4, 1)), key=["M", "N", "K"],
                 prune_configs_by={"early_config_prune": prune_by_m})
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _int8_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, za_ptr, colsum_ptr, M, N, K,
                      stride_am, stride_ak, stride_bk, stride_bn,
                      HAS_BIAS: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rm % M)[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + (rn % N)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=rk[None, :] < K - k0, other=0)
            b = tl.load(b_ptrs, mask=rk[:, None] < K - k0, other=0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    m_mask = rm < M
    n_mask = rn < N
    if HAS_ZP:
        za = tl.load(za_ptr + rm, mask=m_mask, other=0)
        colsum = tl.load(colsum_ptr + rn, mask=n_mask, other=0)
        acc -= za[:, None] * colsum[None, :]
    sa = tl.load(sa_ptr + rm, mask=m_mask, other=0.0).to(tl.float32)
    sb = tl.load(sb_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], out.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def int8_gemm(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
              a_zero: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Launch with sa [M], sb [N] contiguous, optional bias [N] and per-row int32 zero point a_zero [M]."""
    m, k = a_q.shape
    n = b_q.shape[1]
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    colsum = b_q.sum(dim=0, dtype=torch.int32) if a_zero is not None else None
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _int8_gemm_kernel[grid](a_q, b_q, c, sa, sb, bias if bias is not None else sa,
                            a_zero if a_zero is not None else sa, colsum if colsum is not None else sa,
                            m, n, k, a_q.stride(0), a_q.stride(1), b_q.stride(0), b_q.stride(1),
                            bias is not None, a_zero is not None)
    return c
