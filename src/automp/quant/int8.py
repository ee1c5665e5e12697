"""W8A8 int8 Linear (`Int8Linear`) and the helpers the torch converters share (weight groups, SmoothQuant factors).

Int8Linear (W8A8, automp.deploy.quantized's precision "int8"): weights int8 per output channel (symmetric),
activations int8 per row. The per-row ("per-token") scale is taken in the forward by default: transformer activations
carry a few large-magnitude channels whose size changes from token to token, so one static scale per tensor either
clips them or wastes levels on every other token. int8_gemm accumulates in int32 and applies both scales and the bias in
one epilogue.

The weight-only layers (W8A16, W4A16) are automp.quant.weight_only.WeightOnlyLinear.

Int8Linear keeps nn.Linear's contract: any leading dims, output in the input's dtype (fp32 in -> fp32 out, which the
sensitivity measurement relies on), `in_features` / `out_features` attributes.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from automp.quant.weight_only import kernels

GROUPS = (128, 64, 32)  # largest first: fewer scales to load, at a small accuracy cost


def weight_group(k: int, largest: int = GROUPS[0]) -> int | None:
    """The weight-only group for K input features: the largest of 128/64/32 (at most `largest`) dividing K, else
    None. For int8 None means one scale per output channel (accurate on its own); int4 per channel is too coarse,
    so the converter keeps such a layer in fp16 instead (rule NO_INT4_GROUP)."""
    return next((g for g in GROUPS if g <= largest and k % g == 0), None)


class Int8Linear(nn.Module):
    """y = x @ W^T + b on int8 tensor cores; act_scale None means dynamic per-row activation scales.

    Static activations (act_scale / act_zero from calibration) map x to int8 as q = round(x / s) + z with one scale
    per tensor; z != 0 is the asymmetric scheme for one-signed activations, undone inside int8_gemm.

    smooth (SmoothQuant): per-input-channel factors m with y = (x / m) @ (W * m)^T. A few channels of transformer
    activations are 10-100x larger than the rest and set every row's int8 step; dividing them down (and the matching
    weight columns up, where int8 per-channel weights have room) spreads the range over both operands. The divide
    sits in front of the row quantization, which torch.compile fuses into one kernel.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 act_qparams: tuple[float, int] | None = None, smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float()
        if smooth is not None:
            if smooth.shape != (self.in_features,) or not bool((smooth > 0).all()):
                raise ValueError(f"Int8Linear: smooth must be {self.in_features} positive factors, got "
                                 f"{tuple(smooth.shape)}")
            weight = weight * smooth.to(weight)[None, :]
        self.register_buffer("inv_smooth", None if smooth is None else (1.0 / smooth.float()).contiguous())
        qw, scale = kernels().quantize_weight_int8(weight, group_size=None)
        # [N, K] with K contiguous, passed to int8_gemm as the [K, N] view .t(): the K-major operand layout that
        # 8-bit tensor-core instructions (Hopper wgmma) want for both operands.
        self.register_buffer("qweight", qw)
        self.register_buffer("wscale", scale.reshape(-1).float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        if act_qparams is None:
            self.register_buffer("act_scale", None)
            self.register_buffer("act_zero", None)
            self.register_buffer("act_mult", None)
        else:
            s, z = act_qparams
            self.register_buffer("act_scale", torch.tensor(float(s), dtype=torch.float32, device=weight.device))
            self.register_buffer("act_zero", None if z == 0 else
                                 torch.tensor(int(z), dtype=torch.int32, device=weight.device))
            # one multiplier per input channel (or one in all) maps x to its code: the quantization is then a
            # single elementwise formula, the form automp.deploy.quantized.requant moves into the producing GEMM
            mult = (self.inv_smooth if self.inv_smooth is not None else torch.ones(1, device=weight.device)) / s
            self.register_buffer("act_mult", mult.float().contiguous())

    @property
    def mode(self) -> str:
        return "dynamic" if self.act_scale is None else "static"

    def _quantize(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.act_scale is None:
            if self.inv_smooth is not None:
                x2 = x2.float() * self.inv_smooth
            return kernels().quantize_rowwise_int8(x2)
        # one scale, read by every row
        return kernels().quantize_static_int8(x2, self.act_mult, self.act_zero), self.act_scale.reshape(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        a_q, sa = self._quantize(x2)
        y = kernels().int8_gemm(a_q, self.qweight.t(), sa, self.wscale, self.bias, out_dtype=x.dtype,
                              a_zero=self.act_zero)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        smooth = ", smoothed" if self.inv_smooth is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, activations={self.mode}{smooth}"


class Int8Slice(nn.Module):
    """Output columns [start, stop) of a shared Int8Linear: layers that read the same input (attention's query, key
    and value) as one GEMM over their concatenated weights, with one quantization of that input.

    Every slice calls the shared layer on its input; automp.deploy.quantized.requant.dedupe merges the repeated
    calls when the model is compiled, so the GEMM runs once per input. Eagerly each slice recomputes it (correct,
    not fast)."""

    def __init__(self, shared: Int8Linear, start: int, stop: int) -> None:
        super().__init__()
        if not 0 <= start < stop <= shared.out_features:
            raise ValueError(f"Int8Slice: columns [{start}, {stop}) outside the shared layer's "
                             f"{shared.out_features}")
        self.shared, self.start, self.stop = shared, start, stop
        self.in_features, self.out_features = shared.in_features, stop - start

    @property
    def mode(self) -> str:
        return self.shared.mode

    @property
    def inv_smooth(self) -> torch.Tensor | None:
        return self.shared.inv_smooth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x)[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"columns [{self.start}, {self.stop}) of a shared {self.shared.out_features}-wide int8 GEMM"


def smooth_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's m_k = max|x_k|^alpha / max|W_:,k|^(1 - alpha): alpha 0.5 splits each channel's range evenly
    between activation and weight. Dead channels (never seen non-zero) get m = 1."""
    w = weight.detach().float().abs().amax(dim=0)
    a = act_absmax.float().to(w.device)
    m = a.clamp_min(1e-5) ** alpha / w.clamp_min(1e-5) ** (1 - alpha)
    return torch.where((a > 0) & (w > 0), m, torch.ones_like(m))


def int8_static_qparams(scale: np.ndarray, zero: np.ndarray, dtype: str) -> tuple[float, int]:
    """Observer qparams (automp.quant.observers, per tensor) as the int8 scale and zero point int8_gemm
    takes: a uint8 range [0, 255] with zero point zu is the int8 range [-128, 127] with zero point zu - 128."""
    s, z = float(np.asarray(scale)), int(np.asarray(zero))
    return s, (z - 128 if dtype == "uint8" else z)


def nbytes(module: nn.Module) -> int:
    """Bytes held by a module's parameters and buffers (what the weights cost in memory)."""
    seen = {id(t): t for t in list(module.parameters()) + list(module.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())
