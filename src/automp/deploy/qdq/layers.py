"""Which ONNX nodes int8 quantization touches, and the checks a model must pass before we rewrite it.

A "layer" is a Conv / Gemm / MatMul node: the ops onnxruntime has int8 kernels for (QLinearConv, QGemm,
QLinearMatMul / MatMulIntegerToFloat). Everything else stays float and only sees dequantized tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import numpy_helper

from automp.deploy.onnx_io import fit_ir_version

MIN_OPSET = 13  # per-axis QuantizeLinear/DequantizeLinear (per-channel weights) arrived in opset 13
SUPPORTED_OPS = ("Conv", "Gemm", "MatMul")


@dataclass
class Layer:
    """One quantizable node. weight is a float32 initializer (None: both inputs are activations)."""
    name: str
    op: str
    activations: list[str]
    output: str
    weight: str | None = None
    weight_index: int = 1
    weight_axis: int = 0          # output-channel axis of the weight tensor (one scale per output channel)
    bias: str | None = None       # int32-quantizable bias initializer (Conv/Gemm with alpha = beta = 1)


@dataclass
class LayerScan:
    layers: list[Layer] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"name", "op", "reason"} for nodes left float


def check_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """Reject what we cannot quantize with a message naming the problem; return a copy safe to rewrite."""
    if not isinstance(model, onnx.ModelProto):
        raise TypeError(f"expected an onnx.ModelProto, got {type(model).__name__}")
    try:
        onnx.checker.check_model(model)
    except Exception as e:  # onnx raises several checker/validation types across versions
        raise ValueError(f"invalid ONNX model: {e}") from e
    ops = {n.op_type for n in model.graph.node}
    if ops & {"QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "DynamicQuantizeLinear"}:
        raise ValueError("model is already quantized (contains QuantizeLinear/DequantizeLinear/QLinear* nodes)")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise ValueError("model has no default-domain (ai.onnx) opset import")
    if opset < MIN_OPSET:
        try:
            out = onnx.version_converter.convert_version(out, MIN_OPSET)
        except Exception as e:
            raise ValueError(f"model opset {opset} < {MIN_OPSET} and converting it failed: {e}") from e
        fit_ir_version(out, floor=model.ir_version)  # the input's IR version, unless the new opset needs more
    seen: set[str] = set()
    for i, node in enumerate(out.graph.node):  # stable unique names: plans and reports are keyed by them
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)
    return out


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor shape inference can type (absent: unknown)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is best effort: unknown types are checked again at calibration time
        inferred = model
    g = inferred.graph
    return {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input) + list(g.output)
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}


def find_layers(model: onnx.ModelProto, op_types: tuple[str, ...] = SUPPORTED_OPS) -> LayerScan:
    inits = {i.name: i for i in model.graph.initializer}
    is_float = lambda n: n in inits and inits[n].data_type == onnx.TensorProto.FLOAT  # noqa: E731
    types = tensor_types(model)
    scan = LayerScan()
    for node in model.graph.node:
        if node.op_type not in op_types:
            continue
        skip = lambda why: scan.skipped.append({"name": node.name, "op": node.op_type, "reason": why})  # noqa
        if node.op_type not in SUPPORTED_OPS:
            skip(f"no int8 path for {node.op_type}")
            continue
        a, b = node.input[0], node.input[1]
        if a in inits:
            skip("first input is a constant: no activation to quantize")
            continue
        odd = [t for t in (a, b) if t not in inits and types.get(t, onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT]
        if odd:
            skip(f"input {odd[0]!r} is {onnx.TensorProto.DataType.Name(types[odd[0]])}, not float32")
            continue
        if node.op_type == "MatMul":
            if b in inits and not is_float(b):
                skip("weight initializer is not float32")
            elif b in inits:
                ndim = len(inits[b].dims)
                scan.layers.append(Layer(node.name, "MatMul", [a], node.output[0], b, 1, ndim - 1))
            else:
                scan.layers.append(Layer(node.name, "MatMul", [a, b], node.output[0]))
            continue
        if not is_float(b):
            skip("weight is not a float32 initializer")
            continue
        layer = Layer(node.name, node.op_type, [a], node.output[0], b, 1, 0)
        if node.op_type == "Gemm":
            layer.weight_axis = 0 if _attr(node, "transB", 0) else 1
        bias = node.input[2] if len(node.input) > 2 else ""
        scaled = node.op_type == "Gemm" and (_attr(node, "alpha", 1.0) != 1.0 or _attr(node, "beta", 1.0) != 1.0)
        if is_float(bias) and len(inits[bias].dims) == 1 and not scaled:
            layer.bias = bias
        scan.layers.append(layer)
    return scan


def weight_array(model: onnx.ModelProto, name: str):
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    raise KeyError(f"initializer {name!r} not found")
