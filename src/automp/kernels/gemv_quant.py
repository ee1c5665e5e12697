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
from automp.kernels.quant import (_CPU_SMS, _SPLIT_MIN_K, _SUM_BLOCK, _WAVES, _i8_to_f32, _split_sum_kernel,
                                  _split_tiles, _u4_to_f32, dequantize_weight, kernel_group)

_SUB = tl.constexpr(16)  # bytes of one thread's vector load, reduced in its registers and then scaled once
_MIN_SPAN = 128  # fewest K per split program: the smallest BLOCK_K below, so some config always tiles a span exactly
_SPLIT_ROWS = 32  # rows per program the split chooser counts with (a middle BLOCK_N)


def _qgemv_configs(interpret: bool = INTERPRET) -> list[triton.Config]:
    if interpret:  # BLOCK_K 64: group 32 takes the multi-group path, 64 and per-channel the one-group path
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64}, num_warps=4)]
    # No num_stages: Triton 3.6-3.9 do not software-pipeline this loop (checked in the compiled code; no tl.dot
    # consumes its loads), so the bytes in flight come from the tile size and the programs per SM (split-K), and each
    # tile of a program waits its own memory round trip. 8 x 2048: the word path's pick for the widest Llama-3-8B
    # GEMVs, a little ahead of 8 x 1024 (BENCHMARKS.md, "Kernels"). 4096 deep: a K = 4096 row in one tile, one round
    # trip per program (90 and 125 registers for sm_90, no spills).
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
            for bn, bk, w in [(16, 128, 4), (32, 128, 4), (64, 128, 4), (16, 256, 4), (32, 256, 4), (16, 512, 4),
                              (32, 512, 8), (8, 1024, 4), (16, 1024, 8), (8, 2048, 4), (8, 4096, 4), (16, 4096, 8)]]


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


# The word path: codes read as int32 words and decoded two at a time in f16x2 arithmetic. A lop3 drops a code into
# the low mantissa bits of each half of an fp16 pair whose exponent makes a mantissa step worth 1/4 (int4) or 1/128
# (int8): 0x5C00 | u is 256 + u/4, and four bits higher 0x4C00 | u << 4 is 16 + u/4; for int8, 0x4800 | (q ^ 0x80)
# is 8 + (q + 128)/128. One sub.f16x2 leaves code/4 (int4, codes -8..7) or q/128 exactly, and f16x2 multiply-adds sum
# a word's products into two halves, which go to fp32 once per word. The scaled codes are at most 2 (int4) or 1 in
# magnitude, so a half's four (two) products stay inside fp16's range whenever x does, and x is used as loaded.
# An int4 word holds k = 8i + j in nibble j, so its pairs are (k, k + 4): nibbles (0, 4) under mask 0x000F000F,
# (1, 5) under 0x00F000F0, and (2, 6), (3, 7) after a shift by 8. An int8 word pairs (k, k + 2), bytes (0, 2) and
# (1, 3). x comes as matching fp16 pairs packed in int32 ($2.. below), built from its own int32 words.
_W4_F16X2 = tl.constexpr("""{
.reg .b32 t, h0, h1, h2, h3, m0, m1, a;
.reg .f16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 m0, 0x5C085C08;
mov.b32 m1, 0x4C804C80;
lop3.b32 h0, $1, 0x000F000F, 0x5C005C00, 0xEA;
lop3.b32 h1, $1, 0x00F000F0, 0x4C004C00, 0xEA;
shr.u32 t, $1, 8;
lop3.b32 h2, t, 0x000F000F, 0x5C005C00, 0xEA;
lop3.b32 h3, t, 0x00F000F0, 0x4C004C00, 0xEA;
sub.f16x2 h0, h0, m0;
sub.f16x2 h1, h1, m1;
sub.f16x2 h2, h2, m0;
sub.f16x2 h3, h3, m1;
mul.f16x2 a, h0, $2;
fma.rn.f16x2 a, h1, $3, a;
fma.rn.f16x2 a, h2, $4, a;
fma.rn.f16x2 a, h3, $5, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")
_W8_F16X2 = tl.constexpr("""{
.reg .b32 t, h0, h1, m, a;
.reg .f16 lo, hi;
.reg .f32 flo, fhi;
mov.b32 m, 0x48804880;
lop3.b32 h0, $1, 0x00FF00FF, 0x48804880, 0x6A;
shr.u32 t, $1, 8;
lop3.b32 h1, t, 0x00FF00FF, 0x48804880, 0x6A;
sub.f16x2 h0, h0, m;
sub.f16x2 h1, h1, m;
mul.f16x2 a, h0, $2;
fma.rn.f16x2 a, h1, $3, a;
mov.b32 {lo, hi}, a;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}""")


@triton.jit
def _half(p, SHIFT: tl.constexpr):
    """The fp16 in bits [SHIFT, SHIFT + 16) of int32 p, as fp32 (the interpreter's twin of the f16x2 operands)."""
    return ((p >> SHIFT) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _code(w, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """The code in bits [SHIFT, SHIFT + BITS) of w, divided as the word path divides it (exact in fp16)."""
    if BITS == 4:
        return (((w >> SHIFT) & 15).to(tl.float32) - 8.0) * 0.25
    return ((((w >> SHIFT) & 255) ^ 128).to(tl.float32) - 128.0) * 0.0078125


@triton.jit
def _pair_dots(lo, hi):
    """Sum of the two halves' running fp16 sums, each rounded to fp16 as the f16x2 registers hold them."""
    return lo.to(tl.float16).to(tl.float32) + hi.to(tl.float16).to(tl.float32)


@triton.jit
def _word_dots(w, p0, p1, p2, p3, BITS: tl.constexpr, ASM: tl.constexpr):
    """Per int32 word of w: sum of its codes (divided as above) times x, in fp32; x as the packed pairs p_j.

    ASM: the f16x2 instructions; otherwise the same products in Triton (the interpreter has no inline assembly), so a
    CPU test checks the word layout and the x pairing that both share (int8: p2, p3 unused)."""
    if ASM:
        if BITS == 4:
            return tl.inline_asm_elementwise(_W4_F16X2, "=f,r,r,r,r,r", [w, p0, p1, p2, p3], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return tl.inline_asm_elementwise(_W8_F16X2, "=f,r,r,r", [w, p0, p1], dtype=tl.float32, is_pure=True, pack=1)
    if BITS == 4:
        lo = (_code(w, 0, 4) * _half(p0, 0) + _code(w, 4, 4) * _half(p1, 0) + _code(w, 8, 4) * _half(p2, 0)
              + _code(w, 12, 4) * _half(p3, 0))
        hi = (_code(w, 16, 4) * _half(p0, 16) + _code(w, 20, 4) * _half(p1, 16) + _code(w, 24, 4) * _half(p2, 16)
              + _code(w, 28, 4) * _half(p3, 16))
        return _pair_dots(lo, hi)
    lo = _code(w, 0, 8) * _half(p0, 0) + _code(w, 8, 8) * _half(p1, 0)
    hi = _code(w, 16, 8) * _half(p0, 16) + _code(w, 24, 8) * _half(p1, 16)
    return _pair_dots(lo, hi)


@triton.jit
def _pairs(a, b):
    """(low half of a, low half of b) and (high half of a, high half of b), packed in int32."""
    return (a & 0xFFFF) | (b << 16), ((a >> 16) & 0xFFFF) | (b & -65536)


@triton.jit
def _tile_sums_words(q_words, x_words, t, KW, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, ASM: tl.constexpr):
    """_tile_sums on the word path (q_words: the rows' int32 pointers, KW words per row; x_words: x as int32, two
    fp16 each): [BLOCK_N, bytes per tile row // 16] fp32, one sum per 16-byte sub-block (4 words)."""
    XW: tl.constexpr = 16 // BITS  # x words per code word
    W: tl.constexpr = BLOCK_K * BITS // 32
    rw = t * W + tl.arange(0, W)
    rx = rw[:, None] * XW + tl.arange(0, XW)[None, :]
    if EVEN_K:
        w = tl.load(q_words + rw[None, :])
        xw = tl.load(x_words + rx)
    else:  # K is a whole number of words here, so word masks are exact; x is 0 past K
        w = tl.load(q_words + rw[None, :], mask=(rw < KW)[None, :], other=0)
        xw = tl.load(x_words + rx, mask=rx < KW * XW, other=0)
    if BITS == 4:
        ac, bd = tl.split(tl.reshape(xw, (W, 2, 2)))  # x words (0, 2) and (1, 3): x_(0,1), x_(4,5); x_(2,3), x_(6,7)
        a, c = tl.split(ac)
        b, d = tl.split(bd)
        p0, p1 = _pairs(a, c)
        p2, p3 = _pairs(b, d)
    else:
        a, b = tl.split(xw)
        p0, p1 = _pairs(a, b)
        p2, p3 = p0, p1
    dots = _word_dots(w, p0[None, :], p1[None, :], p2[None, :], p3[None, :], BITS, ASM)
    return tl.sum(tl.reshape(dots, (BLOCK_N, W // 4, 4)), axis=2) * (4.0 if BITS == 4 else 128.0)


@triton.autotune(configs=_qgemv_configs(), key=["N", "K", "K_SPAN", "GROUP", "BITS", "WORDS", "ASM"],
                 prune_configs_by={"early_config_prune": _qgemv_prune})
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit
def _wq_gemv_kernel(q_ptr, s_ptr, x_ptr, out_ptr, N, K, KP, K_SPAN, stride_qn, stride_qw, stride_sn, stride_xk,
                    GROUP: tl.constexpr, BITS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                    WORDS: tl.constexpr, ASM: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Program (i, j): rows [i * BLOCK_N, +BLOCK_N), K range [j * K_SPAN, +K_SPAN) in whole tiles; SPLIT: write the
    fp32 partial row j of out [SPLIT_K, N], else y itself. WORDS: the word path (_tile_sums_words)."""
    pid_k = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = rn % N  # rows past N wrap to real ones (never stored), so the loads need no row mask
    q_rows = q_ptr + rows[:, None] * stride_qn
    q_words = q_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * stride_qw
    x_words = x_ptr.to(tl.pointer_type(tl.int32))
    s_rows = s_ptr + rows * stride_sn
    SUB_K: tl.constexpr = _SUB * 8 // BITS  # K per sub-block, <= MIN_GROUP: a sub-block never straddles groups
    t_lo, t_hi = _split_tiles(pid_k, K, K_SPAN, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K // SUB_K), dtype=tl.float32)
    for t in k_range(t_lo, t_hi, 1):
        # The scales are loaded after the codes' sums. Loaded first, to share the codes' memory round trip, the
        # products measured slower (BENCHMARKS.md, "Kernels": the GEMV's scale order).
        if WORDS:
            part = _tile_sums_words(q_words, x_words, t, KP // 4, BITS, BLOCK_N, BLOCK_K, EVEN_K, ASM)
        else:
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


# The single-row GEMV splits K only from here: at Llama-3-8B widths (word path; BENCHMARKS.md, "Kernels") every K = 4096
# GEMV (o, q/k/v, gate/up) ran fastest unsplit, the split's second launch costing more than its extra programs gave
# back, while K = 14336 ran fastest split. The rows kernel keeps _SPLIT_MIN_K (measured on the 1B shapes).
_GEMV_SPLIT_MIN_K = 8192


def _gemv_split(n: int, k: int, group: int, sms: int, split_k: int | None = None,
                min_k: int | None = None) -> tuple[int, int]:
    """(programs along K, K range of each) for an [N, K] GEMV.

    A range is a whole number of scale groups (so no two programs share one) and of _MIN_SPAN. The heuristic takes
    the largest power-of-two range that still gives _WAVES * sms programs with _SPLIT_ROWS-row blocks, so every
    BLOCK_K up to it tiles it exactly; N that fills the SMs alone, or K below min_k (default _SPLIT_MIN_K), gets no
    split.
    `split_k` asks for that many programs instead, as even as whole units allow (so possibly fewer).
    """
    unit = _MIN_SPAN if group >= k else max(group, _MIN_SPAN)
    if split_k is not None:
        span = triton.cdiv(triton.cdiv(k, max(split_k, 1)), unit) * unit
    elif k < (_SPLIT_MIN_K if min_k is None else min_k):
        span = k
    else:
        want = triton.cdiv(_WAVES * sms, max(1, triton.cdiv(n, _SPLIT_ROWS)))
        span = unit
        while span < k and triton.cdiv(k, 2 * span) >= want:
            span *= 2
    if span >= k:
        return 1, k
    return triton.cdiv(k, span), span


PATHS = ("bytes", "words", "f16x2")


def word_path(qw: torch.Tensor, x: torch.Tensor) -> str:
    """How a GEMV reads its codes: "f16x2" (int32 words, the f16x2 assembly) for fp16 x on the GPU, "words" (the
    same layout in plain Triton) under the interpreter, "bytes" (fp32 decoding) for bf16 x, or where words do not
    fit: K not a whole number of words (8 int4 codes, 4 int8), x strided, or rows or x not 4-byte aligned."""
    per_word = 8 if qw.dtype == torch.uint8 else 4
    if (x.dtype != torch.float16 or x.shape[0] % per_word or x.stride(0) != 1 or x.data_ptr() % 4
            or qw.stride(0) % 4 or qw.data_ptr() % 4):
        return "bytes"
    return "words" if INTERPRET else "f16x2"


def _split_plan(n: int, k: int, n_groups: int, device: torch.device,
                split_k: int | None = None) -> tuple[int, int, int]:
    """(scale group, K split, K range of each split program) of the [N, K] GEMV with n_groups scale groups on
    `device`, from shapes alone."""
    group = kernel_group(k, n_groups)
    split, span = _gemv_split(n, k, group, num_sms(device, cpu=_CPU_SMS), split_k, _GEMV_SPLIT_MIN_K)
    return group, split, span


def _plan(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, split_k: int | None = None) -> tuple[int, int, int]:
    return _split_plan(qw.shape[0], x.shape[0], scales.shape[1], x.device, split_k)


def split_count(n: int, k: int, n_groups: int, device: torch.device) -> int:
    """The K split of the [N, K] GEMV with n_groups scale groups on `device`."""
    return _split_plan(n, k, n_groups, device)[1]


def partial_count(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> int:
    """Rows of quant_gemv(..., partials=True)'s output: the K split the GEMV of this shape runs with."""
    return _plan(qw, scales, x)[1]


def reference_partials(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float32 [S, N]: row j is dequant(qw) @ x over the K range of split program j (the kernel's own ranges), what
    quant_gemv(..., partials=True) computes, for the CPU without Triton and for tests."""
    _, split, span = _plan(qw, scales, x)
    w, xf = dequantize_weight(qw, scales, x.shape[0]), x.float()
    return torch.stack([w[:, j * span:(j + 1) * span] @ xf[j * span:(j + 1) * span] for j in range(split)])


def quant_gemv(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, split_k: int | None = None,
               path: str | None = None, partials: bool = False) -> torch.Tensor:
    """y [N] = dequant(qw) @ x for x [K]; y has x's dtype. `split_k` forces the K split and `path` the int4 decoding
    (tests, sweeps; one of PATHS: "bytes", or what word_path allows).

    partials: the float32 [S, N] partial products of the S split programs (partial_count), not summed. Their sum is
    then left to the caller: in a compiled step Inductor folds it into the kernel that reads y next (a sum over a
    few rows is unrolled into its loads), which saves the split-sum kernel's launch and its gap in the CUDA graph."""
    k = x.shape[0]
    n = qw.shape[0]
    bits = 4 if qw.dtype == torch.uint8 else 8
    chosen = word_path(qw, x)
    if path is not None:
        if path not in PATHS or (path != "bytes" and chosen == "bytes") or (path == "f16x2" and INTERPRET):
            raise ValueError(f"quant_gemv: path {path!r} does not apply here (allowed: {chosen!r} or 'bytes')")
        chosen = path
    group, split, span = _plan(qw, scales, x, split_k)
    y = None if partials else torch.empty(n, dtype=x.dtype, device=x.device)
    out = torch.empty((split, n), dtype=torch.float32, device=x.device) if split > 1 or partials else y
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
    _wq_gemv_kernel[grid](qw, scales, x, out, n, k, qw.shape[1], span, qw.stride(0), qw.stride(0) // 4,
                          scales.stride(0), x.stride(0), group, bits, split > 1, WORDS=chosen != "bytes",
                          ASM=chosen == "f16x2")
    if partials:
        return out
    if split > 1:
        _split_sum_kernel[(triton.cdiv(n, _SUM_BLOCK),)](out, y, n, split, triton.next_power_of_2(split),
                                                         BLOCK=_SUM_BLOCK)
    return y
