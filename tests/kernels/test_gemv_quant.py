import pytest
import torch

import automp.kernels as K
from automp.kernels import gemv_quant
from kernel_testutil import DEVICE, TOL, rel_err


# K up to 1000 so forced splits really split (a program's K range is at least 128 and a whole number of groups).
SPLIT_SHAPES = [(37, 519, 32, torch.float32), (21, 640, 64, torch.float16), (33, 519, None, torch.float32),
                (9, 1000, 256, torch.float32)]


@pytest.mark.parametrize("split_k", [None, 1, 2, 3, 5])
@pytest.mark.parametrize("quantize", [K.quantize_weight_int8, K.quantize_weight_int4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,group,scale_dtype", SPLIT_SHAPES)
def test_quant_gemv_split_k_matches_float64_reference(poison, monkeypatch, split_k, quantize, dtype, n, k, group,
                                                      scale_dtype):
    """Every K split (forced, and the heuristic's through the public op) sums to the dequantized product. `poison`
    NaN-fills torch.empty, so a partial row or output element that no program wrote comes out NaN. The heuristic's
    K threshold is lifted: these K are kept small for the interpreter."""
    monkeypatch.setattr(gemv_quant, "_SPLIT_MIN_K", 0)
    qw, s = quantize(torch.randn(n, k, device=DEVICE), group)
    s = s.to(scale_dtype)
    x = torch.randn(k, dtype=dtype, device=DEVICE)
    splits, _ = gemv_quant._gemv_split(n, k, gemv_quant.kernel_group(k, s.shape[1]), 132, split_k)
    assert splits > 1 or split_k == 1  # the split path is what this test is about
    y = K.quant_gemv(qw, s, x) if split_k is None else gemv_quant.quant_gemv(qw, s, x, split_k=split_k)
    assert y.dtype == dtype and y.shape == (n,) and not y.isnan().any()
    assert rel_err(y, K.dequantize_weight(qw, s, k).double() @ x.double()) < TOL[dtype]


@pytest.mark.parametrize("quantize", [K.quantize_weight_int8, K.quantize_weight_int4])
def test_quant_gemv_split_k_with_strided_activations(poison, quantize):
    qw, s = quantize(torch.randn(24, 512, device=DEVICE), 128)
    x = torch.randn(512, 3, dtype=torch.float16, device=DEVICE)[:, 1]
    y = gemv_quant.quant_gemv(qw, s, x, split_k=4)
    assert rel_err(y, K.dequantize_weight(qw, s, 512).double() @ x.double()) < TOL[torch.float16]


@pytest.mark.parametrize("n,k,group", [(2048, 2048, 128), (256, 2048, 128), (5632, 2048, 128), (2048, 5632, 128),
                                       (2048, 2048, 32), (1024, 4096, 8192), (4096, 14336, 8192), (2048, 2048, 1024),
                                       (32000, 2048, 128), (128256, 4096, 128), (7, 100, 128)])
@pytest.mark.parametrize("sms", [132, 78])
def test_gemv_split_chooser(n, k, group, sms):
    """Whole groups per program, a power-of-two range (every BLOCK_K up to it tiles it), no empty program, and
    enough programs for every SM unless K has no more groups to give; no split when N alone fills the GPU."""
    split, span = gemv_quant._gemv_split(n, k, group, sms)
    assert split == -(-k // span) and (split == 1) == (span == k)
    if k < gemv_quant._SPLIT_MIN_K:  # measured: below it, the second launch costs more than the split gains
        assert split == 1
        return
    rows = -(-n // 32)
    unit = gemv_quant._MIN_SPAN if group >= k else max(group, gemv_quant._MIN_SPAN)
    if split > 1:
        assert span % unit == 0 and span & (span - 1) == 0
        assert (split - 1) * span < k
    assert rows * split >= sms or split == -(-k // unit)
    if rows >= 2 * sms:
        assert split == 1


@pytest.mark.parametrize("split_k", [1, 2, 3, 5, 8, 64])
@pytest.mark.parametrize("k,group", [(519, 32), (640, 64), (2048, 1024), (5632, 128), (100, 128)])
def test_gemv_forced_split_is_whole_groups(split_k, k, group):
    split, span = gemv_quant._gemv_split(16, k, group, 132, split_k)
    assert 1 <= split <= split_k and split == -(-k // span)
    if split > 1:
        assert span % (group if group < k else gemv_quant._MIN_SPAN) == 0 and (split - 1) * span < k
