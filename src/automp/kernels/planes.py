"""Weight-only W4A16 / W8A16 product for a decode batch (1..64 rows) on the tensor cores, each code decoded once.

y [M, N] = a [M, K] @ dequant(qw, scales)^T, in the layout of automp.kernels.quant. A batch of 8-32 sequences is
still a weight stream (2 * M flops per weight), so the kernel's speed is how cheaply each weight byte turns into a
tensor-core operand:
- the rows kernel (quant_batched) multiplies on the CUDA cores, M fp32 multiply-adds per weight;
- the tiled GEMM (quant.quant_gemm) decodes bytes and interleaves the two nibbles of each byte back into K order
  (a join and a transpose: a register shuffle per tile).
This kernel reads the codes as int32 words and never reorders them. Nibble (int4) or byte (int8) P of every word
forms a "plane": the codes k = word * C + P, C codes per word. A plane is a [BLOCK_N, words] operand as loaded, and
the activations it meets are the columns k = word * C + P of `a`, split out of one contiguous load of the tile (each
thread holds C consecutive values, so the split moves nothing between threads). The K-tile's product is then the sum
of C small dots, one per plane, so no code moves from where the load put it.

Decoding (exact): a code u is dropped into the mantissa of an fp16 whose exponent makes a mantissa step worth 1
(0x6400 | u is 1024 + u), and one subtraction leaves the signed code. On the GPU with fp16 activations this runs in
f16x2 inline assembly, two codes per lop3 and one sub.f16x2:
- int4 decodes two neighbouring words at once: two prmt pair their low and their high halves, and each lop3 then
  yields one plane's codes of both words, which are K-neighbours in the plane operand, so the register is already
  the MMA fragment's pair. Decoding two planes of one word instead needs a PRMT per pair to repack them (399 against
  350 loop instructions per warp and K-tile in the sm_90 SASS; the products ran 1-11% faster, BENCHMARKS.md).
- int8 decodes bytes P and P + 2 of a word under one mask 0x00FF00FF.
The interpreter has no inline assembly; it runs the same planes in plain Triton. bf16 activations decode through
fp32 (0x4B000000 | u is 2^23 + u), in plain Triton on the GPU too.

The weights are the dot's first operand (out^T [BLOCK_N, M] = planes @ a-columns), so a decoded plane stays in
the registers it was decoded in; the batch (padded to 16, tl.dot's least) is the dot's N side. On Hopper the
configs of 1-2 warps won at Llama-3-8B shapes (BENCHMARKS.md, "Kernels"): Triton gives them mma.sync, which runs the
eight small dots of a tile back to back, where its wgmma (4+ warps) waited for each before the next. A K-tile lies
inside one scale group, so each tile's dot is scaled once per weight row. K is split across programs as in quant_gemm,
fitted to one wave of resident programs and to even ranges (`_planes_split`), fp32 partials summed in a fixed order
by `quant._split_sum_kernel`.
"""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from automp.kernels.gemm import INTERPRET
from automp.kernels.gemv import half_dot, k_range, num_sms
from automp.kernels.quant import (_CPU_SMS, _SPLIT_TILE_N, _SUM_BLOCK, _gemm_split, _split_sum_kernel, _split_tiles,
                                  _split_unit, kernel_group)

MAX_ROWS = 64
# Programs the K split aims at, in SM counts (the tiled GEMM aims at 2). Forced splits at Llama-3-8B shapes
# (BENCHMARKS.md, "Kernels"): the narrow products (o, down) ran fastest in about 8 programs along K, ahead of
# the GEMM's choice, which 4 waves of 64-row tiles give.
_WAVES = 4
# Programs of 64-wide tiles one SM holds at once, by padded batch: the least over the offered 64-wide configs and
# both bit widths, from their sm_90 registers and shared memory (tests/kernels/test_planes.py recomputes it).
_RESIDENT = {16: 5, 32: 4, 64: 2}
_MIN_DOT = 16  # tl.dot's least size along each dimension: the batch is padded to it, and a plane has >= 16 words


def _configs(interpret: bool = INTERPRET) -> list[triton.Config]:
    if interpret:  # one config per bit width (the prune keeps the one whose planes are 16 words deep)
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": bk, "PREFETCH_S": True}, num_warps=4) for bk in (64, 128)]
    # The configs that won some Llama-3-8B product at 8 or 32 rows, int4 and int8, each with and without the scales
    # loaded a tile ahead (PREFETCH_S): the autotuner keeps whichever the device runs faster.
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "PREFETCH_S": pre}, num_warps=w, num_stages=s)
            for bn, bk, w, s in [(32, 128, 2, 3), (32, 128, 2, 4), (64, 128, 2, 3), (64, 128, 2, 4),
                                 (64, 128, 4, 3), (64, 128, 4, 4), (32, 64, 2, 4), (64, 64, 2, 4)]
            for pre in (False, True)]


def fits(config: triton.Config, args: dict) -> bool:
    """A tile inside one scale group, dividing a split's K range, whose planes are at least 16 words deep."""
    bk = config.kwargs["BLOCK_K"]
    return (bk <= args["GROUP"] and bk * args["BITS"] // 32 >= _MIN_DOT
            and (args["K_SPAN"] >= args["K"] or args["K_SPAN"] % bk == 0))


def _prune(configs: list[triton.Config], nargs: dict, **kw: object) -> list[triton.Config]:
    fit = [c for c in configs if fits(c, {**nargs, **kw})]
    return fit[:1] if INTERPRET else fit


def unsupported(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> str | None:
    """Why this kernel cannot compute a @ dequant(qw, scales)^T (one line), or None where it can: it reads whole
    4-byte words of codes and needs planes 16 words deep inside one scale group. Shapes, dtypes and strides only
    (fake tensors have no address); `misaligned` checks the addresses."""
    m, k = a.shape
    bits = 4 if qw.dtype == torch.uint8 else 8
    per_word = 32 // bits
    if not 1 <= m <= MAX_ROWS:
        return f"a has {m} rows, outside 1..{MAX_ROWS}"
    if a.dtype not in (torch.float16, torch.bfloat16):
        return f"activations are {a.dtype}, not float16 or bfloat16"
    if k % per_word:
        return f"K={k} is not a whole number of {per_word}-code words"
    if qw.stride(0) % 4:
        return "the packed weight rows are not a whole number of 4-byte words apart"
    if kernel_group(k, scales.shape[1]) < _MIN_DOT * per_word:
        return f"scale groups are shorter than {_MIN_DOT * per_word} codes"
    return None


def misaligned(qw: torch.Tensor) -> bool:
    return qw.data_ptr() % 4 != 0


def _planes_asm(mask: str, magic: str, lut: str, bias: str) -> tl.constexpr:
    """Two planes per lop3 (codes under `mask`, combined with the fp16 exponent bits `magic` by `lut`), signed by one
    sub.f16x2 of `bias`. $0, $1: the two planes' fp16 codes; $2: the shifted word."""
    return tl.constexpr(f"""{{
.reg .b32 t, m;
mov.b32 m, {bias};
lop3.b32 t, $2, {mask}, {magic}, {lut};
sub.f16x2 t, t, m;
mov.b32 {{$0, $1}}, t;
}}""")


# int8: bytes (P, P + 2) of w >> 8P, whose XOR with 0x80 makes the stored two's-complement byte q + 128:
# ((w & 0xFF) ^ 0x6480) - 1152 = q.
_W8_PLANES = _planes_asm("0x00FF00FF", "0x64806480", "0x6A", "0x64806480")
# int4, words $8 and $9 (neighbours along K): t0 holds their low halves, t1 their high halves; output $P is plane P of
# both, nibble P % 4 of t(P // 4) under the mask 0x000F000F: (u | 0x6400) - 1032 = u - 8.
_W4_WORD_PAIRS = tl.constexpr("""{
.reg .b32 t0, t1, s, m;
mov.b32 m, 0x64086408;
prmt.b32 t0, $8, $9, 0x5410;
prmt.b32 t1, $8, $9, 0x7632;
""" + "".join(f"""{'' if p % 4 == 0 else f"shr.u32 s, t{p // 4}, {4 * (p % 4)};"}
lop3.b32 ${p}, {f"t{p // 4}" if p % 4 == 0 else "s"}, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 ${p}, ${p}, m;
""" for p in range(8)) + "}")


@triton.jit
def _plane(w, P: tl.constexpr, BITS: tl.constexpr, A_FP16: tl.constexpr):
    """The signed codes of nibble / byte P of every word of w, exactly, in the activation dtype."""
    if BITS == 4:
        u = (w >> (4 * P)) & 15  # stored as code + 8
        if A_FP16:
            c = (u | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
        else:
            c = ((u | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0).to(tl.bfloat16)
    else:
        u = ((w >> (8 * P)) & 255) ^ 128  # q + 128
        if A_FP16:
            c = (u | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0
        else:
            c = ((u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0).to(tl.bfloat16)
    return c


@triton.jit
def _plane_pair(w, P: tl.constexpr, BITS: tl.constexpr, A_FP16: tl.constexpr, ASM: tl.constexpr):
    """Planes P and P + C/2 (C codes per word)."""
    HALF: tl.constexpr = 16 // BITS
    if ASM:
        tl.static_assert(BITS == 8, "int4's assembly decodes word pairs (_tile_dot), not plane pairs")
        lo, hi = tl.inline_asm_elementwise(_W8_PLANES, "=h,=h,r", [w >> (BITS * P)], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=1)
    else:
        lo = _plane(w, P, BITS, A_FP16)
        hi = _plane(w, P + HALF, BITS, A_FP16)
    return lo, hi


@triton.jit
def _pair_dot(w, P: tl.constexpr, x_lo, x_hi, part, BITS: tl.constexpr, A_FP16: tl.constexpr, ASM: tl.constexpr):
    """part + planes P and P + C/2 of w times their activation columns x_lo, x_hi [M_P2, words]."""
    lo, hi = _plane_pair(w, P, BITS, A_FP16, ASM)
    part = half_dot(lo, tl.trans(x_lo), part)
    return half_dot(hi, tl.trans(x_hi), part)


@triton.jit
def _tile_dot(w, x, part, BITS: tl.constexpr, A_FP16: tl.constexpr, ASM: tl.constexpr, M_P2: tl.constexpr,
              W: tl.constexpr):
    """part + one K-tile's unscaled product: words w [BLOCK_N, W] against x [M_P2, W * C] as loaded (contiguous,
    C values per thread). x's planes are split out of each thread's registers: k = word * C + P, with P's bits
    as trailing size-2 dimensions (int4: P = 4 * b2 + 2 * b1 + b0), so no value moves between threads."""
    if BITS == 4:
        e, o = tl.split(tl.reshape(x, (M_P2, W, 2, 2, 2)))  # b0: even P, odd P
        e0, e1 = tl.split(e)
        o0, o1 = tl.split(o)
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        if ASM:
            p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
                _W4_WORD_PAIRS, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
            part = half_dot(p0, tl.trans(x0), part)
            part = half_dot(p1, tl.trans(x1), part)
            part = half_dot(p2, tl.trans(x2), part)
            part = half_dot(p3, tl.trans(x3), part)
            part = half_dot(p4, tl.trans(x4), part)
            part = half_dot(p5, tl.trans(x5), part)
            part = half_dot(p6, tl.trans(x6), part)
            part = half_dot(p7, tl.trans(x7), part)
        else:
            part = _pair_dot(w, 0, x0, x4, part, BITS, A_FP16, ASM)
            part = _pair_dot(w, 1, x1, x5, part, BITS, A_FP16, ASM)
            part = _pair_dot(w, 2, x2, x6, part, BITS, A_FP16, ASM)
            part = _pair_dot(w, 3, x3, x7, part, BITS, A_FP16, ASM)
    else:
        e, o = tl.split(tl.reshape(x, (M_P2, W, 2, 2)))
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        part = _pair_dot(w, 0, x0, x2, part, BITS, A_FP16, ASM)
        part = _pair_dot(w, 1, x1, x3, part, BITS, A_FP16, ASM)
    return part


_AUTOTUNE = dict(key=["M_P2", "N", "K", "K_SPAN", "GROUP", "BITS", "ASM"],
                 prune_configs_by={"early_config_prune": _prune})


@triton.autotune(configs=_configs(), **_AUTOTUNE)
@triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})
@triton.jit
def _wq_planes_kernel(q_ptr, s_ptr, a_ptr, out_ptr, M, N, K, K_SPAN, stride_qw, stride_sn, stride_am, stride_ak,
                      GROUP: tl.constexpr, BITS: tl.constexpr, SPLIT: tl.constexpr, M_P2: tl.constexpr,
                      A_FP16: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PREFETCH_S: tl.constexpr, EVEN_K: tl.constexpr):
    """Program (i, j): weight rows [i * BLOCK_N, +BLOCK_N) against all M rows of a over K in [j * K_SPAN, +K_SPAN);
    SPLIT: write the fp32 partial [M, N] slab j of out [SPLIT_K, M, N], else y [M, N].

    PREFETCH_S: each tile's scales are loaded one tile ahead. Triton pipelines the codes' and the activations' loads
    into shared memory (they feed the dots) but not the scales' (checked in the compiled code): loaded in the tile that
    uses them, a program waits a memory round trip per tile, with few programs per SM to cover it."""
    CPW: tl.constexpr = 32 // BITS
    W: tl.constexpr = BLOCK_K // CPW
    pid_k = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_P2)
    rows = rn % N  # weight rows past N wrap to real ones (never stored), so their loads need no mask
    q_words = q_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * stride_qw
    s_rows = s_ptr + rows * stride_sn
    a_rows = a_ptr + (rm * stride_am)[:, None]
    row_mask = (rm < M)[:, None]  # the batch's padding rows: masked, so they cost no memory traffic
    KW = K // CPW
    t_lo, t_hi = _split_tiles(pid_k, K, K_SPAN, BLOCK_K)
    acc = tl.zeros((BLOCK_N, M_P2), dtype=tl.float32)
    if PREFETCH_S:  # clamped into [0, t_hi - 1]: a valid group of every row even where the range is empty
        s_next = tl.load(s_rows + tl.maximum(tl.minimum(t_lo, t_hi - 1), 0) * BLOCK_K // GROUP)
    for t in k_range(t_lo, t_hi, 1):
        if PREFETCH_S:
            s = s_next
            s_next = tl.load(s_rows + tl.minimum(t + 1, t_hi - 1) * BLOCK_K // GROUP)
        else:
            s = tl.load(s_rows + t * BLOCK_K // GROUP)  # the tile lies in one group
        rw = t * W + tl.arange(0, W)
        if EVEN_K:
            w = tl.load(q_words + rw[None, :])
        else:  # K is whole words, so a word mask is exact; the activations past K are zero
            w = tl.load(q_words + rw[None, :], mask=(rw < KW)[None, :], other=0)
        rk = t * BLOCK_K + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(a_rows + rk[None, :] * stride_ak, mask=row_mask, other=0.0)
        else:
            x = tl.load(a_rows + rk[None, :] * stride_ak, mask=row_mask & (rk < K)[None, :], other=0.0)
        part = _tile_dot(w, x, tl.zeros((BLOCK_N, M_P2), dtype=tl.float32), BITS, A_FP16, ASM, M_P2, W)
        acc += part * s.to(tl.float32)[:, None]
    offs = rm[None, :] * N + rn[:, None]
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * M * N + offs, acc, mask=mask)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_by_prefetch: dict[bool, Any] = {}


def _tuned(prefetch: bool | None) -> Any:
    """The kernel autotuned over every config, or over those whose PREFETCH_S is `prefetch` only: what loading the
    scales a tile ahead buys where the autotuner may choose either (`automp bench kernels --parts planes`)."""
    if prefetch is None:
        return _wq_planes_kernel
    if prefetch not in _by_prefetch:
        configs = [c for c in _configs() if c.kwargs["PREFETCH_S"] is prefetch]
        _by_prefetch[prefetch] = triton.autotune(configs=configs, **_AUTOTUNE)(_wq_planes_kernel.fn)
    return _by_prefetch[prefetch]


def _planes_split(m: int, n: int, k: int, group: int, sms: int, split_k: int | None = None) -> tuple[int, int]:
    """quant._gemm_split's K split for _WAVES waves, then fitted to the SMs (forced splits at Llama-3-8B shapes,
    BENCHMARKS.md, "Kernels"):
    - at most one wave of resident programs: a split whose programs outnumber the SMs' slots runs its last ones
      alone on a few SMs after the rest (down, 32 rows: 9 splits of 13 tiles, 576 programs on 528 slots, ran slower
      than 8 of 14);
    - even ranges: where one split fewer divides K's tiles, it takes that, so no program ends early (down: 8 ranges
      of 14 tiles, not 9 of 13 with one of 8).
    `split_k` forces the split as in _gemm_split."""
    if split_k is None:
        target, _ = _gemm_split(m, n, k, group, sms, None, _WAVES)
        if target == 1:
            return 1, k
        tiles = triton.cdiv(n, _SPLIT_TILE_N)
        slots = _RESIDENT[max(_MIN_DOT, triton.next_power_of_2(m))] * sms
        units = triton.cdiv(k, _split_unit(k, group))
        split_k = max(1, min(target, slots // tiles))
        if units % split_k and split_k > 1 and units % (split_k - 1) == 0:
            split_k -= 1
    return _gemm_split(m, n, k, group, sms, split_k)


def quant_planes(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor, split_k: int | None = None,
                 asm: bool | None = None, prefetch: bool | None = None) -> torch.Tensor:
    """y [M, N] = a [M, K] @ dequant(qw, scales)^T in a's dtype (inputs validated by ops.py; `a` may have any
    strides). `split_k` forces the K split; `asm` forces the decoding (default: the f16x2 assembly for fp16 on the
    GPU, plain Triton otherwise); `prefetch` forces PREFETCH_S (on a GPU autotuned among the configs that have it);
    all for tests and sweeps."""
    why = unsupported(qw, scales, a) or ("the packed weights do not start on a 4-byte boundary" if misaligned(qw)
                                         else None)
    if why is not None:
        raise ValueError(f"automp.kernels.quant_planes: {why}")
    m, k = a.shape
    n = qw.shape[0]
    bits = 4 if qw.dtype == torch.uint8 else 8
    fp16 = a.dtype == torch.float16
    use_asm = fp16 and not INTERPRET if asm is None else asm
    if use_asm and (INTERPRET or not fp16):
        raise ValueError("automp.kernels.quant_planes: the f16x2 decoding needs fp16 activations on the GPU")
    group = kernel_group(k, scales.shape[1])
    split, span = _planes_split(m, n, k, group, num_sms(a.device, cpu=_CPU_SMS), split_k)
    y = torch.empty((m, n), dtype=a.dtype, device=a.device)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)  # noqa: E731
    args = (qw, scales, a, out, m, n, k, span, qw.stride(0) // 4, scales.stride(0), a.stride(0), a.stride(1), group,
            bits, split > 1, max(_MIN_DOT, triton.next_power_of_2(m)), fp16, use_asm)
    if INTERPRET:  # one fitting config, launched past the autotuner: Triton 3.6's benchmarks even a single pruned
        # config, which needs a GPU driver the interpreter does not have
        config = _prune(_configs(), {"GROUP": group, "BITS": bits, "K_SPAN": span, "K": k})[0]
        kwargs = {**config.kwargs, **({} if prefetch is None else {"PREFETCH_S": prefetch})}
        _wq_planes_kernel.fn[grid(kwargs)](*args, **kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        _tuned(prefetch)[grid](*args)
    if split > 1:  # the [SPLIT, M, N] partials are [SPLIT, M * N] to the column-sum kernel
        _split_sum_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](out, y, m * n, split, triton.next_power_of_2(split),
                                                             BLOCK=_SUM_BLOCK)
    return y
