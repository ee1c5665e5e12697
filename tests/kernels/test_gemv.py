import importlib

import pytest
import torch

import automp.kernels as K
from kernel_testutil import DEVICE, TOL, rel_err

gemv_mod = importlib.import_module("automp.kernels.gemv")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,b", [(37, 70, None), (80, 96, 1), (1, 17, 8), (5, 33, 3), (64, 64, None)])
def test_gemv_matches_float64(poison, dtype, n, k, b):
    w = torch.randn(n, k, dtype=dtype, device=DEVICE)
    x = torch.randn(k, *([] if b is None else [b]), dtype=dtype, device=DEVICE)
    y = K.gemv(w, x)
    assert y.dtype == dtype and y.shape == ((n,) if b is None else (n, b))
    assert torch.isfinite(y).all()
    assert rel_err(y, w.double() @ x.double()) < TOL[dtype]


@pytest.mark.parametrize("b", [None, 4])
def test_gemv_split_k_atomic_path(b):
    w = torch.randn(23, 90, dtype=torch.float16, device=DEVICE)
    x = torch.randn(90, *([] if b is None else [b]), dtype=torch.float16, device=DEVICE)
    y = gemv_mod.gemv(w, x, split_k=3)
    assert y.dtype == torch.float16
    assert rel_err(y, w.double() @ x.double()) < TOL[torch.float16]


def test_gemv_strided_inputs_are_handled():
    w = torch.randn(50, 40, dtype=torch.float16, device=DEVICE).t()  # [40, 50] with column stride != 1
    x = torch.randn(100, dtype=torch.float16, device=DEVICE)[::2]
    assert rel_err(K.gemv(w, x), w.double() @ x.double()) < TOL[torch.float16]


def test_gemv_rejects_bad_inputs():
    w = torch.randn(8, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError, match="gemv.*float16 or bfloat16"):
        K.gemv(w.float(), torch.randn(16, device=DEVICE))
    with pytest.raises(TypeError, match="x dtype"):
        K.gemv(w, torch.randn(16, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="K=16"):
        K.gemv(w, torch.randn(15, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="batch B"):
        K.gemv(w, torch.randn(16, 9, dtype=torch.float16, device=DEVICE))
