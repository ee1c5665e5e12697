"""Post-training int8 quantization of ONNX models (QDQ format, runs in onnxruntime CPU).

    model_q, report = quantize_onnx(model, {"x": calib_x}, PTQConfig(), budget=0.02)

mode="weight_only": per-channel symmetric int8 weights behind DequantizeLinear, activations stay float (smaller
file, no calibration needed beyond the error report). mode="static": weights as above plus per-tensor activation
Q/DQ pairs with ranges calibrated by running the model in onnxruntime; non-negative activations (ReLU outputs)
use asymmetric uint8 so none of the 256 levels is wasted on negatives.

Weights are 7-bit ([-63, 63]) instead of 8-bit on CPUs whose onnxruntime int8 GEMM saturates on full-range
weights (x86 AVX2 without VNNI, see qdq.int8_gemm_saturates): there the fused int8 kernels would otherwise
compute something other than the QDQ graph says. PTQConfig.weight_bits overrides the choice (e.g. to build
8-bit weights here for a VNNI deployment machine).

Graph inputs and outputs keep their names and types (int64 token ids pass through untouched); only float32
Conv / Gemm / MatMul layers are quantized, anything else is listed in report["float"] with the reason. A model
with nothing to quantize is an error, not a silent no-op.

The returned report is a plain dict (JSON-serialisable):
  mode, weight_range ("8-bit" | "7-bit (reason)"),
  calibration {samples, batches, activation_observer, weight_observer},
  quantized [{name, op, weight, weight_axis, activations}], float [{name, op, reason}],
  error {outputs {name: rel}, max_rel_error, samples}, budget, sensitivity {layer: error},
  fallback_steps [[n_float, error]], ort_int8_kernels {op: count in ORT's optimized graph}.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx

from automp.deploy.qdq import calibrate
from automp.deploy.qdq.layers import Layer, LayerScan, check_model, find_layers, weight_array
from automp.deploy.qdq.qdq import QDQPlan, QParams, on_weight_grid, weight_qmax, weight_range_label, write_qdq
from automp.quant.fallback import FallbackConfig, check_budget, fit_budget
from automp.quant.observers import ObserverConfig, activation_qparams, make_observer

INT8_KERNELS = ("QLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "ConvInteger", "MatMulInteger",
                "QLinearAdd", "QLinearGlobalAveragePool")


def _default_activation() -> ObserverConfig:
    return ObserverConfig(method="minmax", dtype="uint8", symmetric=False)


@dataclass
class PTQConfig:
    """mode: static | weight_only. weight_method: observer for per-channel weights (minmax | mse | ...).
    activation: per-tensor activation observer (axis must be None). quantize_outputs: also Q/DQ the output of
    each quantized layer, which lets ORT fuse DQ -> Conv -> Q into one int8 kernel. exclude: node names the
    user keeps in float. batch_size: calibration batch (a model with a fixed batch uses its own).
    error_samples: calibration samples used to measure the error vs FP32 (and by the budget search).
    weight_bits: 8 or 7 (reduced range); None picks 7 where this CPU's onnxruntime int8 GEMM saturates, else 8."""
    mode: str = "static"
    weight_method: str = "minmax"
    activation: ObserverConfig = field(default_factory=_default_activation)
    op_types: tuple[str, ...] = ("Conv", "Gemm", "MatMul")
    quantize_outputs: bool = True
    quantize_bias: bool = True
    exclude: tuple[str, ...] = ()
    batch_size: int = 32
    error_samples: int = 256
    fallback: FallbackConfig = field(default_factory=FallbackConfig)
    weight_bits: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("static", "weight_only"):
            raise ValueError(f"PTQ mode must be 'static' or 'weight_only', got {self.mode!r}")
        if self.activation.axis is not None:
            raise ValueError("activations are quantized per tensor: PTQConfig.activation.axis must be None")
        if self.batch_size < 1 or self.error_samples < 1:
            raise ValueError("batch_size and error_samples must be >= 1")
        if self.weight_bits not in (None, 7, 8):
            raise ValueError(f"weight_bits must be 7, 8 or None (automatic), got {self.weight_bits!r}")


def _weight_qparams(model: onnx.ModelProto, layer: Layer, method: str) -> QParams:
    obs = make_observer(ObserverConfig(method=method, axis=layer.weight_axis))
    obs.update(weight_array(model, layer.weight))
    scale, zero = obs.qparams()
    return QParams(scale, zero, layer.weight_axis)


class _Quantizer:
    """Holds the calibrated parameters so the budget search can rebuild the model for any layer subset."""

    def __init__(self, model: onnx.ModelProto, layers: list[Layer], config: PTQConfig) -> None:
        self.model, self.layers, self.config = model, layers, config
        self.weight_qmax = weight_qmax(config.weight_bits)
        self.weights = {l.name: on_weight_grid(_weight_qparams(model, l, config.weight_method), self.weight_qmax)
                        for l in layers if l.weight}
        self.acts: dict[str, QParams] = {}
        self.graph_outputs = {o.name for o in model.graph.output}

    def tensors_to_observe(self) -> list[str]:
        names = []
        for l in self.layers:
            names += l.activations
            if self.config.quantize_outputs and l.output not in self.graph_outputs:
                names.append(l.output)
        return list(dict.fromkeys(names))

    def calibrate(self, calib: dict[str, np.ndarray], progress) -> tuple[int, int]:
        observers = {t: make_observer(self.config.activation) for t in self.tensors_to_observe()}
        samples = calibrate.observe(self.model, calib, observers, self.config.batch_size, progress)
        self.acts = {t: QParams(*activation_qparams(o)) for t, o in observers.items()}
        return samples, len(calibrate.model_batches(self.model, calib, self.config.batch_size))

    def build(self, quantized: set[str]) -> onnx.ModelProto:
        plan = QDQPlan(quantize_bias=self.config.quantize_bias, weight_qmax=self.weight_qmax)
        for l in self.layers:
            if l.name not in quantized:
                plan.float_layers.add(l.name)
                continue
            if l.weight:
                plan.weights[l.name] = self.weights[l.name]
            outs = [l.output] if self.config.quantize_outputs else []
            for t in l.activations + outs:
                if t in self.acts:
                    plan.activations[t] = self.acts[t]
        return write_qdq(self.model, self.layers, plan)


def _candidates(scan: LayerScan, config: PTQConfig) -> tuple[list[Layer], list[dict]]:
    """Split the scanned layers into those to quantize and those kept float (with the reason)."""
    layers, floats = [], list(scan.skipped)
    for l in scan.layers:
        if l.name in config.exclude:
            floats.append({"name": l.name, "op": l.op, "reason": "excluded by config"})
        elif config.mode == "weight_only" and l.weight is None:
            floats.append({"name": l.name, "op": l.op, "reason": "weight_only: no constant weight"})
        else:
            layers.append(l)
    return layers, floats


def quantize_onnx(model: onnx.ModelProto, calib: dict[str, np.ndarray], config: PTQConfig,
                  budget: float | None = None,
                  progress: Callable[[int, int], None] | None = None) -> tuple[onnx.ModelProto, dict]:
    """Quantize `model` to int8 QDQ. calib: one float array per model input, batch first. budget: max
    relative output error vs FP32 on the calibration samples; layers are kept in float (most sensitive first)
    until it holds. progress(done, total) is called after each calibration batch."""
    if not isinstance(config, PTQConfig):
        raise TypeError(f"config must be a PTQConfig, got {type(config).__name__}")
    check_budget(budget, "quantize_onnx")
    model = check_model(model)
    calib = calibrate.check_calib(model, calib)
    layers, floats = _candidates(find_layers(model, config.op_types), config)
    if not layers:
        why = "; ".join(f"{f['name']} ({f['op']}): {f['reason']}" for f in floats) or "no Conv/Gemm/MatMul nodes"
        raise ValueError(f"int8 quantization found no layer to quantize: {why}")
    q = _Quantizer(model, layers, config)
    samples, n_batches = q.calibrate(calib, progress) if config.mode == "static" else (0, 0)

    n_eval = min(config.error_samples, next(iter(calib.values())).shape[0])
    eval_data = {k: v[:n_eval] for k, v in calib.items()}
    ref = calibrate.run(model, eval_data, config.batch_size)
    errors: dict[frozenset, dict[str, float]] = {}  # quantized subset -> per-output error (budget search)

    def measure(quantized: set[str]) -> float:
        key = frozenset(quantized)
        if key not in errors:
            errors[key] = calibrate.rel_errors(ref, calibrate.run(q.build(quantized), eval_data, config.batch_size))
        return max(errors[key].values())

    by_name = {l.name: l for l in layers}
    full = measure(set(by_name))
    report: dict = {"budget": budget, "sensitivity": {}, "fallback_steps": [[0, full]]}
    kept: list[str] = []
    if budget is not None:
        res = fit_budget(measure, list(by_name), budget, config.fallback, full_error=full)
        kept, report["sensitivity"], report["fallback_steps"] = res.float_layers, res.sensitivity, res.steps
    final = set(by_name) - set(kept)
    model_q = q.build(final)
    measure(final)
    errs = errors[frozenset(final)]
    for name in kept:
        floats.append({"name": name, "op": by_name[name].op,
                       "reason": f"sensitivity {report['sensitivity'][name]:.3g} ({config.fallback.method}); "
                                 f"kept float to meet budget {budget}"})
    report.update({
        "mode": config.mode,
        "weight_range": weight_range_label(q.weight_qmax),
        "calibration": {"samples": samples, "batches": n_batches, "activation_observer": config.activation.method,
                        "weight_observer": config.weight_method},
        "quantized": [{"name": l.name, "op": l.op, "weight": l.weight,
                       "weight_axis": l.weight_axis if l.weight else None,
                       "activations": l.activations if config.mode == "static" else []}
                      for l in layers if l.name in final],
        "float": floats,
        "error": {"outputs": errs, "max_rel_error": max(errs.values()), "samples": n_eval},
        "ort_int8_kernels": {k: v for k, v in calibrate.optimized_op_counts(model_q).items() if k in INT8_KERNELS},
    })
    onnx.checker.check_model(model_q)
    return model_q, report
