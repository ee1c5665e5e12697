"""FP16 inference graphs, decided by the same op lists as mixed-precision training.

Each ONNX op is mapped to the aten name it corresponds to and classified by `automp.precision.lists`:
ALLOW (MatMul, Conv, Gemm) runs in fp16; INFER/CLEAR (elementwise, data movement) runs in fp16 only when all its
non-constant float inputs already are, so a chain does not bounce between dtypes; DENY and UNKNOWN ops (softmax,
normalisation, reductions, anything unmapped) stay FP32 with Casts at the boundary; GATHER (embedding lookup of a
constant table) stores the table in fp16. Constants adapt to their consumer, unless a finite value lies outside
fp16's range, which keeps that node FP32. Graph inputs and outputs keep their names and float32 types.

ONNX type constraints decide which inputs must change together: inputs and outputs sharing a type variable
("T") switch dtype as a group, others (shapes, indices, Resize scales) are left alone.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from automp.deploy.passes.dce import dce
from automp.deploy.passes.graph import Graph, copy_model, has_subgraph, infer_shapes
from automp.precision.lists import Category, classify_name

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
FP16_MAX = 65504.0

# ONNX op_type -> the aten op with the same numerics (what the training pass would see).
ONNX_TO_ATEN = {
    "MatMul": "matmul", "Gemm": "addmm", "Conv": "convolution", "ConvTranspose": "conv_transpose2d",
    "FusedConv": "convolution", "FusedGemm": "addmm", "FusedMatMul": "matmul", "Einsum": "einsum",
    "Attention": "scaled_dot_product_attention", "MultiHeadAttention": "scaled_dot_product_attention",
    "Softmax": "softmax", "LogSoftmax": "log_softmax", "LayerNormalization": "layer_norm",
    "SkipLayerNormalization": "layer_norm", "SimplifiedLayerNormalization": "rms_norm", "RMSNormalization": "rms_norm",
    "BatchNormalization": "batch_norm", "InstanceNormalization": "group_norm", "GroupNormalization": "group_norm",
    "ReduceMean": "mean", "ReduceSum": "sum", "ReduceProd": "prod", "ReduceL2": "norm", "ReduceL1": "norm",
    "ReduceLogSumExp": "logsumexp", "ReduceSumSquare": "sum", "CumSum": "cumsum", "LpNormalization": "norm",
    "Exp": "exp", "Log": "log", "Pow": "pow", "Sqrt": "sqrt", "Reciprocal": "reciprocal",
    "Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Neg": "neg", "Abs": "abs", "Relu": "relu",
    "Gelu": "gelu", "FastGelu": "gelu", "BiasGelu": "gelu", "Sigmoid": "sigmoid", "Tanh": "tanh",
    "Erf": "erf", "Sin": "sin", "Cos": "cos", "LeakyRelu": "leaky_relu", "Elu": "elu", "HardSigmoid": "hardsigmoid",
    "HardSwish": "hardswish", "Mish": "mish", "Softplus": "softplus", "Where": "where", "Clip": "clamp",
    "Max": "maximum", "Min": "minimum", "Sign": "sign", "Floor": "floor", "Ceil": "ceil", "Round": "round",
    "Equal": "eq", "Less": "lt", "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge", "IsNaN": "isnan",
    "IsInf": "isinf", "ReduceMax": "amax", "ReduceMin": "amin", "ArgMax": "argmax", "ArgMin": "argmin",
    "TopK": "topk", "AveragePool": "avg_pool2d", "GlobalAveragePool": "adaptive_avg_pool2d", "Dropout": "dropout",
    "Reshape": "reshape", "Transpose": "transpose", "Squeeze": "squeeze", "Unsqueeze": "unsqueeze", "Concat": "cat",
    "Split": "split", "Slice": "slice", "Expand": "expand", "Flatten": "flatten", "Identity": "alias",
    "Tile": "tile", "Pad": "pad", "MaxPool": "max_pool2d", "GlobalMaxPool": "max_pool2d", "GatherElements": "gather",
    "GatherND": "gather", "DepthToSpace": "pixel_shuffle", "SpaceToDepth": "pixel_shuffle",
    "Resize": "upsample_nearest2d",
}
GATHER_TABLE = "embedding"  # Gather whose data input is a constant table


@dataclass
class Fp16Config:
    """keep_fp32: node names the user pins to FP32 (e.g. a layer known to overflow)."""
    keep_fp32: tuple[str, ...] = ()


@dataclass
class Fp16Report:
    nodes: list[dict] = field(default_factory=list)  # {name, op, dtype, reason}
    casts: dict[str, int] = field(default_factory=dict)  # inserted, eliminated, remaining
    constants_converted: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def category_of(node: onnx.NodeProto, g: Graph) -> tuple[Category, str]:
    if node.op_type == "Gather":
        if g.is_const(node.input[0]):
            return classify_name(GATHER_TABLE), "embedding"
        return classify_name("index_select"), "index_select"
    aten = ONNX_TO_ATEN.get(node.op_type)
    return (classify_name(aten), aten) if aten else (Category.UNKNOWN, node.op_type)


def _groups(node: onnx.NodeProto, opsets: dict[str, int]) -> list[tuple[list[int], list[int], bool]]:
    """(input indices, output indices, fp16 allowed) per type variable of the op's ONNX schema. Ops without a
    schema here (com.microsoft contrib ops) are taken as one group: all inputs and outputs share a type."""
    dom = node.domain or ""
    try:
        schema = onnx.defs.get_schema(node.op_type, opsets.get(dom, opsets.get("", 1)), dom)
    except onnx.defs.SchemaError:
        return [(list(range(len(node.input))), list(range(len(node.output))), True)]
    allowed = {t.type_param_str: "tensor(float16)" in t.allowed_type_strs for t in schema.type_constraints}

    def formal(params, k):
        return params[min(k, len(params) - 1)].type_str if params else None

    groups: dict[str, tuple[list[int], list[int]]] = {}
    for k in range(len(node.input)):
        groups.setdefault(formal(schema.inputs, k), ([], []))[0].append(k)
    for k in range(len(node.output)):
        groups.setdefault(formal(schema.outputs, k), ([], []))[1].append(k)
    return [(ins, outs, allowed[t]) for t, (ins, outs) in groups.items() if t in allowed]


class _Converter:
    def __init__(self, model: onnx.ModelProto, cfg: Fp16Config):
        self.model = model
        self.cfg = cfg
        self.g = Graph(model)
        self.opsets = {o.domain or "": o.version for o in model.opset_import}
        inferred = infer_shapes(model).graph
        self.dtype: dict[str, int] = {}  # elem type of every tensor of the new graph, by name
        for vi in list(inferred.input) + list(inferred.value_info) + list(inferred.output):
            if vi.type.tensor_type.elem_type:
                self.dtype[vi.name] = vi.type.tensor_type.elem_type
        for t in model.graph.initializer:
            self.dtype[t.name] = t.data_type
        self.original = dict(self.dtype)
        self.native: dict[str, str] = {}  # original name -> tensor that holds it in its decided dtype
        self.cache: dict[tuple[str, int], str] = {}
        self.pinned = self.g.graph_outputs | self.g.nested  # keep their name and original dtype
        self.new_nodes: list[onnx.NodeProto] = []
        self.report = Fp16Report()
        self.inserted = 0

    # ---- tensor access
    def read(self, name: str, want: int | None) -> str:
        """Name of a tensor holding `name` as dtype `want` (None: as it is), creating a cast or fp16 constant."""
        src = self.native.get(name, name)
        if want is None or self.dtype.get(src) == want or not name:
            return src
        if (name, want) in self.cache:
            return self.cache[(name, want)]
        value = self.g.const(name)
        if value is not None and name not in self.native:
            new = self.g.add_initializer(f"{name}_{'fp16' if want == F16 else 'fp32'}",
                                         value.astype(np.float16 if want == F16 else np.float32))
            self.report.constants_converted += 1
        else:
            new = self.g.fresh(f"{name}_cast_{'fp16' if want == F16 else 'fp32'}")
            self.new_nodes.append(helper.make_node("Cast", [src], [new], to=want, name=self.g.fresh(new)))
            self.inserted += 1
        self.dtype[new] = want
        self.cache[(name, want)] = new
        return new

    def is_float(self, name: str) -> bool:
        return bool(name) and self.dtype.get(self.native.get(name, name)) in (F32, F16)

    # ---- decisions
    def decide(self, node: onnx.NodeProto, float_ins: list[str], label: str) -> tuple[int, str]:
        if node.op_type == "Cast" or node.op_type == "Constant":
            return 0, "dtype fixed by the op itself"
        cat, aten = category_of(node, self.g)
        if label in self.cfg.keep_fp32:
            return F32, "kept FP32 by config"
        if has_subgraph(node):
            return F32, "has a subgraph: kept FP32"
        for name in float_ins:
            c = self.g.const(name) if name not in self.native else None
            if c is not None and c.size and np.abs(c[np.isfinite(c)]).max(initial=0) > FP16_MAX:
                return F32, f"constant {name!r} exceeds fp16 range ({FP16_MAX})"
        live = [n for n in float_ins if not self.g.is_const(n) or n in self.native]
        all_half = bool(live) and all(self.dtype.get(self.native.get(n, n)) == F16 for n in live)
        if cat is Category.ALLOW:
            return F16, f"{aten}: allow list (Tensor Cores, fp32 accumulation)"
        if cat is Category.GATHER and aten == GATHER_TABLE:
            return F16, "embedding lookup: table stored in fp16, lookup is exact"
        if cat in (Category.INFER, Category.CLEAR, Category.GATHER):
            if all_half:
                return F16, f"{aten}: {cat.value}, inputs are fp16"
            return F32, f"{aten}: {cat.value}, follows its fp32 inputs"
        if cat is Category.DENY:
            return F32, f"{aten}: deny list (needs fp32 range/precision)"
        return F32, f"{aten}: not on any list, kept FP32"

    def convert_node(self, node: onnx.NodeProto, index: int) -> None:
        label = node.name or f"{node.op_type}_{index}"
        groups = _groups(node, self.opsets)
        # a group with one input and no output (Shape, Size) reads only metadata: no dtype to decide
        float_groups = [gr for gr in groups if any(self.is_float(node.input[k]) for k in gr[0])
                        and (gr[1] or len(gr[0]) > 1)]
        float_ins = [node.input[k] for gr in float_groups for k in gr[0] if self.is_float(node.input[k])]
        want, why = self.decide(node, float_ins, label) if float_groups else (0, "no float data")
        if want == F16 and not all(gr[2] for gr in float_groups):
            want, why = F32, f"{node.op_type}: ONNX schema has no float16 variant"
        changed: set[int] = set()
        for ins, outs, _ in float_groups if want else []:
            dtypes = {self.dtype.get(self.native.get(node.input[k], node.input[k])) for k in ins
                      if self.is_float(node.input[k])}
            if not outs and len(dtypes) == 1:
                continue  # inputs-only group already consistent (e.g. Resize roi)
            for k in ins:
                if self.is_float(node.input[k]):
                    node.input[k] = self.read(node.input[k], want)
                    changed.add(k)
            for k in outs:
                if node.output[k]:
                    self.dtype[node.output[k]] = want
        for k, name in enumerate(node.input):
            if k not in changed:
                node.input[k] = self.read(name, None)
        self.new_nodes.append(node)
        for k, out in enumerate(node.output):
            if out and self.dtype.get(out) == F16 and out in self.pinned and self.original.get(out, F32) == F32:
                half = self.g.fresh(f"{out}_fp16")
                node.output[k] = half
                self.dtype[half], self.dtype[out] = F16, F32
                self.native[out] = half
                self.cache[(out, F32)] = out
                self.new_nodes.append(helper.make_node("Cast", [half], [out], to=F32, name=self.g.fresh(out + "_out")))
                self.inserted += 1
        if float_groups:
            dt = "float16" if want == F16 else "float32" if want == F32 else "fixed"
            self.report.nodes.append({"name": label, "op": node.op_type, "dtype": dt, "reason": why})

    def run(self) -> onnx.ModelProto:
        for k, node in enumerate(list(self.model.graph.node)):
            self.convert_node(node, k)
        del self.model.graph.node[:]
        self.model.graph.node.extend(self.new_nodes)
        del self.model.graph.value_info[:]  # stale dtypes; runtimes re-infer
        return self.model


def cancel_inverse_casts(model: onnx.ModelProto, dtype: dict[str, int]) -> int:
    """Cast(fp16->fp32) then Cast(fp32->fp16), or a Cast to the dtype it already has: readers take the original.
    Only exact round trips are cancelled (widen then narrow); narrow-then-widen loses bits and is kept."""
    g = Graph(model)
    removed = 0
    for node in list(model.graph.node):
        if node.op_type != "Cast" or node.output[0] in g.graph_outputs or node.output[0] in g.nested:
            continue
        to = next(a.i for a in node.attribute if a.name == "to")
        src = node.input[0]
        first = g.producer.get(src)
        if dtype.get(src) == to:
            g.rename_uses(node.output[0], src)
            removed += 1
        elif first is not None and first.op_type == "Cast" and dtype.get(first.input[0]) == to \
                and (dtype.get(first.input[0]), dtype.get(src)) == (F16, F32):
            g.rename_uses(node.output[0], first.input[0])
            removed += 1
    return removed


def convert_fp16(model: onnx.ModelProto, config: Fp16Config | None = None) -> tuple[onnx.ModelProto, Fp16Report]:
    conv = _Converter(copy_model(model), config or Fp16Config())
    out = conv.run()
    eliminated = cancel_inverse_casts(out, conv.dtype)
    out = dce(out)
    rep = conv.report
    rep.casts = {"inserted": conv.inserted, "eliminated": eliminated,
                 "remaining": sum(n.op_type == "Cast" for n in out.graph.node)}
    io = [(v.name, v.type.tensor_type.elem_type) for v in list(model.graph.input) + list(model.graph.output)]
    if [(v.name, v.type.tensor_type.elem_type) for v in list(out.graph.input) + list(out.graph.output)] != io:
        raise RuntimeError("fp16 conversion changed the graph's input/output names or types; this is a bug")
    return out, rep

