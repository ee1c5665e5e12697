"""quantize_module is a preset of automp.quant.quantize: the same model as the verb, then compiled and timed; its own
arguments and TorchQuantConfig checked."""
import json

import pytest
import torch
import torch.nn as nn

from automp.deploy.quantized import TorchQuantConfig, optimize_torch, quantize_module
from automp.quant import W8A8Config, WeightOnlyConfig, quantize
from automp.quant.ptq import Rule

from tests.quant.torch_helpers import DEVICE, mlp, randn

EAGER = TorchQuantConfig(compile=False)
# budgets between the all-quantized model's error and the float model's, so that the fallback runs
CASES = {"int8": (lambda calib, budget: W8A8Config(calib=calib, budget=budget), 8e-3),
         "int8-weight": (lambda calib, budget: WeightOnlyConfig(8, calib=calib, budget=budget), 4e-3),
         "int4-weight": (lambda calib, budget: WeightOnlyConfig(4, calib=calib, budget=budget), 0.07)}


def _outlier_mlp() -> nn.Sequential:
    """Three Linears with K = 128, 96, 64 (weight groups of 128, 32, 64); the first writes one input channel of the
    second ~30x the others (SmoothQuant's case)."""
    net = mlp(128, 96, 64, 32, seed=1)
    with torch.no_grad():
        net[0].weight[7] *= 30.0
        net[0].bias[7] = 20.0
    return net


def _decisions(report) -> list[tuple]:
    return [(d.name, d.precision, d.rule, d.reason, d.group, d.sensitivity, d.shares) for d in report.layers]


@pytest.mark.parametrize("precision", sorted(CASES))
def test_the_preset_builds_the_verbs_model(precision):
    make, budget = CASES[precision]
    net = _outlier_mlp()
    calib = [randn(8, 128, seed=s).to(DEVICE) for s in (1, 2)]
    verb = quantize(net, make(calib, budget))
    preset, rep = quantize_module(net, precision, calib, TorchQuantConfig(compile=False, measure=False, budget=budget))
    ours = verb.quant_report
    assert Rule.ERROR_BUDGET in {d.rule for d in ours.layers} and Rule.QUANTIZED in {d.rule for d in ours.layers}
    assert precision != "int8" or (ours.activations == "static" and ours.smooth is not None)
    got, want = preset.state_dict(), verb.state_dict()
    assert sorted(got) == sorted(want)
    assert any(k.endswith(("qweight", "qw")) for k in want)  # quantized layers' buffers are among those compared
    for key, value in want.items():
        assert value.dtype == got[key].dtype and torch.equal(value, got[key]), key
    assert _decisions(rep) == _decisions(ours)
    assert (rep.smooth, rep.smooth_search, rep.fallback_steps, rep.activations) == (
        ours.smooth, ours.smooth_search, ours.fallback_steps, ours.activations)
    assert rep.speed == {"measured": False, "why": "turned off (TorchQuantConfig.measure=False)"}


def test_calibration_batches_from_an_iterator_are_read_once():
    """The preset reads calib once for the conversion and the speed check: an iterator gives what a list gives."""
    net = mlp(32, 48, 16)
    calib = [randn(4, 32, seed=s).to(DEVICE) for s in (3, 4)]
    from_list, rep = quantize_module(net, "int8", calib, EAGER)
    from_iter, rep_iter = quantize_module(net, "int8", iter(calib), EAGER)
    assert rep_iter.error_data == rep.error_data == "calibration data (2 batches)"
    assert all(torch.equal(v, from_iter.state_dict()[k]) for k, v in from_list.state_dict().items())


def test_optimize_torch_returns_a_json_report():
    net = mlp(32, 32)
    model, rep = optimize_torch(net, "int8", [randn(4, 32, seed=7).to(DEVICE)], budget=0.5,
                                config=EAGER)
    assert rep["budget"] == 0.5 and rep["layers"][0]["rule"] == "quantized" and rep["rules"] == {"quantized": 1}
    json.dumps(rep)


def test_bad_arguments():
    net = mlp(16, 8)
    with pytest.raises(ValueError, match="precision must be one of"):
        quantize_module(net, "int3", None, EAGER)
    with pytest.raises(TypeError, match="nn.Module"):
        quantize_module(lambda x: x, "int8")
    with pytest.raises(TypeError, match="TorchQuantConfig"):
        quantize_module(net, "int8", None, {"budget": 0.1})
    with pytest.raises(ValueError, match="budget needs calib"):
        quantize_module(net, "int8", None, TorchQuantConfig(budget=0.1))
    with pytest.raises(ValueError, match="activations 'static' needs calib"):
        quantize_module(net, "int8", None, TorchQuantConfig(activations="static"))
    with pytest.raises(ValueError, match="no nn.Linear"):
        quantize_module(nn.Sequential(nn.LayerNorm(4)), "int8")
    for bad in ({"activations": "per-channel"}, {"smooth": 2.0}, {"smooth": "best"}, {"budget": -1.0},
                {"sensitivity": "random"}, {"dtype": torch.float32}, {"group_size": 256}, {"max_calib_batches": 0}):
        field = next(iter(bad))
        with pytest.raises(ValueError, match=f"TorchQuantConfig: {field} must be"):
            TorchQuantConfig(**bad)
    with pytest.raises(TypeError, match="exclude must be a tuple"):
        TorchQuantConfig(exclude="head")
