import pytest
import torch
import triton

import automp.kernels as K
from automp.kernels import quant
from kernel_testutil import DEVICE, TOL, rel_err


@pytest.mark.parametrize("group", [32, 64, None])
def test_int8_weight_quantization_error_is_within_half_a_step(group):
    w = torch.randn(9, 70, device=DEVICE)
    qw, s = K.quantize_weight_int8(w, group)
    assert qw.dtype == torch.int8 and qw.shape == (9, 70)
    assert s.shape == (9, 1 if group is None else -(-70 // group))
    step = s.repeat_interleave(group or 70, dim=1)[:, :70]
    assert ((K.dequantize_weight(qw, s, 70) - w).abs() <= step / 2 + 1e-6).all()


def test_int4_packing_layout():
    """k = 2j in the low nibble and 2j + 1 in the high nibble, each as q + 8; odd K pads the last high nibble."""
    w = torch.tensor([[7.0, -7.0, 1.0, 0.0, -1.0]], device=DEVICE)  # absmax 7 -> scale 1, codes = w
    qw, s = K.quantize_weight_int4(w, None)
    assert torch.allclose(s, torch.tensor([[1.0]], device=DEVICE))
    assert qw.dtype == torch.uint8 and qw.tolist() == [[15 | (1 << 4), 9 | (8 << 4), 7 | (8 << 4)]]
    assert torch.equal(K.dequantize_weight(qw, s, 5), w)


def test_quantizer_rejects_bad_group():
    with pytest.raises(ValueError, match="group_size"):
        K.quantize_weight_int4(torch.randn(4, 64, device=DEVICE), 48)


@pytest.mark.parametrize("quantize", [K.quantize_weight_int8, K.quantize_weight_int4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,k,group", [(41, 96, 32), (19, 95, 64), (7, 40, None)])
def test_quant_gemv_and_gemm_match_dequantized_reference(poison, quantize, dtype, n, k, group):
    qw, s = quantize(torch.randn(n, k, device=DEVICE), group)
    deq = K.dequantize_weight(qw, s, k).double()
    x = torch.randn(k, dtype=dtype, device=DEVICE)
    y = K.quant_gemv(qw, s, x)
    assert y.dtype == dtype and y.shape == (n,)
    assert rel_err(y, deq @ x.double()) < TOL[dtype]
    a = torch.randn(5, k, dtype=dtype, device=DEVICE)
    c = K.quant_gemm(a, qw, s)
    assert c.dtype == dtype and c.shape == (5, n)
    assert rel_err(c, a.double() @ deq.T) < TOL[dtype]


def test_quant_gemm_strided_activations_are_handled():
    qw, s = K.quantize_weight_int8(torch.randn(20, 64, device=DEVICE), 32)
    a = torch.randn(64, 6, dtype=torch.float16, device=DEVICE).t()
    assert rel_err(K.quant_gemm(a, qw, s), a.double() @ K.dequantize_weight(qw, s, 64).double().T) < 2e-3


def test_quant_rejects_bad_inputs():
    qw, s = K.quantize_weight_int8(torch.randn(16, 64, device=DEVICE), 32)
    x = torch.randn(64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError, match="qw must be int8"):
        K.quant_gemv(qw.to(torch.int16), s, x)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        K.quant_gemv(qw, s, x.float())
    with pytest.raises(ValueError, match="contiguous"):
        K.quant_gemm(x[None], qw.t().contiguous().t(), s)
    with pytest.raises(ValueError, match="scales must be"):
        K.quant_gemv(qw, s[:8], x)
    with pytest.raises(ValueError, match="does not match K"):
        K.quant_gemv(qw, s, torch.randn(63, dtype=torch.float16, device=DEVICE))


def test_asymmetric_activation_quantization_round_trip():
    x = torch.relu(torch.randn(6, 50, device=DEVICE))
    q, s, z = K.quantize_rowwise_int8(x, asymmetric=True)
    assert q.dtype == torch.int8 and z.dtype == torch.int32
    assert ((s[:, None] * (q.float() - z[:, None].float()) - x).abs() <= s[:, None] * 0.5 + 1e-6).all()
    b = torch.randn(50, 9, device=DEVICE)
    bq, sb = K.quantize_rowwise_int8(b.t())
    out = K.int8_gemm(q, bq.t(), s, sb, out_dtype=torch.float32, a_zero=z)
    assert rel_err(out, x.double() @ b.double()) < 2e-2  # int8 quantization error of both operands


def _gpu_configs():
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in quant._Q_SQUARE + quant._Q_SKINNY]


@pytest.mark.parametrize("m", [1, 16, 45, 300])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("k,span", [(4096, 4096), (14336, 2944), (8192, 1024), (4096, 384)])
def test_quant_gemm_tuning_never_offers_a_tile_straddling_groups_or_splits(m, group, k, span):
    """Every config the GPU autotuner may pick keeps a K-tile inside one scale group (one scale per tile) and, when K
    is split, inside one program's K range (a tile reaching past it would add the next range twice)."""
    kept = quant._qgemm_prune(_gpu_configs(), {"M": m, "GROUP": group, "K": k, "K_SPAN": span})
    assert kept and all(c.kwargs["BLOCK_K"] <= group and span % c.kwargs["BLOCK_K"] == 0 for c in kept)


# ----------------------------------------------------------------------------------------------- GEMM split-K
F16, BF16 = torch.float16, torch.bfloat16
# (M, N, K, group, scale dtype): M from one row to past a 16- and a 32-row tile, odd N, odd K that is no multiple of
# the group (int4's last high nibble unused, a partial last group), per-channel scales (None); K up to ~500 so that
# forced splits really split (a program's K range is a whole number of 128 and of the group) under the interpreter.
GEMM_SPLIT_SHAPES = [(1, 41, 519, 32, torch.float32), (5, 19, 455, 64, torch.float16),
                     (17, 23, 519, None, torch.float32), (33, 9, 391, 32, torch.bfloat16)]


@pytest.mark.parametrize("split_k", [None, 1, 2, 3, 5])
@pytest.mark.parametrize("quantize", [K.quantize_weight_int8, K.quantize_weight_int4])
@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("m,n,k,group,scale_dtype", GEMM_SPLIT_SHAPES)
def test_quant_gemm_split_k_matches_float64_reference(poison, monkeypatch, split_k, quantize, dtype, m, n, k, group,
                                                      scale_dtype):
    """Every K split (forced, and the heuristic's through the public op) sums to the dequantized product. `poison`
    NaN-fills torch.empty, so a partial slab or output element no program wrote comes out NaN. The heuristic's K
    threshold is lifted: these K are kept small for the interpreter."""
    monkeypatch.setattr(quant, "_SPLIT_MIN_K", 0)
    qw, s = quantize(torch.randn(n, k, device=DEVICE), group)
    s = s.to(scale_dtype)
    a = torch.randn(m, k, dtype=dtype, device=DEVICE)
    splits, _ = quant._gemm_split(m, n, k, quant.kernel_group(k, s.shape[1]), 132, split_k)
    assert splits > 1 or split_k == 1  # the split path is what this test is about
    c = K.quant_gemm(a, qw, s) if split_k is None else quant.quant_gemm(a, qw, s, split_k=split_k)
    assert c.dtype == dtype and c.shape == (m, n) and not c.isnan().any()
    assert rel_err(c, a.double() @ K.dequantize_weight(qw, s, k).double().T) < TOL[dtype]


@pytest.mark.parametrize("quantize", [K.quantize_weight_int8, K.quantize_weight_int4])
def test_quant_gemm_split_k_with_strided_activations(poison, quantize):
    qw, s = quantize(torch.randn(24, 512, device=DEVICE), 128)
    a = torch.randn(512, 6, dtype=F16, device=DEVICE).t()  # [6, 512], column-major
    c = quant.quant_gemm(a, qw, s, split_k=4)
    assert rel_err(c, a.double() @ K.dequantize_weight(qw, s, 512).double().T) < TOL[F16]


def test_quant_gemm_long_k_splits_by_default():
    """A decode batch against a long-K weight splits without being asked (its tile grid leaves most SMs idle)."""
    assert quant._gemm_split(32, 4096, 14336, 128, 132)[0] > 1
    assert quant._gemm_split(16, 2048, 8192, 128, 132)[0] > 1


@pytest.mark.parametrize("m,n,k,group", [(32, 4096, 14336, 128), (16, 4096, 4096, 128), (64, 2048, 8192, 128),
                                         (1, 4096, 14336, 32), (33, 14336, 4096, 128), (32, 4096, 14336, 32768),
                                         (32, 4096, 2048, 1024), (8, 64, 8192, 4096), (17, 1000, 5000, 64),
                                         (32, 128256, 4096, 128), (128, 4096, 14336, 128), (512, 4096, 4096, 128),
                                         (32, 4096, 2048, 128), (5, 7, 100, 128)])
@pytest.mark.parametrize("sms", [132, 78])
def test_gemm_split_chooser(m, n, k, group, sms):
    """Whole groups (and of every offered BLOCK_K) per program, no empty program, enough programs for every SM unless
    K has no more units to give and not much more than _WAVES per SM; no split for large M, short K, or a tile grid
    that fills the GPU alone."""
    split, span = quant._gemm_split(m, n, k, group, sms)
    assert split == -(-k // span) and (split == 1) == (span == k)
    tiles = -(-n // 64)  # one row of tiles for M <= 64
    if m > 64 or k < quant._SPLIT_MIN_K or tiles >= sms:
        assert split == 1
        return
    unit = 128 if group >= k else max(group, 128)
    assert split > 1 and span % unit == 0 and (split - 1) * span < k
    assert tiles * split >= sms or split == -(-k // unit)
    assert split <= -(-quant._WAVES * sms // tiles)
    kept = quant._qgemm_prune(_gpu_configs(), {"M": m, "GROUP": min(group, 1 << (k - 1).bit_length()), "K": k,
                                               "K_SPAN": span})
    assert kept and all(span % c.kwargs["BLOCK_K"] == 0 for c in kept)


@pytest.mark.parametrize("split_k", [1, 2, 3, 5, 8, 64])
@pytest.mark.parametrize("k,group", [(519, 32), (455, 64), (2048, 1024), (5632, 128), (100, 128), (519, 1024)])
@pytest.mark.parametrize("m", [1, 33, 300])
def test_gemm_forced_split_is_whole_groups(split_k, k, group, m):
    split, span = quant._gemm_split(m, 16, k, group, 132, split_k)
    assert 1 <= split <= split_k and split == -(-k // span)
    if split > 1:
        assert span % (group if group < k else 128) == 0 and span % 128 == 0 and (split - 1) * span < k
