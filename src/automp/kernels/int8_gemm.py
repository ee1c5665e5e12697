"""W8A8 int8 GEMM with a fused epilogue: the kernel behind automp's static int8 encoders (automp.quant.int8,
automp.deploy.quantized), whose every linear layer is one call of it.

int8 a [M, K] @ int8 b [K, N] accumulates in int32 on the tensor cores, then one fused epilogue:
out = sa[m] * sb[n] * (acc - za[m] * sum_k b[k, n]) + bias[n]. za is the activation zero point of the asymmetric
scheme (a = sa * (a_q - za), e.g. za = -128 for post-ReLU activations spread over the full int8 range). The epilogue
may go on with GELU and with the next layer's static input quantization (`int8_gemm_requant`), so that an MLP's
4x-wide hidden activation leaves the first GEMM as int8 for the second: one write of one byte per element instead of
a half-precision write, a GELU kernel's read and write, and a quantization kernel's read and write.

Persistent form (PERSISTENT = k >= 1). An encoder's GEMMs are short in K (768 for BERT-base: a handful of K-steps
per tile), so a program that owns one tile spends much of its life filling the software pipeline and running the
epilogue (scales, bias, GELU, requantization) with no loads in flight; and tile counts that are no multiple of the
SM count leave a partly empty last wave. A persistent grid of k programs per SM (never more than the tiles) loops
over the tiles in tile_ids' order, and its tile and K loops are one flattened loop (tl.range(flatten=True)): the
software pipeliner then issues the next tile's loads while the current tile's epilogue runs. Whether that wins
depends on the shape, so persistent and one-tile-per-program configs are tuned side by side (large M only, see
gemm.prune_by_m). Pointer loads, no TMA descriptors: the same code runs under the interpreter and Triton 3.6-3.9.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from automp.kernels.gemm import graph_bench, mm_configs, prune_by_m, tile_coords, tile_dot, tile_ids
from automp.kernels.gemv import INTERPRET, k_range, num_sms

_FAST_GELU = tl.constexpr(not INTERPRET)


def _interpreted_tiles(start: object, stop: object, step: object, flatten: bool) -> range:
    """The persistent tile loop under the interpreter (k_range's runtime-bound conversion; nothing to flatten)."""
    return k_range(start, stop, step)


# Compiled, the tile loop is tl.range itself (its flatten attribute exists in Triton 3.6 and 3.9).
tile_range = _interpreted_tiles if INTERPRET else tl.range


@triton.jit
def _gelu_for_int8(x, half_scale):
    """GELU(x) * 2 half_scale, of an output about to be quantized to int8 (the next layer's multiplier folded into the
    final product, one multiply fewer per element). erf costs dozens of instructions per element, and an epilogue over
    a [8192, 3072] MLP activation overlaps no main loop of its own tile (at best, persistent, the next tile's loads),
    so on the GPU it takes the tanh form on the hardware tanh (one MUFU op): within ~1e-3 of exact GELU, far below the
    int8 step it is rounded to next. The interpreter (no inline PTX) computes it exactly."""
    h = x * half_scale
    if _FAST_GELU:
        u = x * (0.7978845608028654 + 0.035677408136300125 * (x * x))  # sqrt(2 / pi) (x + 0.044715 x^3)
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        t = tl.erf(x * 0.7071067811865476)
    return h + h * t


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, PERSISTENT). The persistent ones: two 4-warp programs per SM, so that one
# program's epilogue overlaps the other's main loop as well as its own next tile's loads. Forced one by one at a
# BERT-base encoder's shapes on a Hopper GPU (BENCHMARKS.md, "Deployment and encoders"), these beat their one-tile
# forms at M = 8192, most at K = 3072, while one 8-warp program per SM ran slower than its plain form at every shape.
_I8_SQUARE = [(128, 256, 128, 8, 3, 0), (256, 128, 128, 8, 3, 0), (128, 128, 128, 8, 4, 0), (128, 128, 64, 4, 4, 0),
              (128, 256, 64, 8, 4, 0), (64, 128, 128, 4, 4, 0)]
_I8_PERSISTENT = [(64, 128, 128, 4, 4, 2), (128, 128, 64, 4, 4, 2)]
_I8_SKINNY = [(16, 64, 256, 4, 4, 0), (32, 64, 256, 4, 3, 0), (32, 128, 128, 4, 4, 0), (64, 64, 256, 4, 3, 0),
              (64, 64, 128, 4, 4, 0)]
_I8_TINY = (16, 16, 32, 4, 1, 0)


def i8_configs(interpret: bool = INTERPRET) -> list[triton.Config]:
    """Every config the autotuner is offered (the interpreter: the tiny one only)."""
    return mm_configs(_I8_SQUARE + _I8_PERSISTENT, _I8_SKINNY, _I8_TINY, interpret)


@triton.jit
def _epilogue(acc, rm, rn, M, N, c_ptr, sa_ptr, sb_ptr, bias_ptr, za_ptr, colsum_ptr, qm_ptr, qz_ptr,
              stride_sa: tl.constexpr, stride_qm, HAS_BIAS: tl.constexpr, HAS_ZP: tl.constexpr, GELU: tl.constexpr,
              QUANT_OUT: tl.constexpr, HAS_QZ: tl.constexpr):
    """Zero-point correction, scales, bias, GELU, requantization and the store of one tile's accumulator."""
    m_mask = rm < M
    n_mask = rn < N
    if HAS_ZP:
        za = tl.load(za_ptr + rm, mask=m_mask, other=0)
        colsum = tl.load(colsum_ptr + rn, mask=n_mask, other=0)
        acc -= za[:, None] * colsum[None, :]
    sb = tl.load(sb_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    if stride_sa == 0:  # one activation scale (static): folded into the columns' scales, one multiply per element
        out = acc.to(tl.float32) * (tl.load(sa_ptr).to(tl.float32) * sb)[None, :]
    else:
        sa = tl.load(sa_ptr + rm, mask=m_mask, other=0.0).to(tl.float32)
        out = acc.to(tl.float32) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    qm = tl.load(qm_ptr + rn * stride_qm, mask=n_mask, other=0.0).to(tl.float32) if QUANT_OUT else 1.0
    if GELU:  # nn.GELU()'s (erf) GELU, as _gelu_for_int8 approximates it, times qm
        out = _gelu_for_int8(out, (0.5 * qm)[None, :] if QUANT_OUT else 0.5)
    elif QUANT_OUT:
        out = out * qm[None, :]
    c_ptrs = c_ptr + rm[:, None] * N + rn[None, :]
    if QUANT_OUT:  # the next layer's static quantization: q = clamp(round(out * qm[n]) + qz, -127 | -128, 127)
        # Rounded and converted without a float-to-int instruction, which runs at a quarter of the FMA rate and, with
        # GELU's tanh, bounds this epilogue: adding 1.5 * 2^23 rounds to an integer (half to even, as torch.round),
        # kept in the low bits of the float's pattern (exact while |out| < 2^22, hence the clamp first).
        if HAS_QZ:  # asymmetric: the zero point shifts the rounded codes, and all 256 levels are used
            out = tl.minimum(tl.maximum(out, -1024.0), 1024.0)
            codes = (out + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000 + tl.load(qz_ptr)
            codes = tl.minimum(tl.maximum(codes, -128), 127)
        else:  # clamped to the codes, the pattern's low byte is the int8 code itself
            out = tl.minimum(tl.maximum(out, -127.0), 127.0)
            codes = (out + 12582912.0).to(tl.int32, bitcast=True)
        tl.store(c_ptrs, codes.to(tl.int8), mask=m_mask[:, None] & n_mask[None, :])
    else:
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.autotune(configs=i8_configs(), key=["M", "N", "K"], prune_configs_by={"early_config_prune": prune_by_m},
                 do_bench=graph_bench)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _int8_gemm_kernel(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, bias_ptr, za_ptr, colsum_ptr, qm_ptr, qz_ptr, M, N, K,
                      stride_am, stride_ak, stride_bk, stride_bn, stride_sa: tl.constexpr, stride_qm,
                      HAS_BIAS: tl.constexpr, HAS_ZP: tl.constexpr, GELU: tl.constexpr, QUANT_OUT: tl.constexpr,
                      HAS_QZ: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      PERSISTENT: tl.constexpr, EVEN_K: tl.constexpr):
    if PERSISTENT == 0:  # one tile per program
        pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tile_dot(a_ptr, b_ptr, rm, rn, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, True)
        _epilogue(acc, rm, rn, M, N, c_ptr, sa_ptr, sb_ptr, bias_ptr, za_ptr, colsum_ptr, qm_ptr, qz_ptr, stride_sa,
                  stride_qm, HAS_BIAS, HAS_ZP, GELU, QUANT_OUT, HAS_QZ)
    else:  # tiles pid, pid + programs, ...
        step = tl.num_programs(0)
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        # The epilogue's tile comes from a counter of its own rather than from the loop's rm / rn (as in Triton's
        # persistent-matmul tutorial): once the loops are flattened, the epilogue runs at the last K-step, and
        # values from the tile's first step would stay live in registers across all the steps between.
        done = tl.program_id(0) - step
        for tile in tile_range(tl.program_id(0), tiles, step, flatten=True):
            pid_m, pid_n = tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tile_dot(a_ptr, b_ptr, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                           pid_n * BLOCK_N + tl.arange(0, BLOCK_N), M, N, K, stride_am, stride_ak, stride_bk,
                           stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, True)
            done += step
            pid_m, pid_n = tile_coords(done, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            _epilogue(acc, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N), M, N,
                      c_ptr, sa_ptr, sb_ptr, bias_ptr, za_ptr, colsum_ptr, qm_ptr, qz_ptr, stride_sa, stride_qm,
                      HAS_BIAS, HAS_ZP, GELU, QUANT_OUT, HAS_QZ)


def programs(m: int, n: int, meta: dict, sms: int) -> int:
    """The grid: one program per tile, or for PERSISTENT = k at most k per SM."""
    tiles = triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])
    return min(tiles, meta["PERSISTENT"] * sms) if meta["PERSISTENT"] else tiles


def int8_gemm(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
              a_zero: torch.Tensor | None, out_dtype: torch.dtype, gelu: bool = False,
              requant: tuple[torch.Tensor, torch.Tensor | None] | None = None, config: triton.Config | None = None,
              sms: int | None = None) -> torch.Tensor:
    """Launch with sa [M] (or [1]: one scale for all rows), sb [N] contiguous, optional bias [N] and per-row int32
    zero point a_zero [M]. gelu: GELU after the bias. requant (float mult [N] or [1], optional one-element int32 zero
    point): the output is int8, quantized as the next layer's static input (out_dtype is then ignored).
    config forces one config past the autotuner and sms the SM count a persistent grid is sized for (tests, sweeps)."""
    m, k = a_q.shape
    n = b_q.shape[1]
    c = torch.empty((m, n), dtype=torch.int8 if requant is not None else out_dtype, device=a_q.device)
    colsum = b_q.sum(dim=0, dtype=torch.int32) if a_zero is not None else None
    qm, qz = requant if requant is not None else (sa, None)
    sms = sms or num_sms(a_q.device)
    grid = lambda meta: (programs(m, n, meta, sms),)  # noqa: E731
    kernel, options = _int8_gemm_kernel, {}
    if config is not None:
        kernel, options = _int8_gemm_kernel.fn, dict(config.kwargs, num_warps=config.num_warps,
                                                     num_stages=config.num_stages)
    kernel[grid](a_q, b_q, c, sa, sb, bias if bias is not None else sa, a_zero if a_zero is not None else sa,
                 colsum if colsum is not None else sa, qm, qz if qz is not None else sa, m, n, k, a_q.stride(0),
                 a_q.stride(1), b_q.stride(0), b_q.stride(1), 0 if sa.numel() == 1 else 1,
                 0 if qm.numel() == 1 else 1, bias is not None, a_zero is not None, gelu, requant is not None,
                 qz is not None, **options)
    return c
