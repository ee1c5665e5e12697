"""Triton kernels for reduced-precision inference and training, registered as `torch.ops.automp.*`.

Each function takes and returns torch tensors on CUDA (Triton) or CPU (Triton interpreter under
TRITON_INTERPRET=1, else a torch reference). Layouts of the quantized weights are documented in `quant`.
"""
from __future__ import annotations

import torch

from automp.kernels import crossover  # noqa: F401 - which kernel serves a batch's rows (automp.quant.weight_only)
from automp.kernels import gemv_quant as _gemv_quant
from automp.kernels import ops  # noqa: F401 - registers the torch.library ops
from automp.kernels.quant import (dequantize_weight, quantize_rowwise_int8, quantize_static_int8,
                                  quantize_weight_int4, quantize_weight_int8)

__all__ = ["gemv", "gemm", "quant_gemv", "quant_gemv_rows", "quant_planes", "quant_gemm", "int8_gemm",
           "int8_gemm_requant", "unscale_and_check_", "cast", "decode_attention", "quantize_weight_int8",
           "quantize_weight_int4", "quantize_rowwise_int8", "quantize_static_int8", "dequantize_weight"]


def gemv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y = w @ x: w [N, K] fp16/bf16, x [K] or [K, B] (B <= 8) of the same dtype; fp32 accumulation."""
    return torch.ops.automp.gemv(w, x)


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c = a @ b like torch.mm for a [M, K], b [K, N] fp16/bf16 (any strides); fp32 accumulation."""
    return torch.ops.automp.gemm(a, b)


# Traced by torch.compile, a GEMV that splits K hands Inductor its split programs' partial products and their sum,
# which Inductor unrolls into the loads of the kernel that reads y next (a residual add, a norm, rotary embedding): one
# launch fewer in the step's CUDA graph. False: the GEMV's own split-sum kernel, as in eager mode.
FOLD_SPLIT_SUMS = True


@torch.compiler.assume_constant_result
def _gemv_splits(n: int, k: int, n_groups: int, device: str) -> int:
    """Evaluated once while tracing, outside the graph: it reads the device's SM count."""
    return _gemv_quant.split_count(n, k, n_groups, torch.device(device))


def quant_gemv(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y [N] = dequant(qw, scales) @ x [K]; qw from quantize_weight_int8 (int8) or _int4 (packed uint8)."""
    if (FOLD_SPLIT_SUMS and torch.compiler.is_compiling()
            and _gemv_splits(qw.shape[0], x.shape[0], scales.shape[1], str(x.device)) > 1):
        return torch.ops.automp.quant_gemv_partials(qw, scales, x).sum(0).to(x.dtype)
    return torch.ops.automp.quant_gemv(qw, scales, x)


def quant_gemv_rows(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """y [M, N] = a [M, K] @ dequant(qw, scales)^T for 1 <= M <= 16: the GEMV's single pass over the packed weights
    shared by a few rows (decoding a small batch), in a's dtype."""
    return torch.ops.automp.quant_gemv_rows(qw, scales, a)


def quant_planes(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """y [M, N] = a [M, K] @ dequant(qw, scales)^T for 1 <= M <= 64 on the tensor cores, each code decoded once
    (decoding a batch); K a whole number of 4-byte words of codes, groups of >= 128 (int4) / 64 (int8) codes."""
    return torch.ops.automp.quant_planes(qw, scales, a)


def quant_gemm(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """c [M, N] = a [M, K] @ dequant(qw, scales)^T, i.e. an nn.Linear with quantized weight, in a's dtype."""
    return torch.ops.automp.quant_gemm(a, qw, scales)


def int8_gemm(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
              a_zero: torch.Tensor | None = None) -> torch.Tensor:
    """sa[m] * sb[n] * (a_q - a_zero) @ b_q + bias in out_dtype; int8 operands, int32 accumulation.

    sa: [M] or [M, 1]; sb: [N] or [1, N]; a_zero: optional integer scalar or [M] zero point (asymmetric
    activations, see quantize_rowwise_int8(..., asymmetric=True)).
    """
    return torch.ops.automp.int8_gemm(a_q, b_q, sa, sb, bias, a_zero, out_dtype)


def int8_gemm_requant(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                      bias: torch.Tensor | None, out_mult: torch.Tensor, out_zero: torch.Tensor | None = None,
                      gelu: bool = False, a_zero: torch.Tensor | None = None) -> torch.Tensor:
    """int8 [M, N]: int8_gemm's output (then GELU if asked) quantized as the next layer's static input,
    clamp(round(y * out_mult) + out_zero, -127 (-128 with a zero point), 127); out_mult float32 [N] or one element
    (1 / scale, times the next layer's SmoothQuant factors), out_zero a one-element integer tensor or None."""
    return torch.ops.automp.int8_gemm_requant(a_q, b_q, sa, sb, bias, a_zero, gelu, out_mult, out_zero)


def unscale_and_check_(tensors: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiply every tensor in place by inv_scale (1-element fp32); return found_inf (1-element fp32, 1.0 if any
    element of any input was inf/nan before scaling)."""
    return torch.ops.automp.unscale_and_check_(list(tensors), inv_scale)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x converted to dtype (float32/float16/bfloat16), contiguous, round to nearest even."""
    return torch.ops.automp.cast(x, dtype)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over a static KV cache: out [B, Hq, D] = softmax(scale * q . k) . v
    over the slots where valid [B, L] (bool) is True, fp32 accumulation, in q's dtype. q [B, Hq, D]; k, v
    [B, Hkv, L, D] (transformers' StaticCache layout, any strides) with Hq a multiple of Hkv (GQA); fp16/bf16;
    D <= 256. A row with no valid slot gives zeros (SDPA would give NaN)."""
    return torch.ops.automp.decode_attention(q, k, v, valid, float(scale))
