"""quant_planes: the decode-batch weight-only product on the tensor cores, against a float64 reference of the
dequantized weight.

Reference: dequantize_weight(qw, scales).double() times a.double(), so the only error left is fp32 accumulation and
the output's rounding to fp16 / bf16 (kernel_testutil.TOL). Outputs are allocated NaN-filled (the `poison` fixture),
so an element the kernel never writes fails the comparison. On the CPU the interpreter runs the planes in plain
Triton; on a GPU fp16 runs the f16x2 assembly, and the plain path is forced once more (asm=False) beside it.
"""
import pytest
import torch

import automp.kernels as K
from automp.kernels import planes, quant
from automp.kernels.planes import MAX_ROWS, _configs, fits, misaligned, quant_planes, unsupported
from kernel_testutil import DEVICE, TOL, rel_err, sm90_loop, sm90_resident

F16, BF16 = torch.float16, torch.bfloat16
# (N, K, group, M, dtype, split_k): odd N, K a whole number of words but not of tiles (the masked tail), groups of
# 128 and per-channel (and 64: int8 only), M from 2 to 64 (padded to 16, 32, 64; fp16, the GPU's assembly, at each),
# forced splits beside unsplit runs
CASES = [(67, 264, None, 2, F16, None), (129, 256, 128, 3, BF16, None), (40, 1024, 128, 8, F16, 3),
         (33, 520, None, 17, BF16, None), (16, 4096, 128, 32, F16, None), (65, 384, 128, 64, BF16, 2),
         (24, 640, None, 9, F16, 4), (48, 512, 128, 40, F16, None)]


def _operands(bits, n, k, group, m, dtype):
    quantize = K.quantize_weight_int8 if bits == 8 else K.quantize_weight_int4
    qw, s = quantize(torch.randn(n, k, device=DEVICE), group)
    return qw, s, torch.randn(m, k, dtype=dtype, device=DEVICE)


def _reference(qw, s, a):
    return a.double() @ K.dequantize_weight(qw, s, a.shape[1]).double().T


def _asm_choices(dtype):
    return [None, False] if DEVICE == "cuda" and dtype == F16 else [None]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k,group,m,dtype,split_k", CASES)
def test_planes_match_float64_reference(poison, bits, n, k, group, m, dtype, split_k):
    qw, s, a = _operands(bits, n, k, group, m, dtype)
    if split_k is not None:  # the case really splits K (else it would test the unsplit path twice)
        assert quant._gemm_split(m, n, k, quant.kernel_group(k, s.shape[1]), 132, split_k)[0] > 1
    for asm in _asm_choices(dtype):
        y = quant_planes(qw, s, a, split_k=split_k, asm=asm)
        assert y.dtype == dtype and y.shape == (m, n)
        assert rel_err(y, _reference(qw, s, a)) < TOL[dtype], asm


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k,group,m,split_k", [(67, 264, None, 2, None), (40, 1024, 128, 8, 3),
                                                 (65, 384, 128, 5, 2), (24, 640, None, 9, 4)])
def test_scales_loaded_a_tile_ahead_give_the_same_product(poison, bits, n, k, group, m, split_k):
    """PREFETCH_S (the autotuner chooses it on the GPU): every tile still takes its own group's scales, in a split's
    last tile and where a range holds a single tile, as the tile-by-tile load does."""
    qw, s, a = _operands(bits, n, k, group, m, F16)
    ref = _reference(qw, s, a)
    ahead, behind = (quant_planes(qw, s, a, split_k=split_k, prefetch=p) for p in (True, False))
    assert rel_err(ahead, ref) < TOL[F16] and rel_err(behind, ref) < TOL[F16]
    if DEVICE == "cpu":  # the same kernel and summation order but for where the scales are loaded: bitwise equal
        assert torch.equal(ahead, behind)


def test_int8_takes_groups_of_64(poison):
    qw, s, a = _operands(8, 40, 320, 64, 5, F16)
    assert rel_err(quant_planes(qw, s, a), _reference(qw, s, a)) < TOL[F16]


def test_op_takes_strided_activations(poison):
    qw, s, _ = _operands(4, 24, 256, 128, 1, F16)
    a = torch.randn(256, 6, dtype=F16, device=DEVICE).t()  # [6, 256], column-major
    y = K.quant_planes(qw, s, a)
    assert y.shape == (6, 24) and rel_err(y, _reference(qw, s, a)) < TOL[F16]


@pytest.mark.parametrize("bits,k,group,m,dtype,why", [
    (4, 260, None, 4, F16, "not a whole number of 8-code words"),
    (8, 258, None, 4, F16, "not a whole number of 4-code words"),
    (4, 256, 64, 4, F16, "scale groups are shorter than 128"),
    (8, 256, 32, 4, F16, "scale groups are shorter than 64"),
    (4, 256, 128, MAX_ROWS + 1, F16, "outside 1..64"),
    (4, 256, 128, 4, torch.float32, "not float16 or bfloat16")])
def test_shapes_it_cannot_take_are_refused_in_one_line(bits, k, group, m, dtype, why):
    qw, s, a = _operands(bits, 8, k, group, m, F16)
    a = a.to(dtype)
    assert why in unsupported(qw, s, a)
    with pytest.raises(ValueError, match=why):
        quant_planes(qw, s, a)
    if dtype != torch.float32:  # the op names the problem too (float32 is refused earlier, by the op's dtype check)
        with pytest.raises(ValueError, match="automp.kernels.quant_planes"):
            K.quant_planes(qw, s, a)


def test_misaligned_weights_are_refused():
    qw, s, a = _operands(4, 8, 264, None, 4, F16)
    flat = torch.empty(qw.numel() + 2, dtype=torch.uint8, device=DEVICE)
    shifted = flat[2:].view(qw.shape)
    shifted.copy_(qw)
    assert misaligned(shifted) and unsupported(shifted, s, a) is None
    with pytest.raises(ValueError, match="4-byte boundary"):
        quant_planes(shifted, s, a)


def test_asm_is_refused_where_it_cannot_run():
    qw, s, a = _operands(4, 8, 256, 128, 4, BF16)
    with pytest.raises(ValueError, match="f16x2"):
        quant_planes(qw, s, a, asm=True)


def test_opcheck():
    qw, s, a = _operands(4, 20, 256, 128, 3, BF16)
    torch.library.opcheck(torch.ops.automp.quant_planes, (qw, s, a),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k,group,span", [(4096, 128, 4096), (4096, 128, 512), (14336, 128, 1792),
                                          (4096, 4096, 4096), (8192, 8192, 1024), (4096, 64, 4096)])
def test_gpu_configs_are_pruned_to_valid_tiles(bits, k, group, span):
    """The compiled path tunes several configs, which the interpreter never prunes to more than one: a tile deeper
    than a group would apply one scale across two groups, one not dividing a split's K range would overlap the next
    program's, and planes shallower than 16 words cannot feed tl.dot."""
    args = {"N": 4096, "K": k, "K_SPAN": span, "GROUP": group, "BITS": bits, "M_P2": 16}
    kept = [c for c in _configs(interpret=False) if fits(c, args)]
    if bits == 4 and group < 128:
        assert kept == []  # unsupported() keeps such shapes away from the kernel
        return
    assert kept
    for c in kept:
        assert c.kwargs["BLOCK_K"] <= group and c.kwargs["BLOCK_K"] * bits // 32 >= 16
        assert span == k or span % c.kwargs["BLOCK_K"] == 0
    assert all(fits(c, args) for c in _configs(interpret=True) if c.kwargs["BLOCK_K"] * bits == 512)


def test_int4_codes_are_decoded_into_the_mma_fragments_registers_in_the_sm90_code():
    """int4 decodes two neighbouring words at once, so each decoded register holds a K-pair of one plane, which is
    how the MMA fragment takes it; decoding two planes of one word left every pair to be repacked by a PRMT (97
    PRMTs per warp and K-tile at 32 HMMAs, against 48: 16 pairing the words' halves, 32 for the activations)."""
    loop = sm90_loop("automp.kernels.planes", "_wq_planes_kernel",
                     {"q_ptr": "*u8", "s_ptr": "*fp16", "a_ptr": "*fp16", "out_ptr": "*fp16"},
                     dict(GROUP=128, BITS=4, SPLIT=False, M_P2=16, A_FP16=True, ASM=True, BLOCK_N=64, BLOCK_K=128,
                          PREFETCH_S=False, EVEN_K=True, stride_ak=1), 2)
    mma = sum(line.startswith("HMMA") for line in loop)
    assert mma == 32  # 64 x 128 codes against 16 rows, m16n8k16: 4 x 2 x 8 / 2 warps
    assert sum(line.startswith("PRMT") for line in loop) <= 2 * mma


def test_resident_programs_are_the_least_of_the_sm90_compiles():
    """_planes_split keeps a split inside one wave of resident programs: _RESIDENT must be what the offered 64-wide
    configs really fit on an SM (at both bit widths, split), else a split it allows runs a second, mostly idle wave."""
    builds, keys = [], []
    for m_p2 in planes._RESIDENT:
        for bits in (4, 8):
            for c in _configs(interpret=False):
                if c.kwargs["BLOCK_N"] == 64 and c.kwargs["BLOCK_K"] * bits // 32 >= 16:
                    keys.append(m_p2)
                    builds.append([dict(GROUP=128, BITS=bits, SPLIT=True, M_P2=m_p2, A_FP16=True, ASM=True,
                                        EVEN_K=True, stride_ak=1, **c.kwargs), c.num_warps, c.num_stages])
    resident = sm90_resident("automp.kernels.planes", "_wq_planes_kernel",
                             {"q_ptr": "*u8", "s_ptr": "*fp16", "a_ptr": "*fp16", "out_ptr": "*fp32"}, builds)
    assert {m: min(r for key, r in zip(keys, resident) if key == m) for m in planes._RESIDENT} == planes._RESIDENT


@pytest.mark.parametrize("m", [1, 8, 16, 17, 32, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (1024, 4096), (28672, 4096),
                                 (2048, 8192), (4096, 11008)])
def test_planes_split_fits_one_wave_in_even_ranges(m, n, k):
    """The split's programs fit in the SMs' slots, its ranges are whole units covering K, and a range shorter than
    the rest is left only where no split one fewer divides K's units; a forced split is kept."""
    sms, unit = 132, 128
    split, span = planes._planes_split(m, n, k, 128, sms)
    tiles = -(-n // 64)
    assert split * tiles <= planes._RESIDENT[max(16, 1 << (m - 1).bit_length())] * sms or split == 1
    assert span % unit == 0 and (split - 1) * span < k <= split * span
    units = k // unit
    if k % span:
        assert units % (split - 1 if split > 1 else 1) or split == 1
    assert split <= quant._gemm_split(m, n, k, 128, sms, None, planes._WAVES)[0]
    assert planes._planes_split(m, n, k, 128, sms, 3) == quant._gemm_split(m, n, k, 128, sms, 3)
