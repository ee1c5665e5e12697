"""Split-KV ("flash decoding") attention for one new query token per sequence over a static KV cache, in Triton.

A decode step attends one query per head to every cached token, so attention is a stream over the K/V cache with a
handful of flops per byte; what decides its speed is how many of the cache's bytes are read and how many SMs read
them. The general attention paths spend both badly at batch 1: they repeat each KV head for its group of query heads
(GQA) before a kernel built for long query blocks, and they read the whole static cache, max_len slots, whatever the
current position.

Here one program owns one (sequence, KV head) pair and loads the G query heads that share that KV head once, as a
[BLOCK_G, BLOCK_D] tile (G padded to 16 rows so that q @ k^T and p @ v are tensor-core dots; the padding costs
arithmetic, not memory traffic). Its K/V tiles of BLOCK_L slots are read once for all G heads. A tile whose
`valid` entries are all False is skipped before its K/V are loaded: the unreached tail of a static cache costs one
small mask load per tile. The cache's L axis is also split across programs (grid (B * Hkv, S)) so that a single
sequence fills the SMs. Split s takes tiles s, s + S, s + 2S, ... rather than one contiguous span: the valid slots
of a static cache are a prefix (or a left-padded window) that may be far shorter than L, and interleaved tiles spread
that prefix over all S programs instead of handing it whole to the first few.

Each program runs an online softmax in fp32 (running max m, running sum l, accumulator acc, all in log2 units: the
scores are pre-multiplied by scale * log2(e) and exponentiated with exp2). The probabilities enter the p @ v dot in
the cache's dtype; for bf16 a second dot adds what that rounding dropped (the memory stream hides the extra
arithmetic), so bf16 outputs are as close as fp32 accumulation and the output rounding allow. Each program writes
m, l, acc to fp32 scratch; a second small kernel merges the S partials of each (sequence, query head) in a fixed
order, so the result is deterministic. A row with no valid slot comes out as zeros (SDPA would give NaN).

Launchers here assume validated inputs (ops.py checks dtypes, shapes and devices).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from automp.kernels.gemm import INTERPRET
from automp.kernels.gemv import half_dot, k_range, num_sms

MAX_D = 256  # head dims up to here (any size, masked to the next power of two); larger ones would spill registers
_BLOCK_G = 16  # query heads per program, padded: the smallest M of a tensor-core dot
_WAVES = 2  # programs per SM the split chooser aims at: every SM busy, with a second program to hide the tail
_MAX_SPLITS = 64  # bounds the fp32 scratch and the merge's loop over its _CHUNK_S-row chunks
_CHUNK_S = 16
_LOG2E = 1 / math.log(2)


def block_l(d: int) -> int:
    """Slots per K/V tile: 64 (32 for head dims past 128, whose tiles are already as large), 16 in the interpreter
    so that the CPU tests' short caches still span several tiles and splits."""
    if INTERPRET:
        return 16
    return 64 if d <= 128 else 32


def splits_for(b: int, hkv: int, head_blocks: int, l: int, tile: int, sms: int) -> int:
    """Programs along L per (sequence, KV head): enough for _WAVES programs per SM, but no more than the cache has
    tiles (each program gets at least one) nor _MAX_SPLITS."""
    programs = max(1, b * hkv * head_blocks)
    return max(1, min(triton.cdiv(_WAVES * sms, programs), triton.cdiv(l, tile), _MAX_SPLITS))


@triton.jit
def _decode_attention_split(q_ptr, k_ptr, v_ptr, valid_ptr, m_ptr, l_ptr, acc_ptr, qk_scale, L, HKV, SPLITS,
                  stride_qb, stride_qh, stride_qd, stride_kb, stride_kh, stride_kl, stride_kd,
                  stride_vb, stride_vh, stride_vl, stride_vd, stride_mb, stride_ml,
                  G: tl.constexpr, D: tl.constexpr, HEAD_BLOCKS: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program (i, s): sequence b, KV head h and query heads h * G + [j * BLOCK_G, +BLOCK_G) for i = (b * HKV + h) *
    HEAD_BLOCKS + j; tiles s, s + SPLITS, ... of L. Writes its fp32 m, l [B, Hq, SPLITS] and acc [B, Hq, SPLITS, D]."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    j = pid % HEAD_BLOCKS
    bh = pid // HEAD_BLOCKS
    b = bh // HKV
    h = bh % HKV
    rg = j * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = rg < G
    heads = h * G + rg
    rd = tl.arange(0, BLOCK_D)
    d_mask = rd < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + rd[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    b64 = b.to(tl.int64)  # a whole static cache can pass 2^31 elements
    k_base = k_ptr + b64 * stride_kb + h * stride_kh + rd[None, :] * stride_kd
    v_base = v_ptr + b64 * stride_vb + h * stride_vh + rd[None, :] * stride_vd
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for t in k_range(split, tl.cdiv(L, BLOCK_L), SPLITS):
        rl = t * BLOCK_L + tl.arange(0, BLOCK_L)
        ok = tl.load(valid_ptr + b * stride_mb + rl * stride_ml, mask=rl < L, other=0) != 0
        if tl.max(ok.to(tl.int32), axis=0) > 0:  # an all-False tile (the unreached cache) loads no K/V
            kv_mask = ok[:, None] & d_mask[None, :]  # invalid slots read as 0: stale or NaN contents never count
            k = tl.load(k_base + rl[:, None] * stride_kl, mask=kv_mask, other=0.0)
            s = half_dot(q, tl.trans(k), tl.zeros((BLOCK_G, BLOCK_L), tl.float32)) * qk_scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the tile has a valid slot
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + rl[:, None] * stride_vl, mask=kv_mask, other=0.0)
            p_hi = p.to(v.dtype)
            acc = half_dot(p_hi, v, acc * alpha[:, None])
            if v.dtype == tl.bfloat16:  # bf16 keeps 8 bits of p; its remainder restores fp16-like precision
                acc = half_dot((p - p_hi.to(tl.float32)).to(v.dtype), v, acc)
            m_i = m_new
    rows = (b * HKV * G + heads) * SPLITS + split  # row of the [B * Hq * SPLITS] partials
    tl.store(m_ptr + rows, m_i, mask=g_mask)
    tl.store(l_ptr + rows, l_i, mask=g_mask)
    tl.store(acc_ptr + rows[:, None] * D + rd[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_attention_combine(m_ptr, l_ptr, acc_ptr, out_ptr, SPLITS, D: tl.constexpr, BLOCK_S: tl.constexpr,
                    CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s for row r = b * Hq + head, M = max_s m_s; zeros when
    no split saw a valid slot (every m_s = -inf, l_s = 0). Chunks and their sums run in a fixed order."""
    r = tl.program_id(0)
    rs = tl.arange(0, BLOCK_S)
    m_max = tl.max(tl.load(m_ptr + r * SPLITS + rs, mask=rs < SPLITS, other=float("-inf")), axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # an empty row: every weight below is exp2(-inf) = 0
    rd = tl.arange(0, BLOCK_D)
    d_mask = rd < D
    o = tl.zeros((BLOCK_D,), tl.float32)
    total = tl.zeros((CHUNK_S,), tl.float32)
    for c in tl.static_range(0, BLOCK_S, CHUNK_S):
        rc = c + tl.arange(0, CHUNK_S)
        c_mask = rc < SPLITS
        rows = r * SPLITS + rc
        w = tl.exp2(tl.load(m_ptr + rows, mask=c_mask, other=float("-inf")) - m_max)
        total += w * tl.load(l_ptr + rows, mask=c_mask, other=0.0)
        part = tl.load(acc_ptr + rows[:, None] * D + rd[None, :], mask=c_mask[:, None] & d_mask[None, :], other=0.0)
        o += tl.sum(part * w[:, None], axis=0)
    denom = tl.sum(total, axis=0)
    o = tl.where(denom > 0, o / tl.where(denom > 0, denom, 1.0), 0.0)
    tl.store(out_ptr + r * D + rd, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
                     splits: int | None = None) -> torch.Tensor:
    """out [B, Hq, D] = softmax(scale * q . k over the valid slots) . v for q [B, Hq, D], k/v [B, Hkv, L, D] (any
    strides), valid bool [B, L]; zeros for a row with no valid slot. `splits` overrides the chooser (tests)."""
    b, hq, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = hq // hkv
    head_blocks = triton.cdiv(g, _BLOCK_G)
    tile = block_l(d)
    s = splits or splits_for(b, hkv, head_blocks, length, tile, num_sms(q.device))
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    m = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
    acc = torch.empty((b, hq, s, d), dtype=torch.float32, device=q.device)
    mask = valid.view(torch.uint8)  # the same bytes (any strides), loaded as bytes and compared with 0
    block_d = max(16, triton.next_power_of_2(d))
    _decode_attention_split[(b * hkv * head_blocks, s)](
        q, k, v, mask, m, lse, acc, scale * _LOG2E, length, hkv, s, *q.stride(), *k.stride(), *v.stride(),
        *mask.stride(), G=g, D=d, HEAD_BLOCKS=head_blocks, BLOCK_G=_BLOCK_G, BLOCK_D=block_d, BLOCK_L=tile,
        num_warps=4)
    _decode_attention_combine[(b * hq,)](m, lse, acc, out, s, D=d, BLOCK_S=max(_CHUNK_S, triton.next_power_of_2(s)),
                               CHUNK_S=_CHUNK_S, BLOCK_D=block_d, num_warps=4)
    return out


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """The same attention in float32 torch (the CPU path without the interpreter): invalid slots are masked out of
    the scores and zeroed in v (so stale or NaN cache contents never count), an empty row gives zeros."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    keep = valid[:, None, None, :]  # [B, 1, 1, L]
    qf = q.float().reshape(b, hkv, hq // hkv, d)
    scores = (qf @ k.float().transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))  # [B, Hkv, G, L]
    top = scores.amax(dim=-1, keepdim=True)
    p = (scores - top.masked_fill(top == float("-inf"), 0.0)).exp()
    denom = p.sum(dim=-1, keepdim=True)
    vf = v.float().masked_fill(~valid[:, None, :, None], 0.0)
    out = (p @ vf) / denom.masked_fill(denom == 0, 1.0)
    return out.reshape(b, hq, d).to(q.dtype)

