"""Quantization-aware training: simulate int8 in the forward pass so training learns to live with it.

    model = prepare_qat(model, QATConfig())   # nn.Linear / nn.Conv2d -> fake-quant versions
    ...train with your own loop...             # the first forward pass(es) observe activation ranges
    model = convert_qat(model)                 # freeze scales, eval mode
    onnx_model = export_qat_onnx(model, (x,))  # QDQ ONNX with int8 weights, runs in onnxruntime CPU

Fake quant = quantize then dequantize in float: y = (round(clamp(x/s + z)) - z) * s. Rounding uses the
straight-through estimator (gradient 1 inside the range, 0 where clamped). The scale s is a parameter learned
as in LSQ (Esser et al. 2020): with the STE written as plain autograd, d y / d s is round(v) - v inside the
range and (qmax - z) / (qmin - z) at the clamps, and the gradient is scaled by 1/sqrt(numel * qmax) so scales
move at the pace of the weights. Scales start from an observer (same observers as PTQ), zero points stay fixed.
Weights: per-channel symmetric int8 [-127, 127] along the output channel; inputs: one per-tensor scale.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from automp.quant.observers import QRANGES, ObserverConfig, activation_qparams, make_observer


def _default_activation() -> ObserverConfig:
    return ObserverConfig(method="minmax", dtype="uint8", symmetric=False)


@dataclass
class QATConfig:
    """weight_method: observer for the initial per-channel weight scales. activation: observer (per tensor)
    for the initial input scales. observe_batches: training forward passes that only observe inputs (output
    is float) before fake quant switches on. learn_scales: LSQ; False keeps the observer's scales fixed."""
    weight_method: str = "minmax"
    activation: ObserverConfig = field(default_factory=_default_activation)
    observe_batches: int = 1
    learn_scales: bool = True

    def __post_init__(self) -> None:
        if self.activation.axis is not None:
            raise ValueError("QAT activations are quantized per tensor: QATConfig.activation.axis must be None")
        if self.observe_batches < 1:
            raise ValueError("observe_batches must be >= 1 (activation scales start from observed ranges)")


def _round_ste(v: torch.Tensor) -> torch.Tensor:
    return (torch.round(v) - v).detach() + v


def _grad_scale(s: torch.Tensor, g: float) -> torch.Tensor:
    """Value s, gradient scaled by g."""
    return (s - s * g).detach() + s * g


class FakeQuant(nn.Module):
    """Fake-quantizes its input; axis=None per tensor, else one (scale, zero point) per slice along axis."""

    def __init__(self, channels: int | None, axis: int | None, observer: ObserverConfig, learn: bool,
                 narrow: bool = False) -> None:
        super().__init__()
        self.narrow = narrow  # [-127, 127]: symmetric int8 weights, as the ONNX writer stores them
        shape = () if axis is None else (channels,)
        self.axis = axis
        self.observer_config = observer
        self.scale = nn.Parameter(torch.ones(shape), requires_grad=learn)
        self.register_buffer("zero_point", torch.zeros(shape))
        self.register_buffer("initialized", torch.tensor(False))
        self.register_buffer("qrange", torch.tensor(QRANGES[observer.dtype]))  # buffers: survive state_dict
        self._observer = None
        self._ready = False

    def set_qparams(self, scale: np.ndarray, zero_point: np.ndarray) -> None:
        qmin, qmax = QRANGES[str(zero_point.dtype)]
        with torch.no_grad():
            self.scale.copy_(torch.as_tensor(scale, dtype=self.scale.dtype))
            self.zero_point.copy_(torch.as_tensor(zero_point.astype(np.float32)))
            self.qrange.copy_(torch.tensor([-qmax if self.narrow else qmin, qmax]))
        self.initialized.fill_(True)
        self._ready = False

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._ready = False  # re-read initialized / qrange on the next forward

    def observe(self, x: torch.Tensor) -> None:
        if self._observer is None:
            self._observer = make_observer(self.observer_config)
        self._observer.update(x.detach().float().cpu().numpy())

    def finish_observing(self) -> None:
        self.set_qparams(*activation_qparams(self._observer))
        self._observer = None

    def effective_scale(self) -> torch.Tensor:
        return self.scale.clamp_min(1e-12)

    def is_ready(self) -> bool:
        """Host-side copies of `initialized` and `qrange`: no device sync per forward once set."""
        if not self._ready and bool(self.initialized):
            self.qmin, self.qmax = (int(v) for v in self.qrange.tolist())
            self._ready = True
        return self._ready

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.is_ready():
            raise RuntimeError("FakeQuant used before its scale was initialised (no observed forward pass)")
        per = x.numel() // (1 if self.axis is None else x.shape[self.axis])
        s = _grad_scale(self.effective_scale(), 1.0 / math.sqrt(per * self.qmax))
        z = self.zero_point
        if self.axis is not None:
            view = [1] * x.dim()
            view[self.axis] = -1
            s, z = s.view(view), z.view(view)
        v = torch.clamp(x / s + z, self.qmin, self.qmax)
        return ((_round_ste(v) - z) * s).to(x.dtype)


class _QATMixin:
    """Shared by the QAT layers: an input FakeQuant that observes first, a per-channel weight FakeQuant."""

    def _setup_qat(self, config: QATConfig) -> None:
        wcfg = ObserverConfig(method=config.weight_method, axis=0)
        self.weight_fq = FakeQuant(self.weight.shape[0], 0, wcfg, config.learn_scales, narrow=True)
        obs = make_observer(wcfg)
        obs.update(self.weight.detach().float().cpu().numpy())
        self.weight_fq.set_qparams(*obs.qparams())
        self.input_fq = FakeQuant(None, None, config.activation, config.learn_scales)
        self.observe_batches = config.observe_batches
        self.register_buffer("observed", torch.tensor(0))

    def _quant_input(self, x: torch.Tensor) -> torch.Tensor:
        fq = self.input_fq
        if fq.is_ready():
            return fq(x)
        fq.observe(x)
        self.observed += 1
        if int(self.observed) >= self.observe_batches:
            fq.finish_observing()
        return x


class QATLinear(_QATMixin, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._quant_input(x), self.weight_fq(self.weight), self.bias)


class QATConv2d(_QATMixin, nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(self._quant_input(x), self.weight_fq(self.weight), self.bias)


def to_qat(mod: nn.Module, config: QATConfig) -> nn.Module:
    """Same parameters (same names, same tensors) inside a QAT subclass, so optimizers and state dicts hold."""
    if isinstance(mod, nn.Linear):
        q = QATLinear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
    else:
        q = QATConv2d(mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride, mod.padding, mod.dilation,
                      mod.groups, mod.bias is not None, mod.padding_mode, device="meta")
    q.weight, q.bias = mod.weight, mod.bias
    q.train(mod.training)
    q._setup_qat(config)
    return q.to(mod.weight.device)


def _replace(parent: nn.Module, config: QATConfig) -> int:
    count = 0
    for name, child in parent.named_children():
        if isinstance(child, (QATLinear, QATConv2d)):
            raise ValueError(f"module {name!r} is already prepared for QAT")
        if type(child) in (nn.Linear, nn.Conv2d):
            setattr(parent, name, to_qat(child, config))
            count += 1
        else:
            count += _replace(child, config)
    return count


def prepare_qat(model: nn.Module, config: QATConfig | None = None) -> nn.Module:
    """Replace every nn.Linear / nn.Conv2d (in place) by its fake-quant version; returns the model."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare_qat takes an nn.Module, got {type(model).__name__}")
    if type(model) in (nn.Linear, nn.Conv2d):
        raise TypeError("prepare_qat needs a container module (the layer to replace must have a parent)")
    if _replace(model, config or QATConfig()) == 0:
        raise ValueError("prepare_qat found no nn.Linear / nn.Conv2d to quantize")
    return model


def qat_layers(model: nn.Module) -> dict[str, _QATMixin]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (QATLinear, QATConv2d))}


def convert_qat(model: nn.Module) -> nn.Module:
    """Freeze every learned scale and switch to eval; the model still runs in float (fake quant) in torch."""
    layers = qat_layers(model)
    if not layers:
        raise ValueError("convert_qat: model has no QAT layers (call prepare_qat first)")
    for name, m in layers.items():
        if not m.input_fq.is_ready():
            raise RuntimeError(f"QAT layer {name!r} never saw an input: run at least "
                               f"{m.observe_batches} training forward pass(es) before convert_qat")
        for fq in (m.weight_fq, m.input_fq):
            fq.scale.requires_grad_(False)
    return model.eval()
