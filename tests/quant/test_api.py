"""automp.quant.quantize: one verb, a config dataclass per scheme, handlers found by config type."""
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from automp.quant import (Int8Linear, QATConfig, W8A8Config, WeightOnlyConfig, WeightOnlyLinear, quantize,
                          register_handler)
from automp.quant.qat import QATConv2d, QATLinear


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


def test_filter_static_qparams_and_shared_modules():
    m = net()
    m.append(m[4])  # one module under two names: replaced once, under both
    quantize(m, W8A8Config(static={"2": (0.05, 0)}), filter_fn=lambda mod, name: name in ("2", "4"))
    assert m[2].mode == "static" and m[4].mode == "dynamic" and m[5] is m[4]
    assert isinstance(quantize(nn.Linear(32, 4), WeightOnlyConfig(group_size=32)), WeightOnlyLinear)  # root


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
