import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from automp.deploy.qdq.export import export_float
from automp.deploy.qdq.ptq import PTQConfig, quantize_onnx
from automp.quant.observers import ObserverConfig
from tests.quant.helpers import ONE_POINT, onnx_accuracy, ort_run, rel_err

INT8_TOL = 5e-2  # int8 per-channel weights + per-tensor uint8 activations on a small CNN / MLP


def _ops(model):
    return [n.op_type for n in model.graph.node]


def _io(model):
    return [(v.name, v.type.tensor_type.elem_type) for v in list(model.graph.input) + list(model.graph.output)]


def test_static_ptq_cnn(cnn_onnx, task):
    x, _, xt, _ = task
    calls = []
    qmodel, report = quantize_onnx(cnn_onnx, {"image": x[:256]}, PTQConfig(batch_size=64),
                                   progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    ops = _ops(qmodel)
    assert ops.count("QuantizeLinear") >= 4 and ops.count("Conv") == 2 and ops.count("Gemm") == 2
    assert _io(qmodel) == _io(cnn_onnx)  # same names, float32 I/O
    int8_weights = [i for i in qmodel.graph.initializer if i.data_type == TensorProto.INT8]
    assert {w.name for w in int8_weights} >= {"conv1.weight_quantized", "fc2.weight_quantized"}
    assert not any(i.name == "conv1.weight" for i in qmodel.graph.initializer)  # float copy dropped
    assert len(report["quantized"]) == 4 and report["float"] == []
    assert json.loads(json.dumps(report)) == report  # plain JSON for `automp optimize --report`
    # ORT turned the QDQ patterns into int8 kernels
    assert report["ort_int8_kernels"].get("QLinearConv", 0) == 2
    # fresh data, not the calibration set
    ref = ort_run(cnn_onnx, {"image": xt})[0]
    got = ort_run(qmodel, {"image": xt})[0]
    assert rel_err(got, ref) < INT8_TOL
    assert 0 < report["error"]["max_rel_error"] < INT8_TOL
    np.testing.assert_allclose(report["error"]["outputs"]["logits"],
                               rel_err(ort_run(qmodel, {"image": x[:256]})[0],
                                       ort_run(cnn_onnx, {"image": x[:256]})[0]), rtol=1e-4)


def test_static_ptq_keeps_top1(cnn_onnx, task):
    x, _, xt, yt = task
    qmodel, _ = quantize_onnx(cnn_onnx, {"image": x[:256]}, PTQConfig())
    fp32, int8 = onnx_accuracy(cnn_onnx, xt, yt), onnx_accuracy(qmodel, xt, yt)
    assert abs(int8 - fp32) <= ONE_POINT, (fp32, int8)


def test_weight_only_ptq(cnn_onnx, task):
    x, _, xt, _ = task
    qmodel, report = quantize_onnx(cnn_onnx, {"image": x[:64]}, PTQConfig(mode="weight_only"))
    assert "QuantizeLinear" not in _ops(qmodel) and _ops(qmodel).count("DequantizeLinear") == 4
    assert report["calibration"]["batches"] == 0 and all(q["activations"] == [] for q in report["quantized"])
    size = lambda m: sum(numpy_helper.to_array(i).nbytes for i in m.graph.initializer)  # noqa: E731
    assert size(qmodel) < 0.4 * size(cnn_onnx)
    err = rel_err(ort_run(qmodel, {"image": xt})[0], ort_run(cnn_onnx, {"image": xt})[0])
    assert err < 1e-2  # weights only: about the weight rounding error


@pytest.mark.parametrize("method,tol", [("percentile", INT8_TOL), ("mse", INT8_TOL), ("entropy", 0.1)])
def test_activation_observers_in_ptq(cnn_onnx, task, method, tol):
    """KL calibration clips the largest activations (here the bright square that carries the class), which
    costs output L2 error but not decisions: looser L2 tolerance, same top-1 requirement."""
    x, _, xt, yt = task
    cfg = PTQConfig(activation=ObserverConfig(method=method, dtype="uint8", symmetric=False), weight_method="mse")
    qmodel, report = quantize_onnx(cnn_onnx, {"image": x[:128]}, cfg)
    assert report["calibration"]["activation_observer"] == method
    assert rel_err(ort_run(qmodel, {"image": xt})[0], ort_run(cnn_onnx, {"image": xt})[0]) < tol
    assert abs(onnx_accuracy(qmodel, xt, yt) - onnx_accuracy(cnn_onnx, xt, yt)) <= ONE_POINT


class _Attention(torch.nn.Module):
    """MatMul between two activations plus bias-free Linear layers (MatMul with a constant weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(16, 16, bias=False)
        self.k = torch.nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1) @ x


def test_matmul_model_symmetric_int8_activations():
    torch.manual_seed(0)
    model = _Attention()
    x = np.random.default_rng(0).normal(size=(64, 8, 16)).astype(np.float32)
    proto = export_float(model, (torch.from_numpy(x[:2]),), ["x"], ["y"])
    cfg = PTQConfig(activation=ObserverConfig(method="minmax", dtype="int8", symmetric=True))
    qmodel, report = quantize_onnx(proto, {"x": x}, cfg)
    ops = {q["op"] for q in report["quantized"]}
    assert "MatMul" in ops
    act_act = [q for q in report["quantized"] if q["weight"] is None]
    assert act_act and all(len(q["activations"]) == 2 for q in act_act)
    zps = [numpy_helper.to_array(i) for i in qmodel.graph.initializer if i.name.endswith("_quantized_zero_point")]
    assert any(z.dtype == np.int8 for z in zps)  # signed activations stay symmetric int8
    xt = np.random.default_rng(1).normal(size=(16, 8, 16)).astype(np.float32)
    assert rel_err(ort_run(qmodel, {"x": xt})[0], ort_run(proto, {"x": xt})[0]) < INT8_TOL


def _gemm_model(opset: int, out_is_gemm: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.normal(size=(4,)).astype(np.float32), "b")
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y" if out_is_gemm else "h"])]
    if not out_is_gemm:
        nodes.append(helper.make_node("Relu", ["h"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], [w, b])
    return helper.make_model_gen_version(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_old_opset_is_converted_and_graph_output_layer_works():
    x = np.random.default_rng(2).normal(size=(40, 8)).astype(np.float32)
    model = _gemm_model(11)
    qmodel, report = quantize_onnx(model, {"x": x}, PTQConfig(batch_size=16))
    assert qmodel.opset_import[0].version >= 13
    assert (model.ir_version, qmodel.ir_version) == (6, 7)  # the input's, raised only as far as opset 13 needs
    assert [o.name for o in qmodel.graph.output] == ["y"]
    assert report["calibration"]["samples"] == 40  # dynamic batch: the short last batch is used too
    assert rel_err(ort_run(qmodel, {"x": x})[0], ort_run(model, {"x": x})[0]) < INT8_TOL


def test_fixed_batch_model_uses_its_batch_size():
    model = _gemm_model(17)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 4
    x = np.random.default_rng(3).normal(size=(10, 8)).astype(np.float32)
    _, report = quantize_onnx(model, {"x": x}, PTQConfig(batch_size=32))
    assert report["calibration"] == {**report["calibration"], "samples": 8, "batches": 2}


def test_bad_inputs_give_clear_errors(cnn_onnx, task):
    x = task[0][:8]
    with pytest.raises(TypeError, match="ModelProto"):
        quantize_onnx(b"not a model", {"image": x}, PTQConfig())
    with pytest.raises(ValueError, match="missing \\['image'\\]"):
        quantize_onnx(cnn_onnx, {"img": x}, PTQConfig())
    with pytest.raises(TypeError, match="int64"):
        quantize_onnx(cnn_onnx, {"image": x.astype(np.int64)}, PTQConfig())
    with pytest.raises(ValueError, match="budget"):
        quantize_onnx(cnn_onnx, {"image": x}, PTQConfig(), budget=-1.0)
    with pytest.raises(ValueError, match="mode"):
        PTQConfig(mode="dynamic")
    qmodel, _ = quantize_onnx(cnn_onnx, {"image": x}, PTQConfig(mode="weight_only"))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_onnx(qmodel, {"image": x}, PTQConfig())
    broken = onnx.ModelProto()
    broken.CopyFrom(cnn_onnx)
    broken.graph.node[0].input[0] = "no_such_tensor"
    with pytest.raises(ValueError, match="invalid ONNX model"):
        quantize_onnx(broken, {"image": x}, PTQConfig())
    fp16 = _gemm_model(17)
    fp16.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.ones((8, 4), np.float16), "w"))
    with pytest.raises(ValueError, match="no layer to quantize.*not a float32 initializer"):
        quantize_onnx(fp16, {"x": np.ones((2, 8), np.float32)}, PTQConfig())
    wrong_shape = {"image": np.ones((4, 3, 12, 12), np.float32)}
    with pytest.raises(RuntimeError, match="calibration batch 0"):
        quantize_onnx(cnn_onnx, wrong_shape, PTQConfig())


def test_non_float_layers_are_reported_and_left_alone():
    """A float32 model with an fp16 island: the fp16 MatMul is skipped with a reason, the float Gemm is int8."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(size=(8, 4)).astype(np.float16), "w16")]
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Cast", ["h"], ["h16"], to=TensorProto.FLOAT16, name="to_half"),
             helper.make_node("MatMul", ["h16", "w16"], ["y16"], name="half_mm"),
             helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT, name="to_float")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], inits)
    model = helper.make_model_gen_version(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.normal(size=(32, 8)).astype(np.float32)
    qmodel, report = quantize_onnx(model, {"x": x}, PTQConfig())
    assert [q["name"] for q in report["quantized"]] == ["fc"]
    assert report["float"] == [{"name": "half_mm", "op": "MatMul", "reason": "input 'h16' is FLOAT16, not float32"}]
    assert rel_err(ort_run(qmodel, {"x": x})[0], ort_run(model, {"x": x})[0]) < INT8_TOL


def embedding_model() -> tuple[onnx.ModelProto, np.ndarray]:
    """Token ids in (int64, like a transformer) through an embedding Gather, then a projection MatMul; and ids."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(rng.normal(size=(50, 16)).astype(np.float32), "emb"),
             numpy_helper.from_array(rng.normal(size=(16, 8)).astype(np.float32), "proj")]
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
             helper.make_node("MatMul", ["e", "proj"], ["y"], name="proj_mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6, 8])], inits)
    model = helper.make_model_gen_version(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, rng.integers(0, 50, (32, 6))


def test_integer_inputs_embedding_model():
    """Token ids in (int64, like a transformer): the embedding Gather stays float, the projection is int8."""
    model, ids = embedding_model()
    qmodel, report = quantize_onnx(model, {"ids": ids}, PTQConfig())
    assert [q["name"] for q in report["quantized"]] == ["proj_mm"]
    assert report["error"]["max_rel_error"] < INT8_TOL
    assert _io(qmodel) == _io(model)
    with pytest.raises(TypeError, match="ids"):
        quantize_onnx(model, {"ids": ids.astype(np.float32)}, PTQConfig())
