"""torch -> ONNX: a float export that works across torch versions, and the QAT -> QDQ export.

The QAT export does not trace the fake-quant arithmetic: it exports the float graph (same parameters) and lets
the QDQ writer put int8 weights and Q/DQ pairs around each layer using the learned scales. That gives the exact
graph PTQ produces (ORT fuses it into int8 kernels) and stores real int8 weights, while tracing fake quant would
store float weights and depend on per-exporter support for fake_quantize ops.

The exported weights keep the learned 8-bit grid, except on CPUs where onnxruntime's int8 GEMM saturates on
full-range weights (qdq.int8_gemm_saturates) and the fused int8 model measurably departs from its own QDQ
arithmetic on the example inputs: there the learned weights are re-rounded onto a 7-bit grid with the same
clipping range. That costs one extra weight rounding step, so it is only taken where the saturating kernel
would cost more; a model whose weights rarely saturate keeps the grid it was trained on.
"""
from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import torch
from torch import nn

from automp.deploy.onnx_io import fit_ir_version
from automp.deploy.qdq import calibrate, qdq
from automp.deploy.qdq.layers import Layer, check_model, find_layers, weight_array
from automp.deploy.qdq.qdq import (REDUCED_WEIGHT_QMAX, WEIGHT_QMAX, QDQPlan, QParams, on_weight_grid, weight_qmax,
                                  write_qdq)
from automp.quant.api import set_module
from automp.quant.qat import QATLinear, qat_layers

KERNEL_DRIFT_TOL = 1e-2  # fused int8 output vs the op-by-op QDQ output beyond which the 8-bit grid is given up


def export_float(model: nn.Module, example_inputs: tuple, input_names: list[str] | None = None,
                 output_names: list[str] | None = None, opset: int = 17) -> onnx.ModelProto:
    """Export with a dynamic batch axis: the dynamo exporter first, the TorchScript exporter if it fails. The IR
    version is the lowest its opsets need (what the exporter stamps may be too new for older onnxruntimes)."""
    model = model.eval()
    names = input_names or [f"input_{i}" for i in range(len(example_inputs))]
    errors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            batch = torch.export.Dim("batch")
            prog = torch.onnx.export(model, tuple(example_inputs), dynamo=True, input_names=names,
                                     output_names=output_names, dynamic_shapes=tuple({0: batch} for _ in names),
                                     verbose=False)
            return fit_ir_version(prog.model_proto)
        except Exception as e:  # exporter failures come in many types; keep the message for the error below
            errors.append(f"dynamo=True: {type(e).__name__}: {e}")
        try:
            buf = io.BytesIO()
            outs = output_names or ["output_0"]
            axes = {n: {0: "batch"} for n in names + outs}
            torch.onnx.export(model, tuple(example_inputs), buf, dynamo=False, input_names=names,
                              output_names=outs, dynamic_axes=axes, opset_version=opset)
            return fit_ir_version(onnx.load_from_string(buf.getvalue()))
        except Exception as e:
            errors.append(f"dynamo=False: {type(e).__name__}: {e}")
    raise RuntimeError("torch.onnx.export failed with both exporters:\n" + "\n".join(errors))


def _float_copy(model: nn.Module) -> nn.Module:
    """Deep copy with every QAT layer turned back into the plain layer (same parameter names and values)."""
    out = copy.deepcopy(model)
    for name, m in list(qat_layers(out).items()):
        if isinstance(m, QATLinear):
            plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        else:
            plain = nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
                              m.groups, m.bias is not None, m.padding_mode)
        plain.weight, plain.bias = m.weight, m.bias
        set_module(out, name, plain)
    return out


def _match(layers: list[Layer], onnx_model: onnx.ModelProto, name: str, weight: np.ndarray) -> Layer:
    """The ONNX layer holding this module's weight: by initializer name, else by value (W or W^T)."""
    for layer in layers:
        if layer.weight == f"{name}.weight":
            return layer
    for layer in layers:
        if layer.weight is None:
            continue
        w = weight_array(onnx_model, layer.weight)
        if (w.shape == weight.shape and np.array_equal(w, weight)) or (
                w.ndim == 2 and w.shape == weight.T.shape and np.array_equal(w, weight.T)):
            return layer
    raise RuntimeError(f"could not find QAT layer {name!r} (weight {tuple(weight.shape)}) in the exported graph")


def kernel_drift(model: onnx.ModelProto, example_inputs: tuple) -> float:
    """Relative error of ORT's fused int8 kernels against the same QDQ model run op by op, on example_inputs:
    float rounding where the kernels compute the QDQ arithmetic, far more where their int16 sums saturate."""
    names = [i.name for i in calibrate.model_inputs(model)]
    feed = {n: (t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t))
            for n, t in zip(names, example_inputs)}
    fused, exact = (calibrate.session(model, fuse=f).run(None, feed) for f in (True, False))
    outs = [o.name for o in model.graph.output]
    return max(calibrate.rel_errors(dict(zip(outs, exact)), dict(zip(outs, fused))).values())


def _qdq_plan(layers_qat: dict[str, nn.Module], onnx_model: onnx.ModelProto, scan, qmax: int) -> QDQPlan:
    plan = QDQPlan(weight_qmax=qmax)
    for name, m in layers_qat.items():
        layer = _match(scan.layers, onnx_model, name, m.weight.detach().cpu().numpy())
        wscale = m.weight_fq.effective_scale().detach().cpu().numpy().astype(np.float32)
        learned = QParams(wscale, np.zeros(wscale.shape, np.int8), layer.weight_axis)
        plan.weights[layer.name] = on_weight_grid(learned, qmax)
        fq = m.input_fq
        zdtype = np.uint8 if int(fq.qrange[0]) == 0 else np.int8
        act = QParams(fq.effective_scale().detach().cpu().numpy().astype(np.float32),
                      fq.zero_point.detach().cpu().numpy().astype(zdtype))
        prev = plan.activations.setdefault(layer.activations[0], act)
        if prev is not act and (prev.scale != act.scale or prev.zero_point != act.zero_point):
            raise NotImplementedError(f"tensor {layer.activations[0]!r} feeds several QAT layers with different "
                                      "learned input scales; one Q/DQ pair per tensor cannot honour both")
    plan.float_layers = {l.name for l in scan.layers} - set(plan.weights)
    return plan


def export_qat_onnx(model: nn.Module, example_inputs: tuple, input_names: list[str] | None = None,
                    output_names: list[str] | None = None, weight_bits: int | None = None) -> onnx.ModelProto:
    """QDQ ONNX of a converted QAT model: int8 weights with the learned per-channel scales, Q/DQ on each
    layer input with the learned activation scale. Layers the exporter fused away or renamed are matched by
    weight value; a QAT layer that cannot be found is an error, never silently left float.
    weight_bits: 8 (the learned grid) or 7 (the learned clipping range on 63 levels a side). None: 8, unless this
    CPU's onnxruntime int8 GEMM saturates and the 8-bit model's kernel_drift on example_inputs exceeds
    KERNEL_DRIFT_TOL; a 7-bit model says so in its metadata_props."""
    layers_qat = qat_layers(model)
    if not layers_qat:
        raise ValueError("export_qat_onnx: model has no QAT layers (prepare_qat + train + convert_qat first)")
    if any(fq.scale.requires_grad for m in layers_qat.values() for fq in (m.weight_fq, m.input_fq)):
        raise ValueError("export_qat_onnx: call convert_qat(model) first (scales are still trainable)")
    weight_qmax(weight_bits)  # validates weight_bits
    onnx_model = check_model(export_float(_float_copy(model), example_inputs, input_names, output_names))
    scan = find_layers(onnx_model)
    qmax = WEIGHT_QMAX if weight_bits is None else weight_qmax(weight_bits)
    out = write_qdq(onnx_model, scan.layers, _qdq_plan(layers_qat, onnx_model, scan, qmax))
    if weight_bits is None and qdq.int8_gemm_saturates() and kernel_drift(out, example_inputs) > KERNEL_DRIFT_TOL:
        out = write_qdq(onnx_model, scan.layers, _qdq_plan(layers_qat, onnx_model, scan, REDUCED_WEIGHT_QMAX))
    onnx.checker.check_model(out)
    return out
