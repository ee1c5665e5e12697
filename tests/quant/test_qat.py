import copy
import math

import numpy as np
import pytest
import torch
from onnx import TensorProto
from torch import nn

from automp.deploy.qdq.export import export_qat_onnx
from automp.quant.observers import ObserverConfig, fake_quantize
from automp.quant.qat import FakeQuant, QATConfig, QATConv2d, QATLinear, convert_qat, prepare_qat
from tests.quant.helpers import ONE_POINT, SmallCNN, onnx_accuracy, ort_run, rel_err, torch_accuracy, train


def _fq(scale, zero, axis=None, dtype="uint8", narrow=False):
    cfg = ObserverConfig(dtype=dtype, symmetric=dtype == "int8", axis=axis)
    fq = FakeQuant(None if axis is None else len(scale), axis, cfg, learn=True, narrow=narrow)
    fq.set_qparams(np.asarray(scale, np.float32), np.asarray(zero, dtype))
    return fq


def test_fake_quant_matches_numpy_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, (3, 5, 7)).astype(np.float32)
    fq = _fq(0.03, 100)
    np.testing.assert_allclose(fq(torch.from_numpy(x)).detach().numpy(),
                               fake_quantize(x, np.float32(0.03), np.uint8(100)), atol=1e-6)
    scales = np.array([0.01, 0.02, 0.05], np.float32)
    w = _fq(scales, np.zeros(3, np.int8), axis=0, dtype="int8", narrow=True)
    np.testing.assert_allclose(w(torch.from_numpy(x)).detach().numpy(),
                               fake_quantize(x, scales, np.zeros(3, np.int8), axis=0, qrange=(-127, 127)),
                               atol=1e-6)


def test_straight_through_and_lsq_gradients():
    s, z = 0.1, 10  # uint8 range [0, 255] -> representable [-1.0, 24.5]
    fq = _fq(s, z)
    x = torch.tensor([-3.0, 0.234, 1.0, 7.77, 40.0], requires_grad=True)
    fq(x).sum().backward()
    # STE: gradient 1 inside the range, 0 where clamped
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    # LSQ: (round(v) - v) inside, (qmin - z) / (qmax - z) at the clamps, scaled by 1/sqrt(numel * qmax)
    xs = x.detach().numpy().astype(np.float64)
    v = xs / s + z
    expect = np.where(v < 0, 0 - z, np.where(v > 255, 255 - z, np.round(v) - v)).sum()
    expect /= math.sqrt(x.numel() * 255)
    assert fq.scale.grad.item() == pytest.approx(expect, rel=1e-4)


def test_prepare_qat_swaps_layers_and_keeps_parameters():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Sequential(nn.Linear(4 * 4 * 4, 3)))
    params = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepare_qat(model)
    assert isinstance(model[0], QATConv2d) and isinstance(model[3][0], QATLinear)
    assert all(dict(model.named_parameters())[n] is p for n, p in params.items())  # the optimizer still works
    x = torch.randn(8, 1, 6, 6)
    ref = model(x)  # first pass observes the inputs
    assert bool(model[0].input_fq.initialized) and bool(model[3][0].input_fq.initialized)
    w_before = model[0].weight.detach().clone()
    ((model(x) - ref.detach()) ** 2).sum().backward()
    assert model[0].weight_fq.scale.grad is not None and model[3][0].input_fq.scale.grad is not None
    opt.step()
    assert not torch.equal(model[0].weight, w_before)
    with pytest.raises(ValueError, match="already prepared"):
        prepare_qat(model)


def test_qat_errors():
    with pytest.raises(ValueError, match="no nn.Linear"):
        prepare_qat(nn.Sequential(nn.ReLU()))
    with pytest.raises(TypeError, match="container"):
        prepare_qat(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="axis"):
        QATConfig(activation=ObserverConfig(axis=0))
    fresh = prepare_qat(nn.Sequential(nn.Linear(4, 2)))
    with pytest.raises(RuntimeError, match="never saw an input"):
        convert_qat(fresh)
    fresh(torch.randn(3, 4))
    with pytest.raises(ValueError, match="convert_qat"):
        export_qat_onnx(fresh, (torch.randn(2, 4),))


def test_qat_finetune_and_onnx_export_keep_top1(trained_cnn, task):
    x, y, xt, yt = task
    fp32_acc = torch_accuracy(trained_cnn, xt, yt)
    model = prepare_qat(copy.deepcopy(trained_cnn), QATConfig(observe_batches=2))
    scales_init = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("scale")}
    assert len(scales_init) == 8  # 4 layers x (weight, input)
    train(model, x, y, steps=40, lr=1e-3, seed=1)
    model = convert_qat(model)
    moved = [n for n, p in model.named_parameters() if n.endswith("scale") and not torch.equal(p, scales_init[n])]
    assert len(moved) >= 6  # LSQ learned the scales
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.endswith("scale"))
    qat_acc = torch_accuracy(model, xt, yt)
    assert qat_acc >= fp32_acc - ONE_POINT, (fp32_acc, qat_acc)  # fine-tuning may also gain

    # a fresh QAT model restored from the state dict computes the same thing (scales, zero points, ranges),
    # even when prepared with another config (int8 inputs): the integer range travels in the state dict
    restored = prepare_qat(SmallCNN(), QATConfig(activation=ObserverConfig(dtype="int8", symmetric=True)))
    restored.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(convert_qat(restored)(torch.from_numpy(xt)), model(torch.from_numpy(xt)))

    proto = export_qat_onnx(model, (torch.from_numpy(x[:2]),), ["image"], ["logits"])
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("QuantizeLinear") == 4 and ops.count("DequantizeLinear") >= 8
    assert {i.name for i in proto.graph.initializer if i.data_type == TensorProto.INT8} >= {
        "conv1.weight_quantized", "conv2.weight_quantized", "fc1.weight_quantized", "fc2.weight_quantized"}
    with torch.no_grad():
        ref = model(torch.from_numpy(xt)).numpy()
    got = ort_run(proto, {"image": xt})[0]
    assert rel_err(got, ref) < 1e-2  # ORT int8 kernels vs torch fake quant: same grid, int32 bias rounding
    assert onnx_accuracy(proto, xt, yt) >= fp32_acc - ONE_POINT


def test_qat_keeps_the_model_dtype():
    model = prepare_qat(nn.Sequential(nn.Linear(8, 4)).to(torch.bfloat16))
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    model(x)  # observe
    y = model(x)
    assert y.dtype == torch.bfloat16
    with torch.no_grad():
        ref = x.float() @ model[0].weight.float().T + model[0].bias.float()
    assert rel_err(y.detach().float().numpy(), ref.numpy()) < 3e-2  # bf16 rounding + int8 grid
