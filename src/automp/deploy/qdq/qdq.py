"""Write a QDQ-format ONNX model from a quantization plan.

QDQ = the float graph with QuantizeLinear -> DequantizeLinear pairs on activations and int8 weight initializers
behind DequantizeLinear. It is what onnxruntime turns into int8 kernels (DQ -> Conv -> Q becomes QLinearConv),
and the same file still runs anywhere float runs. Both PTQ (calibrated ranges) and QAT (learned scales) produce
a QDQPlan and call write_qdq, so the two paths emit identical graphs.

Weights: symmetric int8 in [-127, 127], or in [-63, 63] (7-bit) where onnxruntime's CPU int8 GEMM would
saturate on full-range weights (see int8_gemm_saturates); the 7-bit grid keeps the same clipping range.

Bias: a Conv/Gemm bias becomes int32 with scale s_x * s_w (what the int8 kernels accumulate in), which keeps the
DQ -> Conv pattern fusable; it stays float when its input activation is not quantized or int32 would overflow.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
from onnx import helper, numpy_helper

from automp.deploy.qdq.layers import Layer, weight_array

_INT32_MAX = 2 ** 31 - 1
WEIGHT_QMAX = 127          # weights are symmetric int8 in [-127, 127]
REDUCED_WEIGHT_QMAX = 63   # 7-bit weights: 2 * 255 * 63 = 32130 fits the int16 pair sum of VPMADDUBSW
REDUCED_RANGE_REASON = "AVX2 CPU without VNNI: onnxruntime's u8s8 GEMM saturates"
WEIGHT_RANGE_META_KEY = "automp.int8_weight_range"


def _cpu_flags() -> set[str] | None:
    """The x86 feature flags of /proc/cpuinfo (Linux); None where that file is not available."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        return None
    return None


@functools.lru_cache(maxsize=1)
def int8_gemm_saturates() -> bool:
    """Whether onnxruntime's CPU int8 GEMM loses accuracy on full-range int8 weights on this machine.

    On x86 with AVX2 (or AVX-512BW) but no VNNI, MLAS multiplies uint8 activations by int8 weights with
    VPMADDUBSW, which adds each pair of u8*s8 products into a saturating int16: 2 * 255 * 127 = 64770 does not
    fit 32767, so large products are silently clipped and the fused QLinearConv / QGemm / MatMulIntegerToFloat
    output drifts from the QDQ arithmetic (ORT's own quantizer offers reduce_range=True for such CPUs).
    With VNNI, VPDPBUSD accumulates the products in int32 and the kernels are exact; CPUs without AVX2 (ARM,
    older x86) do not run this kernel. Read from /proc/cpuinfo; where that is missing, torch's CPU capability
    stands in (AVX2 level: assume no VNNI, which costs at most the finer 8-bit weight grid).
    """
    flags = _cpu_flags()
    if flags is not None:
        return "avx2" in flags and not flags & {"avx512_vnni", "avx_vnni"}
    try:
        import torch
        return torch.backends.cpu.get_cpu_capability() == "AVX2"
    except Exception:  # no torch or an unknown build: no evidence of the saturating kernel
        return False


def weight_qmax(bits: int | None) -> int:
    """Largest weight level for `bits` (7 or 8); None picks 7 where int8_gemm_saturates(), else 8."""
    if bits is None:
        bits = 7 if int8_gemm_saturates() else 8
    if bits not in (7, 8):
        raise ValueError(f"weight bits must be 7 or 8 (or None for automatic), got {bits!r}")
    return REDUCED_WEIGHT_QMAX if bits == 7 else WEIGHT_QMAX


def weight_range_label(qmax: int) -> str:
    """The report's description of the weight grid."""
    return "8-bit" if qmax == WEIGHT_QMAX else f"7-bit ({REDUCED_RANGE_REASON})"


@dataclass
class QParams:
    scale: np.ndarray       # float32, shape [] (per-tensor) or [C] (per-channel along axis)
    zero_point: np.ndarray  # int8 / uint8, same shape as scale
    axis: int | None = None


@dataclass
class QDQPlan:
    """What to quantize. Layers not in `weights` and listed in `float_layers` read the original float tensors."""
    weights: dict[str, QParams] = field(default_factory=dict)       # layer name -> weight qparams
    activations: dict[str, QParams] = field(default_factory=dict)   # tensor name -> activation qparams
    float_layers: set[str] = field(default_factory=set)
    quantize_bias: bool = True
    weight_qmax: int = WEIGHT_QMAX  # weights are rounded onto [-weight_qmax, weight_qmax]


def on_weight_grid(qp: QParams, qmax: int) -> QParams:
    """qp's scale was chosen for [-127, 127]; the same clipping range [-127 s, 127 s] on `qmax` levels a side."""
    if qmax == WEIGHT_QMAX:
        return qp
    return replace(qp, scale=(np.asarray(qp.scale, np.float64) * WEIGHT_QMAX / qmax).astype(np.float32))


def quantize_weight(w: np.ndarray, qp: QParams, qmax: int = WEIGHT_QMAX) -> np.ndarray:
    s = np.asarray(qp.scale, np.float64)
    if qp.axis is not None:
        shape = [1] * w.ndim
        shape[qp.axis] = -1
        s = s.reshape(shape)
    return np.clip(np.round(w / s), -qmax, qmax).astype(np.int8)


def _dq_node(graph_inits: list, src: str, out: str, scale: np.ndarray, zero: np.ndarray,
             axis: int | None) -> onnx.NodeProto:
    graph_inits += [numpy_helper.from_array(np.asarray(scale, np.float32), f"{src}_scale"),
                    numpy_helper.from_array(np.asarray(zero), f"{src}_zero_point")]
    kw = {} if axis is None or np.ndim(scale) == 0 else {"axis": axis}
    return helper.make_node("DequantizeLinear", [src, f"{src}_scale", f"{src}_zero_point"], [out],
                            name=f"{src}_DequantizeLinear", **kw)


def _unique(taken: set[str], base: str) -> str:
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def write_qdq(model: onnx.ModelProto, layers: list[Layer], plan: QDQPlan) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    taken = {t for n in g.node for t in list(n.input) + list(n.output)} | {i.name for i in g.initializer}
    taken |= {i.name for i in g.input}
    nodes = {n.name: n for n in g.node}
    new_inits: list[onnx.TensorProto] = []
    weight_nodes: list[onnx.NodeProto] = []
    dequantized: dict[str, str] = {}  # initializer name -> its DQ output (weights shared by layers reuse it)

    for layer in layers:
        qp = plan.weights.get(layer.name)
        if qp is None or layer.weight is None:
            continue
        node = nodes[layer.name]
        if layer.weight not in dequantized:
            base = _unique(taken, f"{layer.weight}_quantized")
            q = quantize_weight(weight_array(model, layer.weight), qp, plan.weight_qmax)
            new_inits.append(numpy_helper.from_array(q, base))
            dequantized[layer.weight] = _unique(taken, f"{layer.weight}_dequantized")
            weight_nodes.append(_dq_node(new_inits, base, dequantized[layer.weight], qp.scale,
                                         np.zeros_like(qp.scale, np.int8), qp.axis))
        node.input[layer.weight_index] = dequantized[layer.weight]
        act = plan.activations.get(layer.activations[0])
        if plan.quantize_bias and layer.bias and act is not None:
            b = weight_array(model, layer.bias).astype(np.float64)
            bscale = float(act.scale) * np.broadcast_to(np.asarray(qp.scale, np.float64), b.shape)
            qb = np.round(b / bscale)
            if np.all(np.abs(qb) <= _INT32_MAX):
                base = _unique(taken, f"{layer.bias}_{layer.name}_quantized")
                new_inits.append(numpy_helper.from_array(qb.astype(np.int32), base))
                node.input[2] = _unique(taken, f"{layer.bias}_{layer.name}_dequantized")
                weight_nodes.append(_dq_node(new_inits, base, node.input[2], bscale.astype(np.float32),
                                             np.zeros(b.shape, np.int32), 0))

    qdq_after: dict[str, list[onnx.NodeProto]] = {}  # producer node name ("" = graph input) -> Q/DQ nodes
    producer = {o: n.name for n in g.node for o in n.output}
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in g.node:
        if n.name not in plan.float_layers:  # float layers keep reading the original float tensors
            for i, inp in enumerate(n.input):
                consumers.setdefault(inp, []).append((n, i))
    for tensor, qp in plan.activations.items():
        qname, dqname = _unique(taken, f"{tensor}_quantized"), _unique(taken, f"{tensor}_dequantized")
        new_inits += [numpy_helper.from_array(np.asarray(qp.scale, np.float32), f"{qname}_scale"),
                      numpy_helper.from_array(np.asarray(qp.zero_point), f"{qname}_zero_point")]
        qnode = helper.make_node("QuantizeLinear", [tensor, f"{qname}_scale", f"{qname}_zero_point"], [qname],
                                 name=f"{tensor}_QuantizeLinear")
        dq = helper.make_node("DequantizeLinear", [qname, f"{qname}_scale", f"{qname}_zero_point"], [dqname],
                              name=f"{tensor}_DequantizeLinear")
        qdq_after.setdefault(producer.get(tensor, ""), []).extend([qnode, dq])
        for n, i in consumers.get(tensor, []):
            n.input[i] = dqname

    ordered = weight_nodes + qdq_after.get("", [])
    for n in g.node:
        ordered.append(n)
        ordered.extend(qdq_after.get(n.name, []))
    del g.node[:]
    g.node.extend(ordered)
    g.initializer.extend(new_inits)
    used = {t for n in g.node for t in n.input} | {o.name for o in g.output} | {i.name for i in g.input}
    keep = [i for i in g.initializer if i.name in used]  # float weights now behind int8 copies
    del g.initializer[:]
    g.initializer.extend(keep)
    if plan.weights and plan.weight_qmax != WEIGHT_QMAX:  # the file says why its weights use fewer levels
        others = [p for p in out.metadata_props if p.key != WEIGHT_RANGE_META_KEY]
        del out.metadata_props[:]
        out.metadata_props.extend(others)
        meta = out.metadata_props.add()
        meta.key, meta.value = WEIGHT_RANGE_META_KEY, weight_range_label(plan.weight_qmax)
    return out
