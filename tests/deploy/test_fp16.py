import numpy as np
import pytest
from onnx import TensorProto, helper

from automp.deploy import runtime
from automp.deploy.fp16 import ONNX_TO_ATEN, Fp16Config, convert_fp16
from automp.precision.lists import Category, classify_name
from automp.quant.ptq.compare import compare_all

from .util import assert_same_outputs, f32, init, model, ops, rand


def _dtypes(rep):
    return {n["name"]: n["dtype"] for n in rep.nodes}


def _mlp():
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
             helper.make_node("Relu", ["hb"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "w2"], ["logits"], name="mm2"),
             helper.make_node("Softmax", ["logits"], ["p"], name="softmax", axis=-1),
             helper.make_node("Exp", ["r"], ["e"], name="exp")]
    inits = [init("w1", rand(16, 32, seed=1, scale=0.25)), init("b1", rand(32, seed=2)),
             init("w2", rand(32, 8, seed=3, scale=0.2))]
    return model(nodes, [f32("x", ["n", 16])], [f32("p", ["n", 8]), f32("logits", ["n", 8]), f32("e", ["n", 32])],
                 inits)


def test_mlp_follows_the_op_lists_and_keeps_float32_io():
    before = _mlp()
    after, rep = convert_fp16(before)
    d = _dtypes(rep)
    assert d["mm1"] == d["mm2"] == "float16"  # ALLOW
    assert d["bias1"] == d["relu"] == "float16"  # INFER after an fp16 producer
    assert d["softmax"] == d["exp"] == "float32"  # DENY
    assert [(o.name, o.type.tensor_type.elem_type) for o in after.graph.output] == \
        [(o.name, TensorProto.FLOAT) for o in before.graph.output]
    assert [(i.name, i.type.tensor_type.elem_type) for i in after.graph.input] == [("x", TensorProto.FLOAT)]
    # weights stored in fp16, fp32 copies gone
    kinds = {t.name: t.data_type for t in after.graph.initializer}
    assert set(kinds.values()) == {TensorProto.FLOAT16} and "w1" not in kinds
    assert "Cast" in ops(after) and rep.casts["inserted"] >= 3
    assert_same_outputs(before, after, tol=1e-2)
    assert len(before.graph.node) == 6 and "Cast" not in ops(before)


def test_fp16_error_is_small_but_nonzero_against_fp32():
    before = _mlp()
    after, _ = convert_fp16(before)
    feeds = runtime.random_feeds(before, batch=64, seed=5)
    errs = compare_all(runtime.run(after, feeds), runtime.run(before, feeds))
    assert 0 < errs["logits"].rel_l2 < 5e-3 and errs["p"].cosine > 0.999


def test_constant_outside_fp16_range_keeps_node_fp32():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Mul", ["h", "big"], ["y"], name="scale_big"),
             helper.make_node("Mul", ["h", "small"], ["z"], name="scale_ok")]
    before = model(nodes, [f32("x", ["n", 4])], [f32("y", ["n", 4]), f32("z", ["n", 4])],
                   [init("w", rand(4, 4, seed=1)), init("big", np.float32([1e6])), init("small", np.float32([3.0]))])
    after, rep = convert_fp16(before)
    d = _dtypes(rep)
    assert d["mm"] == "float16" and d["scale_big"] == "float32" and d["scale_ok"] == "float16"
    assert_same_outputs(before, after, tol=1e-2)


def test_inverse_cast_pair_is_cancelled():
    # an explicit Cast(to=float) between two matmuls is an identity in fp32; in fp16 it would be f16->f32->f16
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Cast", ["h"], ["hc"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["hc", "w2"], ["y"])]
    before = model(nodes, [f32("x", ["n", 8])], [f32("y", ["n", 8])],
                   [init("w1", rand(8, 8, seed=1, scale=0.3)), init("w2", rand(8, 8, seed=2, scale=0.3))])
    after, rep = convert_fp16(before)
    assert rep.casts["eliminated"] >= 1
    mm2 = [n for n in after.graph.node if n.op_type == "MatMul"][1]
    producer = {o: n for n in after.graph.node for o in n.output}
    assert producer[mm2.input[0]].op_type == "MatMul"  # reads the fp16 matmul output directly
    assert ops(after).count("Cast") == 2  # x -> fp16 at the input, y -> fp32 at the output
    assert_same_outputs(before, after, tol=1e-2)


def test_conv_net_and_keep_fp32_config():
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool"),
             helper.make_node("Conv", ["p1", "w2"], ["c2"], name="conv2"),
             helper.make_node("GlobalAveragePool", ["c2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], transB=1, name="fc")]
    inits = [init("w1", rand(8, 3, 3, 3, seed=1, scale=0.3)), init("b1", rand(8, seed=2, scale=0.1)),
             init("w2", rand(6, 8, 1, 1, seed=3, scale=0.3)), init("wf", rand(5, 6, seed=4)),
             init("bf", rand(5, seed=5))]
    before = model(nodes, [f32("x", ["n", 3, 8, 8])], [f32("y", ["n", 5])], inits)
    after, rep = convert_fp16(before)
    d = _dtypes(rep)
    assert all(d[k] == "float16" for k in ("conv1", "relu1", "pool", "conv2", "gap", "flat", "fc"))
    assert_same_outputs(before, after, tol=1e-2)
    _, rep2 = convert_fp16(before, Fp16Config(keep_fp32=("conv2",)))
    d2 = _dtypes(rep2)
    assert d2["conv2"] == "float32" and d2["gap"] == "float32" and d2["fc"] == "float16"


def test_every_mapped_onnx_op_is_on_a_precision_list():
    unknown = [op for op, aten in ONNX_TO_ATEN.items() if classify_name(aten) is Category.UNKNOWN]
    assert unknown == []


@pytest.mark.parametrize("op", ["Softmax", "LayerNormalization"])
def test_deny_ops_get_fp32_inputs_from_an_fp16_producer(op):
    extra = [init("g", np.ones(8, np.float32)), init("b", np.zeros(8, np.float32))] if op != "Softmax" else []
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node(op, ["h"] + (["g", "b"] if extra else []), ["y"], name="deny", axis=-1)]
    before = model(nodes, [f32("x", ["n", 8])], [f32("y", ["n", 8])], [init("w", rand(8, 8, seed=1))] + extra)
    after, rep = convert_fp16(before)
    deny = next(n for n in after.graph.node if n.op_type == op)
    producer = {o: n for n in after.graph.node for o in n.output}
    cast = producer[deny.input[0]]
    assert cast.op_type == "Cast" and cast.attribute[0].i == TensorProto.FLOAT
    assert_same_outputs(before, after, tol=1e-2)


def test_float16_graph_output_keeps_its_type_and_gets_no_extra_cast():
    half = helper.make_tensor_value_info
    nodes = [helper.make_node("Cast", ["x"], ["xh"], to=TensorProto.FLOAT16),
             helper.make_node("MatMul", ["xh", "w"], ["y"], name="mm")]
    before = model(nodes, [f32("x", ["n", 4])], [half("y", TensorProto.FLOAT16, ["n", 4])],
                   [init("w", rand(4, 4, seed=1).astype(np.float16))])
    after, rep = convert_fp16(before)
    assert after.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert ops(after) == ["Cast", "MatMul"] and rep.casts["inserted"] == 0
    assert_same_outputs(before, after, tol=0)


def test_mixed_inputs_to_an_infer_op_run_in_fp32_and_embedding_tables_go_fp16():
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])
    nodes = [helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
             helper.make_node("MatMul", ["emb", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "x"], ["y"], name="residual")]  # fp16 matmul + fp32 graph input
    before = model(nodes, [ids, f32("x", ["n", 4])], [f32("y", ["n", 4])],
                   [init("table", rand(10, 4, seed=1)), init("w", rand(4, 4, seed=2))])
    after, rep = convert_fp16(before)
    d = _dtypes(rep)
    assert d == {"embed": "float16", "mm": "float16", "residual": "float32"}
    assert_same_outputs(before, after, tol=1e-2, int_high=10)
