"""Half-precision GEMV `y = W @ x` in Triton, for the skinny shapes cuBLAS handles poorly.

A GEMV reads every weight exactly once and does two flops per weight, so the only figure that matters is how close
the weight stream gets to memory bandwidth. Each program owns BLOCK_N rows and walks K in BLOCK_K tiles, keeping a
[BLOCK_N, BLOCK_K] fp32 accumulator so the (shuffle-heavy) row reduction happens once, at the end, not per tile.
When N is too small to give every SM work, K is split across programs that combine their partial sums with fp32
atomics (split-K). A batch of up to 8 right-hand sides (x [K, B]) goes through `tl.dot` on a 16-wide padded tile:
still one pass over W, with the tensor cores doing the B-fold reuse.

Launchers here assume validated inputs (ops.py checks dtypes, shapes and devices).
"""
from __future__ import annotations

import functools
import operator
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The interpreter's tl.dot multiplies bf16 operands as their raw uint16 bits; upcasting there (only there) keeps the
# CPU tests meaningful for everything but the tensor-core instruction itself.
_DOT_UPCAST = tl.constexpr(INTERPRET)


def _host_int(v: object) -> int:
    """A loop bound as a Python int; the interpreter holds runtime scalars as 1-element numpy arrays."""
    return int(v.handle.data.reshape(())) if isinstance(v, tl.tensor) else operator.index(v)


def _interpreted_range(start: object, stop: object, step: object) -> range:
    """The interpreter's loop over runtime bounds. Triton 3.6's interpreter converts a scalar to a loop bound with
    int(1-element array), which numpy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python
    scalars"); 3.9 squeezes the array first. Converting here works under both."""
    return range(_host_int(start), _host_int(stop), _host_int(step))


# Loops with runtime bounds use k_range: compiled, it is tl.range, which builds the same scf.for as a plain range()
# (so the GPU code and its software pipelining are unchanged); interpreted, it is the conversion above.
k_range = _interpreted_range if INTERPRET else tl.range


@triton.jit
def half_dot(a, b, acc):
    """acc + a @ b for fp16/bf16 tiles, fp32 accumulation."""
    if _DOT_UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device, cpu: int = 4) -> int:
    """Streaming multiprocessors of `device`; on a CPU (the interpreter), `cpu`: what a caller's heuristic should
    assume there."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu


def _vec_configs() -> list[triton.Config]:
    if INTERPRET:  # the interpreter would "autotune" by running every config on the CPU
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in [(8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 4, 2), (16, 512, 8, 3),
                                 (32, 256, 4, 3), (32, 256, 8, 3), (64, 128, 4, 3), (32, 512, 8, 2),
                                 (8, 1024, 4, 2), (16, 1024, 8, 2)]]


def _batched_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=4)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
            for bn, bk, w, s in [(16, 256, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
                                 (128, 128, 8, 3)]]


@triton.autotune(configs=_vec_configs(), key=["N", "K", "SPLIT_K"], reset_to_zero=["y_ptr"])
@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, N, K, stride_wn, stride_wk, stride_xk,
                 SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in k_range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :] * stride_wk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + rk * stride_xk, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.atomic_add(y_ptr + rn, y, mask=n_mask)


@triton.autotune(configs=_batched_configs(), key=["N", "K", "B", "SPLIT_K"], reset_to_zero=["y_ptr"])
@triton.jit
def _gemv_batched_kernel(w_ptr, x_ptr, y_ptr, N, K, B, stride_wn, stride_wk, stride_xk, stride_xb,
                         SPLIT_K: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rb = tl.arange(0, BLOCK_B)
    n_mask = rn < N
    b_mask = rb < B
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
    for k0 in k_range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :] * stride_wk,
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + rk[:, None] * stride_xk + rb[None, :] * stride_xb,
                    mask=k_mask[:, None] & b_mask[None, :], other=0.0)
        acc = half_dot(w, x.to(w.dtype), acc)
    y_offs = rn[:, None] * B + rb[None, :]  # y is a fresh contiguous [N, B]
    y_mask = n_mask[:, None] & b_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tl.atomic_add(y_ptr + y_offs, acc, mask=y_mask)


def split_k_for(n: int, k: int, device: torch.device) -> int:
    """Split K only when 16-row programs would leave most SMs idle (< a quarter busy); then aim at ~2 waves.

    Graph-timed, a GEMV with about half the SMs' worth of 16-row programs ran no faster split than unsplit, because the
    split's fp32 buffer, memset and final cast cost more than the idle SMs gave back; so the threshold sits well
    below that.
    """
    rows = triton.cdiv(n, 16)
    sms = num_sms(device)
    if 4 * rows >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, rows), k // 512, 32))


def gemv(w: torch.Tensor, x: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """y = w @ x for w [N, K] and x [K] or [K, B] (B <= 8); output dtype = w.dtype, fp32 accumulation.

    `split_k` overrides the heuristic (tests use it to reach the atomic path on tiny shapes).
    """
    n, k = w.shape
    split = split_k or split_k_for(n, k, w.device)
    acc_dtype = torch.float32 if split > 1 else w.dtype
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
    if x.dim() == 1:
        y = (torch.zeros if split > 1 else torch.empty)(n, dtype=acc_dtype, device=w.device)
        _gemv_kernel[grid](w, x, y, n, k, w.stride(0), w.stride(1), x.stride(0), SPLIT_K=split)
    else:
        b = x.shape[1]
        y = (torch.zeros if split > 1 else torch.empty)((n, b), dtype=acc_dtype, device=w.device)
        _gemv_batched_kernel[grid](w, x, y, n, k, b, w.stride(0), w.stride(1), x.stride(0), x.stride(1),
                                   SPLIT_K=split, BLOCK_B=16)
    return y.to(w.dtype) if split > 1 else y
