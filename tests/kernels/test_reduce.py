import pytest
import torch

import automp.kernels as K
from kernel_testutil import DEVICE


def _grads():
    d = DEVICE
    return [torch.randn(3000, device=d), torch.randn(5, 7, dtype=torch.float16, device=d), torch.randn(1, device=d),
            torch.randn(100, dtype=torch.bfloat16, device=d), torch.randn(6, 40, device=d).t(),  # dense, transposed
            torch.randn(30, 8, device=d)[:, ::2], torch.empty(0, device=d)]  # strided view, empty


def test_unscale_scales_every_tensor_in_place_and_reports_finite():
    grads = _grads()
    expected = [g * torch.tensor(0.125, dtype=g.dtype) for g in grads]
    found = K.unscale_and_check_(grads, torch.tensor([0.125], device=DEVICE))
    assert found.dtype == torch.float32 and found.shape == (1,) and found.item() == 0.0
    for g, e in zip(grads, expected):
        assert torch.equal(g, e)


@pytest.mark.parametrize("which,value", [(0, float("inf")), (1, float("nan")), (3, float("-inf")), (5, float("nan")),
                                         (4, float("inf"))])
def test_unscale_flags_non_finite_anywhere(which, value):
    grads = _grads()
    flat = grads[which].view(-1) if grads[which].is_contiguous() else grads[which]
    if flat.dim() == 1:
        flat[flat.numel() - 1] = value
    else:
        flat[-1, -1] = value
    assert K.unscale_and_check_(grads, torch.tensor([0.5], device=DEVICE)).item() == 1.0


def test_unscale_found_inf_is_fresh_each_call():
    one = torch.tensor([1.0], device=DEVICE)
    assert K.unscale_and_check_([torch.tensor([1.0, float("inf")], device=DEVICE)], one).item() == 1.0
    assert K.unscale_and_check_([torch.randn(10, device=DEVICE)], one).item() == 0.0


def test_unscale_rejects_bad_inputs():
    with pytest.raises(TypeError, match="inv_scale"):
        K.unscale_and_check_([torch.randn(3, device=DEVICE)], torch.tensor([0.5], dtype=torch.float64, device=DEVICE))
    with pytest.raises(TypeError, match="tensors\\[1\\]"):
        K.unscale_and_check_([torch.randn(3, device=DEVICE), torch.ones(3, dtype=torch.int32, device=DEVICE)],
                             torch.tensor([0.5], device=DEVICE))


@pytest.mark.parametrize("src,dst", [(torch.float32, torch.float16), (torch.float16, torch.float32),
                                     (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_cast(poison, src, dst):
    x = (torch.randn(33, 17, device=DEVICE) * 100).to(src)
    y = K.cast(x, dst)
    assert y.dtype == dst and y.shape == x.shape
    ref = x.to(dst)
    if (src, dst) == (torch.float32, torch.bfloat16) and DEVICE == "cpu":
        # The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even, exactly like Tensor.to):
        # allow one bf16 ulp there.
        ulp = 2.0 ** (torch.floor(torch.log2(ref.float().abs())) - 7)
        assert ((y.float() - ref.float()).abs() <= ulp).all()
    else:
        assert torch.equal(y, ref)


def test_cast_strided_input_and_bad_dtype():
    x = torch.randn(20, 10, device=DEVICE).t()
    assert torch.equal(K.cast(x, torch.float16), x.half())
    with pytest.raises(TypeError, match="cast"):
        K.cast(x, torch.int8)
