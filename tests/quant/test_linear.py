"""The quantized Linear modules against float64 references.

Two references per module: the exact one (the module's own int8/int4 codes and scales, dequantized in float64),
which only the fp16 output rounding separates from the kernel (tolerance 2e-3), and the float64 nn.Linear, which
the quantization error separates from it. Tolerances of the latter, for Gaussian weights/activations, from the
uniform quantizer's error step/sqrt(12) with step = absmax / qmax (absmax of n Gaussians ~ sqrt(2 ln n) sigma):
  W8A8 per-channel weights (K=70) + per-row activations: ~5.5e-3 each, ~8e-3 together   -> 1.5e-2
  W8A16 groups of 32: absmax ~2.1 sigma, step 0.0165 sigma                              -> ~5e-3, bound 1e-2
  W4A16 groups of 64: absmax ~2.4 sigma, step 0.34 sigma                                -> ~0.1,  bound 0.15
"""
import pytest
import torch

from automp.quant.int8 import Int8Linear, Int8Slice, int8_static_qparams, nbytes, smooth_factors, weight_group
from automp.quant.observers import ObserverConfig, activation_qparams, make_observer
from automp.quant.weight_only import WeightOnlyLinear
from tests.quant.torch_helpers import DEVICE, randn, rel_err

EXACT = 2e-3


def _linear_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def _rowwise_ref(x: torch.Tensor) -> torch.Tensor:
    """x through symmetric per-row int8 and back, in float64."""
    x = x.double()
    s = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.round(x / s).clamp(-127, 127) * s


def _w8a8_ref(mod: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    w = mod.qweight.double() * mod.wscale.double()[:, None]
    xs = x.double() * mod.inv_smooth.double() if mod.inv_smooth is not None else x.double()
    return _rowwise_ref(xs) @ w.T + (mod.bias.double() if mod.bias is not None else 0)


def test_int8_linear_matches_references():
    w, b = randn(37, 70, seed=1).to(DEVICE), randn(37, seed=2).to(DEVICE)
    x = randn(3, 5, 70, seed=3).half().to(DEVICE)
    mod = Int8Linear(w, b)
    y = mod(x)
    assert y.shape == (3, 5, 37) and y.dtype == torch.float16
    assert rel_err(y, _w8a8_ref(mod, x)) < EXACT
    assert rel_err(y, _linear_ref(x, w, b)) < 1.5e-2
    y32 = mod(x.float())  # nn.Linear's contract: output in the input's dtype
    assert y32.dtype == torch.float32 and rel_err(y32, _w8a8_ref(mod, x)) < 1e-5


def test_int8_linear_static_asymmetric_range_from_observer():
    """One-signed activations (post-ReLU): the observer turns symmetric int8 into the asymmetric range, which the
    module maps onto int8 with a zero point undone inside int8_gemm."""
    w = randn(24, 40, seed=4).to(DEVICE)
    x = randn(9, 40, seed=5).relu().half().to(DEVICE)
    obs = make_observer(ObserverConfig())
    obs.update(x.float().cpu().numpy())
    scale, zero = activation_qparams(obs)
    assert obs.config.dtype == "uint8"
    s, z = int8_static_qparams(scale, zero, obs.config.dtype)
    assert z == -128
    mod = Int8Linear(w, None, (s, z))
    assert mod.mode == "static" and mod.act_zero is not None
    xq = (torch.round(x.double() / s) + z).clamp(-128, 127)
    exact = ((xq - z) * s) @ (mod.qweight.double() * mod.wscale.double()[:, None]).T
    y = mod(x)
    assert rel_err(y, exact) < EXACT
    assert rel_err(y, _linear_ref(x, w, None)) < 1.5e-2


def test_smoothing_is_exact_in_float_and_helps_an_outlier_channel():
    w = randn(32, 64, seed=6).to(DEVICE)
    x = randn(12, 64, seed=7).to(DEVICE)
    x[:, 5] *= 80.0  # one channel far larger than the rest: it alone sets every row's int8 step
    x = x.half()
    m = smooth_factors(x.float().abs().amax(0), w, 0.5)
    smoothed = Int8Linear(w, None, smooth=m)
    ref = _linear_ref(x, w, None)
    assert rel_err(smoothed(x), _w8a8_ref(smoothed, x)) < EXACT
    plain_err, smooth_err = rel_err(Int8Linear(w, None)(x), ref), rel_err(smoothed(x), ref)
    assert smooth_err < plain_err / 2, (plain_err, smooth_err)


def test_smooth_factors_reject_bad_shape():
    w = randn(8, 16, seed=8)
    with pytest.raises(ValueError, match="16 positive factors"):
        Int8Linear(w, None, smooth=torch.ones(15))
    assert torch.equal(smooth_factors(torch.zeros(16), w, 0.5), torch.ones(16))  # dead channels stay at 1


@pytest.mark.parametrize("bits,k,group,tol", [(8, 96, 32, 1e-2), (8, 100, None, 1e-2), (4, 64, 64, 0.15),
                                              (4, 96, 32, 0.15)])
def test_weight_only_linear_matches_references(bits, k, group, tol):
    w, b = randn(29, k, seed=9).to(DEVICE), randn(29, seed=10).to(DEVICE)
    x = randn(2, 7, k, seed=11).half().to(DEVICE)
    assert weight_group(k) == group
    mod = WeightOnlyLinear.from_weight(w, b, bits, group)
    from automp.kernels import dequantize_weight
    exact = x.double() @ dequantize_weight(mod.qw, mod.scales, k).double().T + b.double()
    y = mod(x)
    assert y.shape == (2, 7, 29) and y.dtype == torch.float16
    assert rel_err(y, exact) < EXACT
    err = rel_err(y, _linear_ref(x, w, b))
    assert 0 < err < tol
    one = mod(x[0, 0].float())  # one token, float32: the GEMV path, float32 back
    assert one.shape == (29,) and one.dtype == torch.float32
    assert rel_err(one, exact[0, 0]) < EXACT


def test_weight_only_bytes_shrink():
    w = randn(64, 128, seed=12)
    int4, int8 = (WeightOnlyLinear.from_weight(w, None, bits, 128) for bits in (4, 8))
    assert nbytes(int4) < nbytes(int8) < w.numel() * 2
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        WeightOnlyLinear.from_weight(w, None, 3, 128)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        WeightOnlyLinear.from_weight(w, None, 8, 128, dtype=torch.float32)


def test_weight_group_choice():
    assert [weight_group(k) for k in (768, 3072, 384, 192, 96, 100, 7)] == [128, 128, 128, 64, 32, None, None]


def test_int8_slice_is_its_columns_of_the_shared_layer():
    w, b = randn(30, 24, seed=11).to(DEVICE), randn(30, seed=12).to(DEVICE)
    shared = Int8Linear(w, b, (0.02, 0))
    part = Int8Slice(shared, 10, 25)
    x = randn(2, 3, 24, seed=13).to(DEVICE)
    assert part.out_features == 15 and part.in_features == 24 and part.mode == "static"
    assert torch.equal(part(x), shared(x)[..., 10:25])
    for start, stop in ((5, 5), (-1, 4), (20, 31)):
        with pytest.raises(ValueError, match="outside the shared layer"):
            Int8Slice(shared, start, stop)
