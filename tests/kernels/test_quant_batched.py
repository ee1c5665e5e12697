"""quant_gemv_rows: the few-row weight-only product against a float64 reference of the dequantized weight.

Reference: dequantize_weight(qw, scales).double() times a.double(), so the only error left is fp32 accumulation and
the output's rounding to fp16 / bf16 (kernel_testutil.TOL). Outputs are allocated NaN-filled (the `poison` fixture),
so an element the kernel never writes fails the comparison.
"""
import pytest
import torch

import automp.kernels as K
from automp.kernels import gemv_quant, quant
from automp.kernels.quant_batched import _PRODUCT_PER_THREAD, _rows_configs, _rows_prune, quant_gemv_rows
from kernel_testutil import DEVICE, TOL, rel_err

F16, BF16 = torch.float16, torch.bfloat16
# (N, K, group, M, dtype, split_k): odd N and K (odd K leaves int4's last high nibble unused), every group kind, M
# from 1 to 16, forced splits (split_k) next to unsplit runs
CASES = [(67, 129, 32, 1, F16, None), (67, 129, 32, 2, BF16, 3), (129, 200, 128, 3, F16, None),
         (200, 67, None, 5, BF16, None), (67, 129, None, 8, F16, 3), (40, 256, 128, 13, BF16, 2),
         (33, 95, 32, 16, F16, None), (16, 200, 32, 16, BF16, 4)]


def _operands(bits, n, k, group, m, dtype):
    quantize = K.quantize_weight_int8 if bits == 8 else K.quantize_weight_int4
    qw, s = quantize(torch.randn(n, k, device=DEVICE), group)
    a = torch.randn(m, k, dtype=dtype, device=DEVICE)
    return qw, s, a


def _reference(qw, s, a):
    return a.double() @ K.dequantize_weight(qw, s, a.shape[1]).double().T


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k,group,m,dtype,split_k", CASES)
def test_rows_match_float64_reference(poison, bits, n, k, group, m, dtype, split_k):
    qw, s, a = _operands(bits, n, k, group, m, dtype)
    if split_k is not None:  # the case really splits K (else it would test the unsplit path twice)
        assert gemv_quant._gemv_split(n, k, quant.kernel_group(k, s.shape[1]), 132, split_k)[0] > 1
    y = quant_gemv_rows(qw, s, a, split_k=split_k)
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_err(y, _reference(qw, s, a)) < TOL[dtype]


def test_long_k_splits_by_default_and_matches(poison):
    """K >= 4096 with few rows splits across programs without being asked (the GEMV's heuristic)."""
    qw, s, a = _operands(4, 16, 4096, 128, 3, F16)
    assert gemv_quant._gemv_split(16, 4096, 128, 132)[0] > 1
    assert rel_err(quant_gemv_rows(qw, s, a), _reference(qw, s, a)) < TOL[F16]


def test_op_takes_strided_activations(poison):
    qw, s, _ = _operands(8, 24, 64, 32, 1, F16)
    a = torch.randn(64, 6, dtype=F16, device=DEVICE).t()  # [6, 64], column-major
    y = K.quant_gemv_rows(qw, s, a)
    assert y.shape == (6, 24) and rel_err(y, _reference(qw, s, a)) < TOL[F16]


def test_opcheck():
    qw, s, a = _operands(4, 20, 63, 32, 3, BF16)
    torch.library.opcheck(torch.ops.automp.quant_gemv_rows, (qw, s, a),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("m_p2", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("k,group,span", [(4096, 32, 4096), (4096, 32, 512), (4096, 128, 256), (5632, 128, 1408),
                                          (3000, 4096, 3000), (8192, 8192, 1024)])
def test_gpu_configs_are_pruned_to_valid_tiles(m_p2, k, group, span):
    """The compiled path tunes several configs, which the interpreter never prunes (it has one): a tile deeper than
    a group would apply one scale across two groups, and one not dividing a split's K range would overlap the next
    program's."""
    configs = _rows_configs(interpret=False)
    kept = _rows_prune(configs, {"N": 2048, "K": k, "K_SPAN": span, "GROUP": group, "BITS": 4, "M_P2": m_p2})
    assert kept
    for c in kept:
        assert c.kwargs["BLOCK_K"] <= group and (span == k or span % c.kwargs["BLOCK_K"] == 0)
    if len(kept) > 1:
        assert all(m_p2 * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= _PRODUCT_PER_THREAD * 32 * c.num_warps
                   for c in kept)
    if m_p2 <= 2 and group >= 128:  # few rows keep the deep tiles a weight stream wants
        assert max(c.kwargs["BLOCK_K"] for c in kept) >= 128


def test_rows_reject_bad_inputs():
    qw, s, a = _operands(8, 16, 64, 32, 2, F16)
    with pytest.raises(ValueError, match="M in 1..16"):
        K.quant_gemv_rows(qw, s, torch.randn(17, 64, dtype=F16, device=DEVICE))
    with pytest.raises(ValueError, match="M in 1..16"):
        K.quant_gemv_rows(qw, s, torch.randn(0, 64, dtype=F16, device=DEVICE))
    with pytest.raises(ValueError, match="M in 1..16"):
        K.quant_gemv_rows(qw, s, a[0])
    with pytest.raises(ValueError, match="does not match K"):
        K.quant_gemv_rows(qw, s, torch.randn(2, 63, dtype=F16, device=DEVICE))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        K.quant_gemv_rows(qw, s, a.float())
    with pytest.raises(TypeError, match="qw must be int8"):
        K.quant_gemv_rows(qw.to(torch.int16), s, a)
    with pytest.raises(ValueError, match="scales must be"):
        K.quant_gemv_rows(qw, s[:8], a)
    with pytest.raises(ValueError, match="one device"):
        K.quant_gemv_rows(qw, s.to("meta"), a)
    with pytest.raises(ValueError, match="1..16 rows"):  # the launcher itself, called without the op's checks
        quant_gemv_rows(qw, s, torch.randn(17, 64, dtype=F16, device=DEVICE))
