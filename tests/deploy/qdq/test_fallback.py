import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from automp.deploy.qdq.ptq import PTQConfig, quantize_onnx
from automp.quant.fallback import FallbackConfig, fit_budget
from tests.quant.helpers import ort_run, rel_err

_OWN_ERROR = {"a": 0.5, "b": 0.1, "c": 0.05}


def _additive(quantized: set[str]) -> float:
    return sum(_OWN_ERROR[n] for n in quantized)


@pytest.mark.parametrize("method", ["isolate", "drop"])
def test_fit_budget_drops_most_sensitive_first(method):
    res = fit_budget(_additive, ["c", "a", "b"], budget=0.12, config=FallbackConfig(method=method))
    assert res.float_layers == ["a", "b"]
    assert res.error == pytest.approx(0.05) and res.error <= 0.12
    assert res.sensitivity == pytest.approx(_OWN_ERROR)
    assert [n for n, _ in res.steps] == [0, 1, 2]
    assert res.steps[0][1] == pytest.approx(0.65) and res.steps[1][1] == pytest.approx(0.15)


def test_fit_budget_keeps_everything_quantized_when_budget_holds():
    res = fit_budget(_additive, ["a", "b", "c"], budget=1.0)
    assert res.float_layers == [] and res.sensitivity == {} and res.error == pytest.approx(0.65)


def test_bad_budget_and_method():
    with pytest.raises(ValueError, match="budget"):
        fit_budget(_additive, ["a"], budget=0.0)
    with pytest.raises(ValueError, match="isolate"):
        FallbackConfig(method="random")


def _outlier_mlp() -> onnx.ModelProto:
    """fc1 sees one input feature 1000x larger than the rest (barely used by its weights): a per-tensor
    activation scale sized for that feature rounds every other feature to zero, so fc1 is very sensitive.
    fc2 sees ordinary ReLU activations."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(0, 0.3, (16, 32)).astype(np.float32)
    w1[0] *= 1e-4
    arrays = {"w1": w1, "b1": rng.normal(0, 0.1, 32), "w2": rng.normal(0, 0.3, (32, 4)), "b2": rng.normal(0, 0.1, 4)}
    inits = [numpy_helper.from_array(a.astype(np.float32), name) for name, a in arrays.items()]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], inits)
    return helper.make_model_gen_version(graph, opset_imports=[helper.make_opsetid("", 17)])


def _inputs(seed: int, n: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, 16)).astype(np.float32)
    x[:, 0] *= 1000.0
    return x


def test_fallback_keeps_the_sensitive_layer_float():
    model, x = _outlier_mlp(), _inputs(1, 256)
    _, plain = quantize_onnx(model, {"x": x}, PTQConfig())
    assert plain["error"]["max_rel_error"] > 0.2  # int8 everywhere breaks this model

    budget = 0.02
    qmodel, report = quantize_onnx(model, {"x": x}, PTQConfig(), budget=budget)
    assert [f["name"] for f in report["float"]] == ["fc1"]
    assert "sensitivity" in report["float"][0]["reason"] and str(budget) in report["float"][0]["reason"]
    assert [q["name"] for q in report["quantized"]] == ["fc2"]
    assert report["sensitivity"]["fc1"] > 10 * report["sensitivity"]["fc2"]
    assert report["error"]["max_rel_error"] <= budget
    assert report["fallback_steps"][0][1] == pytest.approx(plain["error"]["max_rel_error"])
    # fc1 really reads float: its weight stays float, fc2's is int8
    inits = {i.name: i.data_type for i in qmodel.graph.initializer}
    assert inits["w1"] == TensorProto.FLOAT and inits["w2_quantized"] == TensorProto.INT8
    fc1 = next(n for n in qmodel.graph.node if n.name == "fc1")
    assert list(fc1.input) == ["x", "w1", "b1"]
    xt = _inputs(2, 128)
    assert rel_err(ort_run(qmodel, {"x": xt})[0], ort_run(model, {"x": xt})[0]) < 2 * budget
