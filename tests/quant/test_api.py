"""automp.quant.quantize: one verb, a config dataclass per scheme, handlers found by config type; with calibration
data, the PTQ pipeline on a new model."""
import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from automp.quant import (Int8Linear, QATConfig, W8A8Config, WeightOnlyConfig, WeightOnlyLinear, quantize,
                          register_handler)
from automp.quant.ptq import QuantizedModel, QuantReport
from automp.quant.qat import QATConv2d, QATLinear

from tests.quant.torch_helpers import DEVICE, mlp, randn, rel_err


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 64), nn.ReLU(), nn.Linear(64, 8))


def test_each_config_picks_its_layers_and_handler():
    m = quantize(net(), WeightOnlyConfig(bits=8, group_size=None))
    assert [type(m[i]) for i in (0, 2, 4)] == [nn.Conv2d, WeightOnlyLinear, WeightOnlyLinear]
    assert m[2].bits == 8 and m[2].group_size is None
    m = quantize(net(), W8A8Config())
    assert isinstance(m[2], Int8Linear) and m[2].mode == "dynamic"
    m = quantize(net(), QATConfig())
    assert [type(m[i]) for i in (0, 2, 4)] == [QATConv2d, QATLinear, QATLinear]


def test_w8a8_without_calib_swaps_every_linear_in_place():
    m = net()
    m.append(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    assert quantize(m, W8A8Config()) is m
    assert not any(type(mod) is nn.Linear for mod in m.modules())
    assert sum(isinstance(mod, Int8Linear) and mod.mode == "dynamic" for mod in m.modules()) == 4


# Relative L2 bounds vs FP32 on inputs the calibration never saw. Weight-only: ~5e-3 (int8) and ~0.1 (int4) per layer.
# W8A8 with dynamic (per-row) activations ~1.2e-2. W8A8 static (the default with calib): one minmax range per tensor
# from 128 calibration rows, which rows outside the calibration set exceed now and then (Gaussian tails); measured
# 0.02-0.10 over seeds, against ~1.4e-2 on the calibration data itself.
FRESH = {"int8 static": (lambda calib: W8A8Config(calib=calib, budget=0.05), 0.15),
         "int8 dynamic": (lambda calib: W8A8Config(calib=calib, budget=0.05, activations="dynamic"), 3e-2),
         "int8-weight": (lambda calib: WeightOnlyConfig(8, calib=calib, budget=0.05), 1.5e-2),
         "int4-weight": (lambda calib: WeightOnlyConfig(4, calib=calib), 0.25)}


@pytest.mark.parametrize("case", sorted(FRESH))
def test_with_calib_the_result_is_a_new_model_near_the_fp32_one(case):
    config, tol = FRESH[case]
    fp32 = mlp(64, 96, 32, seed=3)
    before = copy.deepcopy(fp32.state_dict())
    calib = [randn(64, 64, seed=s).to(DEVICE) for s in (10, 11)]
    model = quantize(fp32, config(calib))
    assert isinstance(model, QuantizedModel) and isinstance(model.quant_report, QuantReport)
    assert type(fp32[0]) is nn.Linear and fp32.state_dict().keys() == before.keys()
    assert all(torch.equal(v, fp32.state_dict()[k]) for k, v in before.items())
    x = randn(32, 64, seed=20).to(DEVICE)  # the calibration data's distribution, other samples
    with torch.no_grad():
        y, ref = model(x), fp32(x)
    assert y.dtype == torch.float32 and 0 < rel_err(y, ref) < tol


def test_filter_static_qparams_and_shared_modules():
    m = net()
    m.append(m[4])  # one module under two names: replaced once, under both
    quantize(m, W8A8Config(static={"2": (0.05, 0)}), filter_fn=lambda mod, name: name in ("2", "4"))
    assert m[2].mode == "static" and m[4].mode == "dynamic" and m[5] is m[4]
    assert isinstance(quantize(nn.Linear(32, 4), WeightOnlyConfig(group_size=32)), WeightOnlyLinear)  # root


def test_ptq_settings_are_checked_by_the_config():
    """Each error is one line naming the config and the field."""
    with pytest.raises(ValueError, match="W8A8Config: budget needs calib"):
        W8A8Config(budget=0.02)
    with pytest.raises(ValueError, match="WeightOnlyConfig: budget needs calib"):
        WeightOnlyConfig(bits=8, budget=0.02)
    with pytest.raises(ValueError, match="W8A8Config: activations must be 'auto', 'dynamic' or 'static', got 'row'"):
        W8A8Config(calib=[torch.ones(2, 4)], activations="row")
    with pytest.raises(ValueError, match="W8A8Config: activations 'static' needs calib"):
        W8A8Config(activations="static")
    with pytest.raises(ValueError, match="W8A8Config: smooth_alpha must be"):
        W8A8Config(smooth_alpha=1.5)
    with pytest.raises(ValueError, match="W8A8Config: static and smooth are given per layer"):
        W8A8Config(static={"0": (0.1, 0)}, calib=[torch.ones(2, 4)])
    with pytest.raises(ValueError, match="WeightOnlyConfig: sensitivity must be"):
        WeightOnlyConfig(sensitivity="random")
    with pytest.raises(ValueError, match="WeightOnlyConfig: group_size must be one of"):
        quantize(nn.Linear(64, 8), WeightOnlyConfig(group_size=256, calib=[torch.ones(2, 64)]))
    with pytest.raises(ValueError, match="WeightOnlyConfig's awq, lm_head, embeddings and edge_bits apply to the "
                                         "causal LMs"):
        quantize(net(), WeightOnlyConfig(awq=True, calib=[torch.ones(1, 1, 8, 8)]))
    with pytest.raises(ValueError, match="exclude patterns; it takes no filter_fn"):
        quantize(net(), W8A8Config(calib=[torch.ones(1, 1, 8, 8)]), filter_fn=lambda m, n: True)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        WeightOnlyConfig(bits=3)
    with pytest.raises(ValueError, match="power of two >= 32"):
        WeightOnlyConfig(group_size=48)
    with pytest.raises(ValueError, match="group_size 128 does not divide K=144 of layer 2"):
        quantize(net(), WeightOnlyConfig())
    with pytest.raises(ValueError, match="no module of ReLU matched"):
        quantize(nn.ReLU(), WeightOnlyConfig())
    with pytest.raises(TypeError, match="no handler for dict"):
        quantize(net(), {})


def test_a_new_scheme_is_a_config_and_a_handler():
    @dataclass(frozen=True)
    class Halve:
        pass

    @register_handler(Halve)
    def _(module, config, name):
        return nn.Identity()

    m = quantize(net(), Halve())
    assert isinstance(m[2], nn.Identity) and isinstance(m[0], nn.Conv2d)
