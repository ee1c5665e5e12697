"""int8 / int4 inference of torch modules on the GPU (the torch counterpart of the ONNX int8 path).

    model, report = automp.deploy.quantized.quantize_module(model, "int8", calib=[batch, ...])
    y = model(*same_inputs_as_before)          # float32 in, float32 out; fp16 + int8 kernels inside

precision:
  "int8"         W8A8: int8 weights per output channel, int8 activations per tensor (static, calibrated: the
                 default with calibration data) or per row (dynamic), int32 accumulation with dequant + bias fused
                 (automp.kernels.int8_gemm); with static activations an MLP's first GEMM writes the second's int8
                 input (requant) and query / key / value share one GEMM (automp.quant.ptq.shared).
  "int8-weight"  W8A16: int8 weights in groups of 128/64/32 along K (else per channel), fp16 activations.
  "int4-weight"  W4A16: int4 weights in groups of 128/64/32 along K; a Linear whose K is not a multiple of 32 stays
                 fp16 (rule NO_INT4_GROUP).
Everything that is not an nn.Linear runs in fp16. With calib and a budget, the most sensitive layers go back to
fp16 until the error vs FP32 holds. On CUDA the result is torch.compile'd with CUDA graphs (fixed shapes).

quantize_module is a preset of automp.quant.quantize: the conversion is automp.quant.ptq's (W8A8Config or
WeightOnlyConfig built from `precision` and TorchQuantConfig), the quantized Linear modules are automp.quant's
(Int8Linear, WeightOnlyLinear). What is here runs the result: compile (Inductor with CUDA graphs), requant (its
post-grad pass for static activations), speed (on CUDA, the result timed against the same module in fp16/bf16: the
report says which is faster, and a slower result warns).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

import torch
import torch.nn as nn

from automp.deploy.quantized import speed
from automp.deploy.quantized.compile import compile_module, graph_breaks
from automp.quant import W8A8Config, WeightOnlyConfig, ptq
from automp.quant.api import check_ptq
from automp.quant.names import PRECISIONS, SCHEMES
from automp.quant.observers import ObserverConfig
from automp.quant.ptq import QuantReport, boundary


@dataclass
class TorchQuantConfig:
    """activations: int8 only - "static" (one scale per tensor from `observer` over the calibration data: the fast
    form, see automp.deploy.quantized.requant), "dynamic" (per-row scales taken in the forward: no calibration
    needed, a little more accurate, but the per-row scales cost a row reduction in every forward, which can make it
    slower than fp16) or "auto" (static with calibration data, else dynamic).
    dtype: compute dtype of everything not quantized. budget: max relative output error vs the FP32 module on the
    calibration data (None: no fallback). exclude: fnmatch patterns of module names kept in float.
    smooth: int8 only, with calib - SmoothQuant migration strength alpha in [0, 1], "auto" (each of
    automp.quant.ptq.SMOOTH_GRID tried, the one with the smallest error vs FP32 on the calibration data kept; static
    per-tensor scales need more migration than per-row ones: MiniLM's cosine to FP32 is 0.946 at 0.5 and 0.996 at
    0.8) or None (off); see Int8Linear.
    group_size: weight-only - the largest group along K tried (128, 64 or 32; smaller is more accurate, more scales).
    sensitivity: how the budget search ranks layers - automp.quant.fallback's "isolate" / "drop" (model output
    error, one model run per layer over the calibration data) or "layer" (each layer's own output error, no extra
    run; automp.quant.ptq.pipeline says why it is not the default).
    max_calib_batches: calibration batches used (the rest of the iterable is not read). compile: torch.compile the
    result with `compile_mode` on CUDA (eager on CPU), with query / key / value as one shared GEMM, which pays only
    compiled. measure: on CUDA with calib, time the result against the same module in `dtype`, built the same way,
    and report which is faster (see speed).

    Every field but compile, compile_mode and measure is a field of automp.quant's W8A8Config / WeightOnlyConfig
    (smooth is W8A8Config.smooth_alpha), checked by automp.quant.api.check_ptq."""
    activations: str = "auto"
    smooth: float | str | None = "auto"
    sensitivity: str = "isolate"
    group_size: int = 128
    observer: ObserverConfig = field(default_factory=ObserverConfig)
    dtype: torch.dtype = torch.float16
    budget: float | None = None
    exclude: tuple[str, ...] = ()
    max_calib_batches: int = 8
    compile: bool = True
    compile_mode: str = "reduce-overhead"
    measure: bool = True

    def __post_init__(self) -> None:
        check_ptq("TorchQuantConfig", activations=self.activations, smooth=self.smooth, sensitivity=self.sensitivity,
                  group_size=self.group_size, observer=self.observer, dtype=self.dtype, budget=self.budget,
                  exclude=self.exclude, max_calib_batches=self.max_calib_batches)

    def scheme(self, precision: str, calib: Any = None) -> W8A8Config | WeightOnlyConfig:
        """automp.quant's config for `precision` with these settings."""
        common = dict(calib=calib, budget=self.budget, sensitivity=self.sensitivity, dtype=self.dtype,
                      exclude=self.exclude, max_calib_batches=self.max_calib_batches)
        if precision == "int8":
            return W8A8Config(activations=self.activations, smooth_alpha=self.smooth, observer=self.observer,
                              shared_gemm=self.compile, **common)
        return WeightOnlyConfig(bits=SCHEMES[precision.removesuffix("-weight")], group_size=self.group_size,
                                **common)


def _check_args(module: Any, precision: Any, config: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"quantize_module takes an nn.Module, got {type(module).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not isinstance(config, TorchQuantConfig):
        raise TypeError(f"config must be a TorchQuantConfig, got {type(config).__name__}")


def quantize_module(module: nn.Module, precision: str, calib: Iterable | None = None,
                    config: TorchQuantConfig | None = None) -> tuple[nn.Module, QuantReport]:
    """The converted module (float32 I/O, compiled on CUDA when config.compile) and its report.

    calib: batches, each what one call of `module` takes (tensor / tuple of args / dict of kwargs). Needed for
    static int8 and for a budget; otherwise optional (then the error vs FP32 is not measured). The FP32 module is
    not modified."""
    config = config if config is not None else TorchQuantConfig()
    _check_args(module, precision, config)
    # read once here: the conversion and the speed check both use the batches, and calib may be an iterator
    batches = boundary.first_batches(calib, config.max_calib_batches)
    scheme = config.scheme(precision, batches)
    # automp.quant.quantize's PTQ route (its model handler calls ptq.convert), entered directly: the verb would swap
    # layers in place without calib and hand a causal LM to its own handler, and here every module gets the float32
    # boundary and the report
    start = time.perf_counter()
    model = ptq.convert(module, scheme)
    report = model.quant_report
    report.seconds["convert"] = round(time.perf_counter() - start, 2)

    def build(m: nn.Module) -> nn.Module:
        return compile_module(m, config.compile_mode) if config.compile else m

    out = build(model)
    device = torch.device(report.device)
    why = speed.skipped_because(device, batches or [], config.measure)
    start = time.perf_counter()
    report.speed = (speed.SpeedCheck(skipped=why) if why else
                    speed.check(out, module, config.dtype, model.io_dtype, boundary.calib_calls(batches, device, 1)[0],
                                build)).to_dict()
    if not why:
        report.seconds["speed_check"] = round(time.perf_counter() - start, 2)
    return out, report


def optimize_torch(module: nn.Module, precision: str, calib: Iterable | None = None, budget: float | None = None,
                   config: TorchQuantConfig | None = None) -> tuple[nn.Module, dict]:
    """automp.deploy.optimize's torch-module path: (converted module, report dict). `budget` overrides config's."""
    config = config if config is not None else TorchQuantConfig()
    if budget is not None:
        config = replace(config, budget=budget)
    model, report = quantize_module(module, precision, calib, config)
    return model, report.to_dict()


__all__ = ["quantize_module", "optimize_torch", "TorchQuantConfig", "compile_module", "graph_breaks", "speed"]
