"""FP8 linear layers for training: the three GEMMs of a linear layer (forward, grad-input, grad-weight) in float8 on
Hopper's FP8 tensor cores, with dynamic scaling, master weights and optimizer state unchanged.

Recipes (torchao's names and choices, as its float8 training README describes them):
- "tensorwise": one fp32 scale per tensor, amax/448 for e4m3 activations and weights, amax/57344 for e5m2 gradients
  (e5m2 keeps the gradients' range, e4m3 the activations' precision). The fastest: one scale, one cast per tensor.
- "rowwise": e4m3 everywhere, one scale per row of each GEMM operand (per token, per output channel), so an outlier
  row no longer crushes the others' resolution; each tensor is cast along the axis each GEMM reduces over.

Written as one torch.autograd.Function over torch._scaled_mm, not torchao's tensor subclass: Dynamo traces it into
the joint graph as plain ops, so Inductor fuses each amax with its cast and the compile stays that of a bf16 model
(torchao's float8 compile of a 16-layer Llama had not finished after three times as long as the bf16 compile of a
comparable model took). torchao's recipes are the benchmark's anchors (`automp bench fp8`).

A layer is switched by `install` (its class becomes an FP8 subclass of its own class: same parameters, same state_dict,
isinstance unchanged) and runs FP8 only inside `active()`: the runtime compiles its FP8 path under it and its bf16
path outside it, so both can be timed against each other on the same modules and the FP8 one left at any time.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only

RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
_EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale (its values cast to zero exactly)
ALIGN = 16  # torch._scaled_mm needs every GEMM dimension a multiple of 16


class _Switch:
    """Whether FP8 layers run FP8 now. A plain attribute read, so Dynamo guards on it: the graphs compiled inside
    `active()` are FP8, those compiled outside are bf16, and each is reused only under its own setting."""

    on = False


SWITCH = _Switch()


@contextlib.contextmanager
def active(on: bool = True) -> Iterator[None]:
    before = SWITCH.on
    SWITCH.on = on
    try:
        yield
    finally:
        SWITCH.on = before


def unavailable(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run for training on `device` (one line), or None where they can."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return f"this torch ({torch.__version__}) has no FP8 GEMM (torch._scaled_mm)"
    if device.type != "cuda":
        where = f"the model is on {device.type}" if torch.cuda.is_available() else "this machine has no CUDA GPU"
        return f"FP8 training needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9+: Ada, Hopper); {where}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"FP8 training needs FP8 tensor cores (compute capability 8.9+: Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
    return None


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}: expected one of {RECIPES}")


def fits(m: int, k: int, n: int) -> bool:
    return m % ALIGN == 0 and k % ALIGN == 0 and n % ALIGN == 0


def cast(t: torch.Tensor, dtype: torch.dtype, dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in `dtype`, its fp32 inverse scale): scaled so that its amax (of the whole tensor, or along `dim`, kept as a
    size-1 dimension) lands on the format's largest value. Multiplying the FP8 values by the inverse scale gives t
    back up to FP8 rounding. A weight FSDP2 all-gathered in FP8 (Fp8Weight) arrives cast already: the same values
    this cast would give it, computed on each rank's shard before the all-gather (automp.precision.fp8.gather)."""
    if isinstance(t, Fp8Weight) and dim is None and dtype == t.data8.dtype:
        return t.data8, t.inv_scale
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    return cast_scaled(t, dtype, amax)


def cast_scaled(t: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`cast` with the amax given: the one formula, shared with the FP8 all-gather, whose amax is a reduction over
    every rank's shard."""
    scale = _MAX[dtype] / amax.float().clamp(min=_EPS)
    t8 = (t.float() * scale).clamp(-_MAX[dtype], _MAX[dtype]).to(dtype)
    return t8, scale.reciprocal().contiguous()


class Fp8Weight(torch.Tensor):
    """A weight in float8 with its tensorwise inverse scale, reading as its high-precision dtype: what FSDP2 gives a
    layer whose weight it all-gathers in FP8. `cast` takes its FP8 values as they are; any other op sees the weight
    dequantized (bf16 paths stay correct, at FP8's precision). A traceable wrapper subclass, so torch.compile takes
    the FP8 values and the scale as two graph inputs."""

    data8: torch.Tensor
    inv_scale: torch.Tensor

    @staticmethod
    def __new__(cls, data8: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype) -> "Fp8Weight":
        return torch.Tensor._make_wrapper_subclass(cls, data8.shape, strides=data8.stride(), dtype=dtype,
                                                   storage_offset=data8.storage_offset(), device=data8.device)

    def __init__(self, data8: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.data8, self.inv_scale = data8, inv_scale

    def __repr__(self) -> str:
        return f"Fp8Weight({self.data8.dtype} {tuple(self.shape)} as {self.dtype})"

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["data8", "inv_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], dtype: torch.dtype, outer_size: Any,
                             outer_stride: Any) -> "Fp8Weight":
        return Fp8Weight(inner["data8"], inner["inv_scale"], dtype)

    def dequantized(self) -> torch.Tensor:
        return (self.data8.float() * self.inv_scale).to(self.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _VIEWS and isinstance(args[0], Fp8Weight):  # FSDP's as_strided, nn.Parameter's detach
            w = args[0]
            return Fp8Weight(func(w.data8, *args[1:], **kwargs), w.inv_scale, w.dtype)
        if func._schema.is_mutable:
            raise RuntimeError(f"{func} would modify a weight FSDP2 all-gathers in FP8 (automp dtype fp8); its "
                               f"gathered copy is read-only: modify the sharded parameter between steps")
        args, kwargs = tree_map_only(Fp8Weight, Fp8Weight.dequantized, (args, kwargs))
        return func(*args, **kwargs)


_VIEWS = {torch.ops.aten.as_strided.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
          torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


def col_major(t: torch.Tensor) -> torch.Tensor:
    """The same (rows, cols) matrix stored column-major: _scaled_mm's second operand must be."""
    return t.t().contiguous().t()


# The forward GEMM accumulates in the tensor cores' fast mode, the two backward GEMMs in full precision: torchao's
# float8 training (its default for every recipe) and Transformer Engine do the same. The forward's error is that of
# the FP8 operands, which a few low bits of the sum do not change; the weight gradient sums over every token of the
# batch, where they would. Without it the forward GEMMs were the part of the FP8 step still slower than torchao's.
FORWARD_FAST_ACCUM = True


def _mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
        out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """a @ b on FP8 operands, dequantized by the inverse scales into `out_dtype`. Per-row scales (2-D) produce bf16,
    the one output cuBLAS gives row-wise scaling on Hopper, converted after. fast_accum: FORWARD_FAST_ACCUM says when.

    b is always laid out column-major by an explicit copy (a no-op on one that already is), never by testing its
    strides first: under torch.compile such a test is decided on the traced tensor, whose layout Inductor may change."""
    rowwise = scale_a.dim() == 2
    y = torch._scaled_mm(a.contiguous(), col_major(b), scale_a=scale_a, scale_b=scale_b.contiguous(),
                         out_dtype=torch.bfloat16 if rowwise else out_dtype, use_fast_accum=fast_accum)
    # no `.to()` to the dtype it already has: that returns y itself, and a Function output aliasing its own
    # intermediate was given all-zero gradients by torch 2.11's compiled backward (eager and 2.13 were right)
    return y if y.dtype == out_dtype else y.to(out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """y(m,n) = x(m,k) @ w(n,k).T with all three GEMMs in FP8. Saves FP8 copies (tensorwise: half bf16's bytes) or
    the originals (rowwise: the backward casts them along other axes)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, recipe: str, out_dtype: torch.dtype) -> torch.Tensor:
        ctx.recipe, ctx.x_dtype, ctx.w_dtype = recipe, x.dtype, w.dtype
        if recipe == "tensorwise":
            x8, sx = cast(x, E4M3)
            w8, sw = cast(w, E4M3)
            ctx.save_for_backward(x8, sx, w8, sw)
            return _mm(x8, w8.t(), sx, sw, out_dtype, FORWARD_FAST_ACCUM)
        x8, sx = cast(x, E4M3, dim=1)  # per row of x: (m, 1)
        w8, sw = cast(w, E4M3, dim=1)  # per output channel: (n, 1)
        ctx.save_for_backward(x, w)
        return _mm(x8, w8.t(), sx, sw.t(), out_dtype, FORWARD_FAST_ACCUM)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # autocast off here too, as in forward (fp8_linear): the casts and GEMMs choose their dtypes themselves,
        # whatever autocast the backward is traced or run under
        with torch.autocast(g.device.type, enabled=False):
            return _Fp8Matmul._backward(ctx, g)

    @staticmethod
    def _backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_dtype = g.dtype if g.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        if ctx.recipe == "tensorwise":
            x8, sx, w8, sw = ctx.saved_tensors
            g8, sg = cast(g, E5M2)
            grad_x = _mm(g8, w8, sg, sw, _out(ctx.x_dtype, grad_dtype))
            grad_w = _mm(g8.t(), x8, sg, sx, torch.float32)
        else:
            x, w = ctx.saved_tensors
            g8, sg = cast(g, E4M3, dim=1)  # rows of g: (m, 1)
            w8c, swc = cast(w, E4M3, dim=0)  # columns of w (k of them): (1, k)
            grad_x = _mm(g8, w8c, sg, swc, _out(ctx.x_dtype, grad_dtype))
            gt8, sgt = cast(g.t(), E4M3, dim=1)  # rows of g.T (output channels): (n, 1)
            x8c, sxc = cast(x, E4M3, dim=0)  # columns of x: (1, k)
            grad_w = _mm(gt8, x8c, sgt, sxc, torch.float32)
        return grad_x, grad_w if grad_w.dtype == ctx.w_dtype else grad_w.to(ctx.w_dtype), None, None


def _out(dtype: torch.dtype, fallback: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else fallback


def fp8_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, recipe: str = "tensorwise"
               ) -> torch.Tensor:
    """F.linear(x, w, bias) with FP8 GEMMs. The output has the dtype F.linear would give: autocast's where autocast
    is on (bf16 under automp), else x's."""
    check_recipe(recipe)
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    lead = x.shape[:-1]
    with torch.autocast(device, enabled=False):
        y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), w, recipe, out_dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
    return y.reshape(*lead, y.shape[-1])


# -- layers ------------------------------------------------------------------------------------------------------
def weight_nk(module: nn.Module) -> torch.Tensor:
    """The layer's weight as (out_features, in_features): nn.Linear's own; transformers' Conv1D (GPT-2) stores it
    transposed."""
    transposed = getattr(module, "_automp_fp8_transposed", None)  # set at install; before it, the class says
    return module.weight.t() if (_is_conv1d(module) if transposed is None else transposed) else module.weight


def linear_like(module: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (a linear layer with a (in, out) weight), exactly: subclasses may compute
    something else in their forward."""
    return type(module) is nn.Linear or _is_conv1d(module)


def _is_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.") and hasattr(module, "nf")


def _fp8_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    w = weight_nk(self)
    if SWITCH.on and x.dim() >= 2 and fits(x.numel() // x.shape[-1], w.shape[1], w.shape[0]):
        return fp8_linear(x, w, self.bias, self._automp_fp8_recipe)
    return super(type(self), self).forward(x)


_SUBCLASSES: dict[type, type] = {}


def _fp8_class(cls: type) -> type:
    """The FP8 subclass of a layer class, made once and registered in this module (a pickled model finds it)."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        name = f"Fp8{cls.__name__}"
        sub = type(name, (cls,), {"forward": _fp8_forward, "__module__": __name__, "__qualname__": name})
        setattr(sys.modules[__name__], name, sub)
        _SUBCLASSES[cls] = sub
    return sub


def install(module: nn.Module, recipe: str) -> None:
    """Make one linear layer FP8-capable (FP8 inside `active()`); `uninstall` undoes it exactly."""
    check_recipe(recipe)
    if not linear_like(module):
        raise TypeError(f"FP8 layers replace nn.Linear or transformers' Conv1D, not {type(module).__name__}")
    module._automp_fp8_recipe = recipe
    module._automp_fp8_transposed = _is_conv1d(module)
    module.__class__ = _fp8_class(type(module))


def uninstall(module: nn.Module) -> None:
    cls = type(module)
    base = next((b for b, s in _SUBCLASSES.items() if s is cls), None)
    if base is None:
        return
    module.__class__ = base
    for attr in ("_automp_fp8_recipe", "_automp_fp8_transposed"):
        module.__dict__.pop(attr, None)


def relative_error(module: nn.Module, x: torch.Tensor, recipe: str) -> float:
    """‖y_fp8 − y_bf16‖ / ‖y_bf16‖ of one layer on the input it was given: what FP8 changes in its output, against
    what the bf16 path computes (both without bias: it is added exactly in either)."""
    return group_error([module], x, recipe)


def group_error(modules: list[nn.Module], x: torch.Tensor, recipe: str) -> float:
    """The largest of `relative_error` among layers run as one FP8 GEMM on their concatenated weight
    (automp.precision.siblings): one weight scale covers them all, so a member whose weights are much smaller than
    the others' keeps fewer of FP8's steps than it would alone."""
    ws = [weight_nk(m) for m in modules]
    with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
        x2 = x.reshape(-1, x.shape[-1])
        out = _Fp8Matmul.apply(x2, ws[0] if len(ws) == 1 else torch.cat(ws), recipe, torch.float32).float()
        errors = []
        for part, w in zip(out.split([w.shape[0] for w in ws], dim=-1), ws):
            ref = (x2.to(torch.bfloat16) @ w.to(torch.bfloat16).t()).float()
            errors.append(float((part - ref).norm() / ref.norm().clamp(min=_EPS)))
        return max(errors)
