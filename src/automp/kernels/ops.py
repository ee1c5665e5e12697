"""The automp kernels as torch custom ops (namespace `automp`): validation, fake impls, device dispatch.

Registering through torch.library makes each kernel one opaque node that Dynamo / AOTAutograd / torch.export can
trace (the fake impl gives shapes and dtypes without running anything) and that graphs of other automp parts can
call as `torch.ops.automp.<name>`. Every op validates its inputs in one place, shared by the real and the fake impl,
so a bad call fails the same way eagerly and at trace time.

Dispatch: CUDA tensors run the Triton kernel; CPU tensors run it through the Triton interpreter when
TRITON_INTERPRET=1 was set before automp.kernels was imported, and otherwise a float32/int64 torch reference
(same accumulation precision as the kernel, so results agree within rounding).
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from automp.kernels import gemm as _gemm
from automp.kernels import gemv as _gemv
from automp.kernels import int8_gemm as _int8
from automp.kernels import quant as _quant
from automp.kernels import quant_batched as _quant_batched
from automp.kernels import planes as _planes
from automp.kernels import gemv_quant as _gemv_quant
from automp.kernels import reduce as _reduce
from automp.kernels import decode_attention as _decode_attention
from automp.kernels.gemv import INTERPRET

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_GEMV_BATCH = 8


def use_triton(t: torch.Tensor) -> bool:
    """Whether `t` runs through Triton (GPU, or CPU under the interpreter) rather than the torch reference."""
    return t.is_cuda or (t.device.type == "cpu" and INTERPRET)


def _require(ok: bool, op: str, msg: str, exc: type[Exception] = ValueError) -> None:
    if not ok:
        raise exc(f"automp.kernels.{op}: {msg}")


def _same_device(op: str, *ts: torch.Tensor | None) -> None:
    devs = {t.device for t in ts if t is not None}
    _require(len(devs) == 1, op, f"all tensors must be on one device, got {sorted(map(str, devs))}")


def _check_half(op: str, name: str, t: torch.Tensor) -> None:
    _require(t.dtype in HALF, op, f"{name} must be float16 or bfloat16, got {t.dtype}", TypeError)


# ----------------------------------------------------------------------------------------------- gemv / gemm
def _check_gemv(w: torch.Tensor, x: torch.Tensor) -> None:
    _check_half("gemv", "w", w)
    _require(x.dtype == w.dtype, "gemv", f"x dtype {x.dtype} must match w dtype {w.dtype}", TypeError)
    _require(w.dim() == 2, "gemv", f"w must be [N, K], got shape {tuple(w.shape)}")
    _require(x.dim() in (1, 2) and x.shape[0] == w.shape[1], "gemv",
             f"x must be [K] or [K, B] with K={w.shape[1]}, got shape {tuple(x.shape)}")
    _require(x.dim() == 1 or 1 <= x.shape[1] <= MAX_GEMV_BATCH, "gemv",
             f"batch B must be in 1..{MAX_GEMV_BATCH} (use gemm beyond), got x shape {tuple(x.shape)}")
    _same_device("gemv", w, x)


@custom_op("automp::gemv", mutates_args=())
def gemv_op(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _check_gemv(w, x)
    if use_triton(w):
        return _gemv.gemv(w, x)
    return (w.float() @ x.float()).to(w.dtype)


@gemv_op.register_fake
def _(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _check_gemv(w, x)
    return w.new_empty((w.shape[0],) + tuple(x.shape[1:]))


def _check_gemm(a: torch.Tensor, b: torch.Tensor) -> None:
    _check_half("gemm", "a", a)
    _require(b.dtype == a.dtype, "gemm", f"b dtype {b.dtype} must match a dtype {a.dtype}", TypeError)
    _require(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0], "gemm",
             f"expected a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    _same_device("gemm", a, b)


@custom_op("automp::gemm", mutates_args=())
def gemm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_gemm(a, b)
    if use_triton(a) and a.numel() and b.numel():  # empty operands: the reference handles them
        return _gemm.gemm(a, b)
    return (a.float() @ b.float()).to(a.dtype)


@gemm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    _check_gemm(a, b)
    return a.new_empty((a.shape[0], b.shape[1]))


# ----------------------------------------------------------------------------------------------- weight-only
def _check_quant(op: str, qw: torch.Tensor, scales: torch.Tensor, act: torch.Tensor, k: int) -> None:
    _check_half(op, "activations", act)
    _require(qw.dtype in (torch.int8, torch.uint8), op,
             f"qw must be int8 (W8) or uint8 (packed W4), got {qw.dtype}", TypeError)
    _require(scales.dtype in FLOATS, op, f"scales must be a float tensor, got {scales.dtype}", TypeError)
    _require(qw.dim() == 2 and qw.is_contiguous(), op,
             f"qw must be a contiguous [N, K] (or [N, ceil(K/2)] packed) tensor, got shape {tuple(qw.shape)} "
             f"strides {qw.stride()}")
    packed_k = (k + 1) // 2 if qw.dtype == torch.uint8 else k
    _require(qw.shape[1] == packed_k, op, f"qw {tuple(qw.shape)} does not match K={k} ({qw.dtype} layout)")
    _require(scales.dim() == 2 and scales.shape[0] == qw.shape[0], op,
             f"scales must be [N, n_groups] with N={qw.shape[0]}, got {tuple(scales.shape)}")
    _quant.kernel_group(k, scales.shape[1])  # raises on a group count no supported group size produces
    _same_device(op, qw, scales, act)


def _reference_product(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ dequant(qw, scales)^T in float32, in a's dtype: the CPU path of every batched weight-only op."""
    return (a.float() @ _quant.dequantize_weight(qw, scales, a.shape[1]).T).to(a.dtype)


def _product_like(qw: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The [M, N] output of a batched weight-only op, for its fake impl."""
    return a.new_empty((a.shape[0], qw.shape[0]))


def _check_row(op: str, qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> None:
    _require(x.dim() == 1, op, f"x must be [K], got shape {tuple(x.shape)}")
    _check_quant(op, qw, scales, x, x.shape[0])


@custom_op("automp::quant_gemv", mutates_args=())
def quant_gemv_op(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _check_row("quant_gemv", qw, scales, x)
    if use_triton(x):
        return _gemv_quant.quant_gemv(qw, scales.contiguous(), x)
    return (_quant.dequantize_weight(qw, scales, x.shape[0]) @ x.float()).to(x.dtype)


@quant_gemv_op.register_fake
def _(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _check_row("quant_gemv", qw, scales, x)
    return x.new_empty((qw.shape[0],))


@custom_op("automp::quant_gemv_partials", mutates_args=())
def quant_gemv_partials_op(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float32 [S, N]: quant_gemv's S split programs' partial products, unsummed (gemv_quant.quant_gemv, partials)."""
    _check_row("quant_gemv_partials", qw, scales, x)
    if use_triton(x):
        return _gemv_quant.quant_gemv(qw, scales.contiguous(), x, partials=True)
    return _gemv_quant.reference_partials(qw, scales, x)


@quant_gemv_partials_op.register_fake
def _(qw: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _check_row("quant_gemv_partials", qw, scales, x)
    return x.new_empty((_gemv_quant.partial_count(qw, scales, x), qw.shape[0]), dtype=torch.float32)


@custom_op("automp::quant_gemm", mutates_args=())
def quant_gemm_op(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    _require(a.dim() == 2, "quant_gemm", f"a must be [M, K], got shape {tuple(a.shape)}")
    _check_quant("quant_gemm", qw, scales, a, a.shape[1])
    if use_triton(a) and a.shape[0] > 0:
        return _quant.quant_gemm(a, qw, scales.contiguous())
    return _reference_product(qw, scales, a)


@quant_gemm_op.register_fake
def _(a: torch.Tensor, qw: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    _require(a.dim() == 2, "quant_gemm", f"a must be [M, K], got shape {tuple(a.shape)}")
    _check_quant("quant_gemm", qw, scales, a, a.shape[1])
    return _product_like(qw, a)


def _check_rows(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> None:
    op = "quant_gemv_rows"
    _require(a.dim() == 2 and 1 <= a.shape[0] <= _quant_batched.MAX_ROWS, op,
             f"a must be [M, K] with M in 1..{_quant_batched.MAX_ROWS} (quant_gemm beyond), got {tuple(a.shape)}")
    _check_quant(op, qw, scales, a, a.shape[1])


@custom_op("automp::quant_gemv_rows", mutates_args=())
def quant_gemv_rows_op(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    _check_rows(qw, scales, a)
    if use_triton(a):
        return _quant_batched.quant_gemv_rows(qw, scales.contiguous(), a)
    return _reference_product(qw, scales, a)


@quant_gemv_rows_op.register_fake
def _(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    _check_rows(qw, scales, a)
    return _product_like(qw, a)


def _check_planes(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> None:
    op = "quant_planes"
    _require(a.dim() == 2, op, f"a must be [M, K], got shape {tuple(a.shape)}")
    _check_quant(op, qw, scales, a, a.shape[1])
    why = _planes.unsupported(qw, scales, a)
    _require(why is None, op, f"{why} (quant_gemm takes any shape)")


@custom_op("automp::quant_planes", mutates_args=())
def quant_planes_op(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    _check_planes(qw, scales, a)
    if use_triton(a):
        return _planes.quant_planes(qw, scales.contiguous(), a)
    return _reference_product(qw, scales, a)


@quant_planes_op.register_fake
def _(qw: torch.Tensor, scales: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    _check_planes(qw, scales, a)
    return _product_like(qw, a)


# ----------------------------------------------------------------------------------------------- W8A8
def _check_int8(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                bias: torch.Tensor | None, a_zero: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    op = "int8_gemm"
    _require(a_q.dtype == torch.int8 and b_q.dtype == torch.int8, op,
             f"a_q and b_q must be int8, got {a_q.dtype} and {b_q.dtype}", TypeError)
    _require(a_q.dim() == 2 and b_q.dim() == 2 and a_q.shape[1] == b_q.shape[0], op,
             f"expected a_q [M, K] and b_q [K, N], got {tuple(a_q.shape)} and {tuple(b_q.shape)}")
    m, n = a_q.shape[0], b_q.shape[1]
    _require(sa.dtype in FLOATS and sb.dtype in FLOATS, op, f"scales must be float, got {sa.dtype}/{sb.dtype}",
             TypeError)
    _require(sa.shape in ((m,), (m, 1), (1,), ()), op, f"sa must be [M], [M, 1] or one scale, got {tuple(sa.shape)}")
    _require(sb.numel() == n and sb.shape in ((n,), (1, n)), op, f"sb must be [N] or [1, N], got {tuple(sb.shape)}")
    _require(out_dtype in FLOATS, op, f"out_dtype must be float16/bfloat16/float32, got {out_dtype}", TypeError)
    if bias is not None:
        _require(bias.dtype in FLOATS and bias.numel() == n, op, f"bias must be float [N], got {tuple(bias.shape)}")
    if a_zero is not None:
        _require(not a_zero.is_floating_point() and a_zero.numel() in (1, m), op,
                 f"a_zero must be an integer scalar or [M] tensor, got {tuple(a_zero.shape)} {a_zero.dtype}",
                 TypeError)
    _same_device(op, a_q, b_q, sa, sb, bias, a_zero)


def _int8_epilogue_args(a_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
                        a_zero: torch.Tensor | None) -> tuple:
    """(sa, sb, bias, zero) flat and contiguous as the kernel reads them; zero as int32 [M]. One activation scale
    (static) stays one element, read by every row (no [M] copy per call)."""
    bias = bias.reshape(-1).contiguous() if bias is not None else None
    zero = a_zero.reshape(-1).to(torch.int32).expand(a_q.shape[0]).contiguous() if a_zero is not None else None
    return sa.reshape(-1).contiguous(), sb.reshape(-1).contiguous(), bias, zero


def _int8_reference(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                    bias: torch.Tensor | None, zero: torch.Tensor | None) -> torch.Tensor:
    """The int8 GEMM and its dequantization on the CPU, in float64: products of int8 codes are exact there (integer
    sums below 2^53) and use BLAS, unlike an int64 matmul."""
    a_int = a_q.double() - (zero.double()[:, None] if zero is not None else 0)
    out = (a_int @ b_q.double()) * sa.double()[:, None] * sb.double()[None, :]
    return out + bias.double() if bias is not None else out


@custom_op("automp::int8_gemm", mutates_args=())
def int8_gemm_op(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                 bias: torch.Tensor | None, a_zero: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    _check_int8(a_q, b_q, sa, sb, bias, a_zero, out_dtype)
    sa, sb, bias, zero = _int8_epilogue_args(a_q, sa, sb, bias, a_zero)
    if use_triton(a_q) and a_q.numel() and b_q.numel():
        return _int8.int8_gemm(a_q, b_q, sa, sb, bias, zero, out_dtype)
    return _int8_reference(a_q, b_q, sa, sb, bias, zero).to(out_dtype)


@int8_gemm_op.register_fake
def _(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
      a_zero: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    _check_int8(a_q, b_q, sa, sb, bias, a_zero, out_dtype)
    return a_q.new_empty((a_q.shape[0], b_q.shape[1]), dtype=out_dtype)


def _check_requant(out_mult: torch.Tensor, out_zero: torch.Tensor | None, n: int) -> None:
    op = "int8_gemm_requant"
    _require(out_mult.dtype in FLOATS and out_mult.numel() in (1, n) and out_mult.dim() <= 1, op,
             f"out_mult must be a float [N] or one element, got {tuple(out_mult.shape)} {out_mult.dtype}", TypeError)
    if out_zero is not None:
        _require(not out_zero.is_floating_point() and out_zero.numel() == 1, op,
                 f"out_zero must be a one-element integer tensor, got {tuple(out_zero.shape)} {out_zero.dtype}",
                 TypeError)


@custom_op("automp::int8_gemm_requant", mutates_args=())
def int8_gemm_requant_op(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                         bias: torch.Tensor | None, a_zero: torch.Tensor | None, gelu: bool, out_mult: torch.Tensor,
                         out_zero: torch.Tensor | None) -> torch.Tensor:
    _check_int8(a_q, b_q, sa, sb, bias, a_zero, torch.float32)
    _check_requant(out_mult, out_zero, b_q.shape[1])
    _same_device("int8_gemm_requant", a_q, out_mult, out_zero)
    sa, sb, bias, zero = _int8_epilogue_args(a_q, sa, sb, bias, a_zero)
    mult = out_mult.reshape(-1).contiguous()
    qz = out_zero.reshape(1).to(torch.int32) if out_zero is not None else None
    if use_triton(a_q) and a_q.numel() and b_q.numel():
        return _int8.int8_gemm(a_q, b_q, sa, sb, bias, zero, torch.float32, gelu=gelu, requant=(mult, qz))
    y = _int8_reference(a_q, b_q, sa, sb, bias, zero).float()  # fp32, as the kernel's epilogue
    if gelu:
        y = torch.nn.functional.gelu(y)
    return _quant.quantize_static_int8(y, mult, qz)


@int8_gemm_requant_op.register_fake
def _(a_q: torch.Tensor, b_q: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, bias: torch.Tensor | None,
      a_zero: torch.Tensor | None, gelu: bool, out_mult: torch.Tensor, out_zero: torch.Tensor | None) -> torch.Tensor:
    _check_int8(a_q, b_q, sa, sb, bias, a_zero, torch.float32)
    _check_requant(out_mult, out_zero, b_q.shape[1])
    return a_q.new_empty((a_q.shape[0], b_q.shape[1]), dtype=torch.int8)


# ----------------------------------------------------------------------------------------------- attention
def _check_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> None:
    """Every bad input is a ValueError here, dtypes included (the decoder's caller treats them all alike)."""
    op = "decode_attention"
    _require(q.dim() == 3, op, f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    _require(k.dim() == 4 and v.shape == k.shape, op,
             f"k and v must be [B, Hkv, L, D] of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    _require(q.dtype in HALF, op, f"q must be float16 or bfloat16, got {q.dtype}")
    _require(k.dtype == q.dtype and v.dtype == q.dtype, op,
             f"k and v dtypes ({k.dtype}, {v.dtype}) must match q dtype {q.dtype}")
    (b, hq, d), (hkv, length) = q.shape, k.shape[1:3]
    _require(k.shape[0] == b and k.shape[3] == d, op,
             f"k/v {tuple(k.shape)} must match q {tuple(q.shape)} in batch B and head dim D")
    _require(hkv > 0 and hq % hkv == 0, op, f"query heads Hq={hq} must be a multiple of KV heads Hkv={hkv}")
    _require(1 <= d <= _decode_attention.MAX_D, op, f"head dim D={d} is unsupported (1..{_decode_attention.MAX_D})")
    _require(valid.dtype == torch.bool, op, f"valid must be a bool mask, got {valid.dtype}")
    _require(valid.shape == (b, length), op, f"valid must be [B, L] = {(b, length)}, got {tuple(valid.shape)}")
    _same_device(op, q, k, v, valid)


@custom_op("automp::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                        scale: float) -> torch.Tensor:
    _check_decode_attention(q, k, v, valid)
    if use_triton(q) and q.numel() and k.numel():  # empty batch or cache: the reference handles them
        return _decode_attention.decode_attention(q, k, v, valid, scale)
    return _decode_attention.decode_attention_reference(q, k, v, valid, scale)


@decode_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    _check_decode_attention(q, k, v, valid)
    return q.new_empty(q.shape)


# ----------------------------------------------------------------------------------------------- loss scaling
def _check_unscale(tensors: list[torch.Tensor], inv_scale: torch.Tensor) -> None:
    op = "unscale_and_check_"
    _require(inv_scale.numel() == 1 and inv_scale.dtype == torch.float32, op,
             f"inv_scale must be a 1-element float32 tensor, got {tuple(inv_scale.shape)} {inv_scale.dtype}",
             TypeError)
    for i, t in enumerate(tensors):
        _require(t.dtype in FLOATS, op, f"tensors[{i}] must be float16/bfloat16/float32, got {t.dtype}", TypeError)
    _same_device(op, inv_scale, *tensors)


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill exactly t.numel() consecutive slots from data_ptr (any dim order)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _unscale_reference(tensors: list[torch.Tensor], inv_scale: torch.Tensor, found: torch.Tensor) -> None:
    """torch's own fused op (what GradScaler uses; CPU and CUDA, any strides, mixed dtypes)."""
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale)


@custom_op("automp::unscale_and_check_", mutates_args=("tensors",))
def unscale_and_check_op(tensors: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    _check_unscale(tensors, inv_scale)
    found = torch.zeros(1, dtype=torch.float32, device=inv_scale.device)
    dense = [t for t in tensors if use_triton(t) and _dense(t)]
    rest = [t for t in tensors if not (use_triton(t) and _dense(t))]
    if dense:
        _reduce.unscale_and_check_(dense, inv_scale, found)
    if rest:  # overlapping/strided views (rare for grads) keep torch's semantics rather than being rejected
        _unscale_reference(rest, inv_scale, found)
    return found


@unscale_and_check_op.register_fake
def _(tensors: list[torch.Tensor], inv_scale: torch.Tensor) -> torch.Tensor:
    _check_unscale(tensors, inv_scale)
    return inv_scale.new_empty((1,), dtype=torch.float32)


def _check_cast(x: torch.Tensor, dtype: torch.dtype) -> None:
    _require(x.dtype in FLOATS and dtype in FLOATS, "cast",
             f"casts between float32/float16/bfloat16 only, got {x.dtype} -> {dtype}", TypeError)


@custom_op("automp::cast", mutates_args=())
def cast_op(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    _check_cast(x, dtype)
    if use_triton(x):
        return _reduce.cast(x.contiguous(), dtype)  # strided input: one extra copy, never a wrong answer
    return x.to(dtype, memory_format=torch.contiguous_format)


@cast_op.register_fake
def _(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    _check_cast(x, dtype)
    return x.new_empty(x.shape, dtype=dtype)
