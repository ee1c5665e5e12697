"""The W8A8 int8 GEMM (automp.kernels.int8_gemm): exactness, every epilogue, the one-tile-per-program and the
persistent grids, the configs the GPU autotuner is offered, and the persistent sm_90 build."""
import re

import pytest
import torch
import triton

import automp.kernels as K
from automp.kernels.gemm import MID_M, prune_by_m
from automp.kernels.int8_gemm import i8_configs, int8_gemm, programs
from kernel_testutil import DEVICE, TOL, rel_err, sm90_resident, sm90_sass

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _int8_operands(m, n, k):
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=DEVICE)
    b = torch.randint(-128, 128, (k, n), dtype=torch.int8, device=DEVICE)
    return a, b


# ----------------------------------------------------------------------------------------------- through the ops
@pytest.mark.parametrize("m,n,k", [(17, 33, 70), (1, 80, 96), (40, 5, 19)])
def test_int8_gemm_is_exact_against_int32(poison, m, n, k):
    a, b = _int8_operands(m, n, k)
    ones = torch.ones(m, device=DEVICE), torch.ones(n, device=DEVICE)
    out = K.int8_gemm(a, b, *ones, out_dtype=torch.float32)  # |acc| < 2^24: exact in fp32
    assert torch.equal(out, (a.double() @ b.double()).float())  # exact: integer sums far below 2^53


def test_int8_gemm_epilogue_scales_bias_and_zero_point(poison):
    m, n, k = 21, 37, 64
    a, b = _int8_operands(m, n, k)
    b = b.t().contiguous().t()  # column-major b, as produced by quantizing weights per output channel
    sa, sb = torch.rand(m, 1, device=DEVICE) + 0.1, torch.rand(1, n, device=DEVICE) + 0.1
    bias = torch.randn(n, device=DEVICE)
    zero = torch.randint(-128, 128, (m,), dtype=torch.int32, device=DEVICE)
    out = K.int8_gemm(a, b, sa, sb, bias=bias, out_dtype=torch.float32, a_zero=zero)
    ref = ((a.double() - zero.double()[:, None]) @ b.double()) * sa.double() * sb.double() + bias.double()
    assert rel_err(out, ref) < 1e-6
    half = K.int8_gemm(a, b, sa.flatten(), sb.flatten(), out_dtype=torch.bfloat16,
                       a_zero=torch.tensor(-3, device=DEVICE))
    ref = ((a.double() + 3) @ b.double()) * sa.double() * sb.double()
    assert half.dtype == torch.bfloat16 and rel_err(half, ref) < TOL[torch.bfloat16]


def test_int8_gemm_one_activation_scale_is_read_by_every_row(poison):
    m, n, k = 19, 24, 40
    a, b = _int8_operands(m, n, k)
    sa, sb = torch.tensor([0.37], device=DEVICE), torch.rand(n, device=DEVICE) + 0.1
    ref = (a.double() @ b.double()) * 0.37 * sb.double()
    for one in (sa, sa[0]):  # [1] and a 0-d scalar
        assert rel_err(K.int8_gemm(a, b, one, sb, out_dtype=torch.float32), ref) < 1e-6


def test_int8_gemm_rejects_bad_inputs():
    a, b = _int8_operands(4, 6, 8)
    sa, sb = torch.ones(4, device=DEVICE), torch.ones(6, device=DEVICE)
    with pytest.raises(TypeError, match="int8"):
        K.int8_gemm(a.float(), b, sa, sb)
    with pytest.raises(ValueError, match="sa must be"):
        K.int8_gemm(a, b, sa[:3], sb)
    with pytest.raises(ValueError, match="sb must be"):
        K.int8_gemm(a, b, sa, sb[:, None])
    with pytest.raises(TypeError, match="out_dtype"):
        K.int8_gemm(a, b, sa, sb, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="a_zero"):
        K.int8_gemm(a, b, sa, sb, a_zero=torch.ones(4, device=DEVICE))


def _requant_reference(a, b, sa, sb, bias, gelu, mult, zero, a_zero=None):
    """(y, codes) in float64: y the GEMM's dequantized output (after GELU), codes its static int8 quantization."""
    a_int = a.double() - (a_zero.double()[:, None] if a_zero is not None else 0)
    y = (a_int @ b.double()) * sa.double().reshape(-1, 1) * sb.double() + bias.double()
    if gelu:
        y = torch.nn.functional.gelu(y)
    q = torch.round(y * mult.double()) + (zero.double() if zero is not None else 0)
    return y, q.clamp(-128 if zero is not None else -127, 127)


def _assert_codes_match(out, y, ref, mult):
    """fp32 against float64: a value within rounding of a half step may round the other way, never further, and
    only such near-ties may differ (on the GPU GELU is the tanh form, within ~1e-3 of exact: < 0.1 code here)."""
    assert out.dtype == torch.int8 and out.shape == ref.shape
    diff = (out.double() - ref).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
    v = y * mult.double()
    assert not ((diff > 0) & ((v - v.round()).abs() < 0.4)).any()


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("per_channel,zero", [(False, None), (True, None), (True, -128), (False, 5)])
def test_int8_gemm_requant_matches_float64_then_quantize(poison, gelu, per_channel, zero):
    m, n, k = 23, 45, 70  # odd sizes: partial tiles in every direction
    a, b = _int8_operands(m, n, k)
    sa, sb = torch.rand(m, device=DEVICE) * 1e-2 + 1e-3, torch.rand(n, device=DEVICE) * 1e-2 + 1e-3
    bias = torch.randn(n, device=DEVICE)
    mult = (torch.rand(n if per_channel else 1, device=DEVICE) + 0.5) * 40  # codes well spread over -127..127
    z = None if zero is None else torch.tensor([zero], dtype=torch.int32, device=DEVICE)
    out = K.int8_gemm_requant(a, b, sa, sb, bias, mult, z, gelu=gelu)
    y, ref = _requant_reference(a, b, sa, sb, bias, gelu, mult, z)
    _assert_codes_match(out, y, ref, mult)
    assert ref.max() == 127 and ref.std() > 10  # some codes clipped, the rest spread


@pytest.mark.parametrize("zero", [None, -3])
def test_int8_gemm_requant_rounds_ties_to_even_and_clamps_exactly(poison, zero):
    """Products that land exactly on half codes round half to even, as torch.round does, and codes beyond the int8
    range clamp, with and without a zero point: the epilogue's rounding is exact, not within a tolerance."""
    m, n, k = 255, 3, 32
    a = torch.zeros(m, k, dtype=torch.int8)
    a[:, 0] = torch.arange(-127, 128, dtype=torch.int8)  # each row one product: v * b[0, j]
    b = torch.zeros(k, n, dtype=torch.int8)
    b[0] = torch.tensor([1, 1, 3], dtype=torch.int8)
    mult = torch.tensor([0.5, 2.0, 0.5])  # v / 2: ties at every odd v; 2 v: clamped beyond 63; 3 v / 2: both
    a, b, mult = a.to(DEVICE), b.to(DEVICE), mult.to(DEVICE)
    ones = torch.ones(1, device=DEVICE)
    z = None if zero is None else torch.tensor([zero], dtype=torch.int32, device=DEVICE)
    out = K.int8_gemm_requant(a, b, ones, torch.ones(n, device=DEVICE), None, mult, z)
    v = torch.arange(-127, 128, dtype=torch.float64)[:, None] * torch.tensor([1.0, 1.0, 3.0]) * torch.tensor(
        [0.5, 2.0, 0.5], dtype=torch.float64)
    ref = (torch.round(v) + (zero or 0)).clamp(-128 if zero is not None else -127, 127)
    assert (v - v.floor() == 0.5).sum() > 100  # ties, both even and odd below them
    assert torch.equal(out.cpu().double(), ref)


def test_int8_gemm_requant_rejects_bad_scales():
    a, b = _int8_operands(4, 6, 8)
    sa, sb = torch.ones(4, device=DEVICE), torch.ones(6, device=DEVICE)
    with pytest.raises(TypeError, match="out_mult"):
        K.int8_gemm_requant(a, b, sa, sb, None, torch.ones(5, device=DEVICE))
    with pytest.raises(TypeError, match="out_mult"):
        K.int8_gemm_requant(a, b, sa, sb, None, torch.ones(6, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="out_zero"):
        K.int8_gemm_requant(a, b, sa, sb, None, torch.ones(1, device=DEVICE), torch.ones(1, device=DEVICE))


# ----------------------------------------------------------------------------------------------- persistent grid
# Every epilogue the kernel compiles: output dtype, bias, per-row activation zero point, GELU, requantization
# (per-channel multiplier; per-tensor with a zero point). The requantizing ones read one static activation scale.
EPILOGUES = {
    "fp16": dict(out_dtype=F16),
    "fp32+bias": dict(out_dtype=F32, bias=True),
    "bf16+bias+zero_point": dict(out_dtype=BF16, bias=True, a_zero=True),
    "fp32+bias+gelu": dict(out_dtype=F32, bias=True, gelu=True),
    "requant": dict(bias=True, requant="per_channel"),
    "requant+zero_point+gelu+a_zero": dict(bias=True, gelu=True, requant="zero_point", a_zero=True),
}
# (PERSISTENT, fake SM count): one tile per program; then 1, 2 and 4 programs each looping over several of the 9 (or
# 12) tiles, unevenly where the tiles do not divide.
GRIDS = [(0, 1), (1, 1), (2, 1), (1, 2), (2, 2)]


def _run_epilogue(m, n, k, epilogue, config, sms):
    """(out, float64 reference, y, mult): y and mult only for a requantized output, whose reference is codes."""
    e = EPILOGUES[epilogue]
    a, b = _int8_operands(m, n, k)
    requant = e.get("requant")
    # outputs of about unit size: |acc| ~ 74^2 * sqrt(K)
    sa = (torch.rand(1 if requant else m, device=DEVICE) + 0.5) * 4e-3
    sb = (torch.rand(n, device=DEVICE) + 0.5) * 4e-3
    bias = torch.randn(n, device=DEVICE) if e.get("bias") else None
    a_zero = torch.randint(-20, 20, (m,), dtype=torch.int32, device=DEVICE) if e.get("a_zero") else None
    gelu = e.get("gelu", False)
    if requant:
        mult = (torch.rand(n if requant == "per_channel" else 1, device=DEVICE) + 0.5) * 40
        zero = torch.tensor([-7], dtype=torch.int32, device=DEVICE) if requant == "zero_point" else None
        out = int8_gemm(a, b, sa, sb, bias, a_zero, F32, gelu=gelu, requant=(mult, zero), config=config, sms=sms)
        y, ref = _requant_reference(a, b, sa, sb, bias if bias is not None else torch.zeros(n, device=DEVICE),
                                    gelu, mult, zero, a_zero)
        return out, ref, y, mult
    out = int8_gemm(a, b, sa, sb, bias, a_zero, e["out_dtype"], gelu=gelu, config=config, sms=sms)
    a_int = a.double() - (a_zero.double()[:, None] if a_zero is not None else 0)
    ref = (a_int @ b.double()) * sa.double()[:, None] * sb.double() + (bias.double() if bias is not None else 0)
    return out, torch.nn.functional.gelu(ref) if gelu else ref, None, None


@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("persistent,sms", GRIDS)
@pytest.mark.parametrize("m,n,k", [(37, 45, 70), (50, 33, 96)])  # no dimension a multiple of its block; K both
def test_every_grid_and_epilogue_matches_float64(poison, epilogue, persistent, sms, m, n, k):
    """The config is forced past the autotuner (which the interpreter offers one config) with a fake SM count, so
    that persistent programs loop over several tiles, in tile_ids' order with GROUP_M = 2 (a partial last group).
    `poison` NaN-fills (int8: -77) the output first: a tile no program stored shows."""
    config = triton.Config(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, PERSISTENT=persistent), num_warps=4)
    tiles = triton.cdiv(m, 16) * triton.cdiv(n, 16)
    grid = programs(m, n, config.kwargs, sms)
    assert grid == (min(tiles, persistent * sms) if persistent else tiles) and (persistent == 0 or grid < tiles)
    out, ref, y, mult = _run_epilogue(m, n, k, epilogue, config, sms)
    if y is not None:
        _assert_codes_match(out, y, ref, mult)
        assert ref.std() > 10  # codes spread over the int8 range
        return
    dtype = EPILOGUES[epilogue]["out_dtype"]
    assert out.dtype == dtype and not out.isnan().any()
    exact_gelu = DEVICE == "cpu" or not EPILOGUES[epilogue].get("gelu")  # the GPU's is the tanh form
    tol = TOL[dtype] if dtype != F32 else 1e-6 if exact_gelu else 2e-3
    assert rel_err(out, ref) < tol


def test_gpu_configs_are_persistent_only_on_large_tiles_and_tuned_only_for_large_m():
    """Every config the GPU autotuner is offered names PERSISTENT; the persistent ones are large tiles (a persistent
    grid of small tiles would only add loop overhead) and are pruned away up to MID_M rows, where the tile grid is
    too small for a persistent grid to differ from the plain one. The interpreter's one config is not persistent."""
    configs = i8_configs(interpret=False)
    assert all("PERSISTENT" in c.kwargs for c in configs)
    persistent = [c for c in configs if c.kwargs["PERSISTENT"]]
    assert persistent and all(c.kwargs["BLOCK_M"] >= 64 for c in persistent)
    for m in (1, 16, 64, 65, 128, 300, MID_M):
        kept = prune_by_m(configs, {"M": m, "N": 768, "K": 768})
        assert kept and not any(c.kwargs["PERSISTENT"] for c in kept)
    for m in (MID_M + 1, 2048, 8192):
        kept = prune_by_m(configs, {"M": m, "N": 768, "K": 768})
        assert all(c in kept for c in persistent) and any(not c.kwargs["PERSISTENT"] for c in kept)
    assert [c.kwargs["PERSISTENT"] for c in i8_configs(interpret=True)] == [0]


def test_autotuner_times_configs_in_a_cuda_graph():
    """The tuner times each config as launches replayed from a CUDA graph (gemm.graph_bench), as the encoder runs
    it, not as single launches whose host cost swamps a microsecond-scale GEMM."""
    from automp.kernels.gemm import graph_bench
    from automp.kernels.int8_gemm import _int8_gemm_kernel
    assert _int8_gemm_kernel.do_bench is graph_bench


# ----------------------------------------------------------------------------------------------- sm_90 build
POINTERS = {"a_ptr": "*i8", "b_ptr": "*i8", "c_ptr": "*fp16", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
            "bias_ptr": "*fp32", "za_ptr": "*i32", "colsum_ptr": "*i32", "qm_ptr": "*fp32", "qz_ptr": "*i32"}


def _constexprs(config: triton.Config, **epilogue) -> dict:
    """An encoder layer's build: K-major b (the weight's [N, K] viewed as [K, N]), so both unit strides are
    specialized, K a whole number of K-steps, fp16 out with bias unless `epilogue` says otherwise."""
    return dict(dict(HAS_BIAS=True, HAS_ZP=False, GELU=False, QUANT_OUT=False, HAS_QZ=False, EVEN_K=True,
                     stride_ak=1, stride_bk=1, stride_sa=0), **config.kwargs, **epilogue)


def _innermost_loop(sass: list[str], holding: str) -> list[str]:
    """The instructions of the shortest loop (a label up to a branch back to it) that holds `holding`."""
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := re.match(r"^(\.L_x_\d+):", line))}
    loops = [sass[labels[m.group(1)]:i] for i, line in enumerate(sass)
             if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i - 1]
    return min((loop for loop in loops if any(holding in line for line in loop)), key=len)


def test_sm90_requant_epilogue_converts_without_float_to_int_and_one_tanh_per_element():
    """The GELU + requantization epilogue (an MLP's first GEMM) is bound by its quarter-rate instructions: one hardware
    tanh per element, and no float-to-int conversion (the rounding is done by an add of 1.5 * 2^23)."""
    cfg = triton.Config(dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, PERSISTENT=0), num_warps=4,
                        num_stages=4)
    for zero_point in (False, True):
        sass = sm90_sass("automp.kernels.int8_gemm", "_int8_gemm_kernel", dict(POINTERS, c_ptr="*i8"),
                         _constexprs(cfg, GELU=True, QUANT_OUT=True, HAS_QZ=zero_point), 4, 4)
        assert sum("MUFU.TANH" in line for line in sass) == 128 * 128 // (32 * 4)
        assert not any(re.search(r"\bF2I\.(S|F16|F32\.S)", line) for line in sass), zero_point


def test_persistent_sm90_build_is_one_flattened_wgmma_loop_resident_k_per_sm():
    """The 128x256x128 persistent build runs its int8 products on wgmma (IGMMA), and its tile and K loops are one
    flattened loop: the innermost loop holding the IGMMAs also holds the epilogue's stores (unflattened, the K loop
    would hold none), which is what lets the next tile's loads overlap this tile's epilogue. And every persistent
    config fits its PERSISTENT programs per SM at once, with either epilogue, else the grid would queue a second wave
    behind programs that never end early."""
    big = triton.Config(dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, PERSISTENT=1), num_warps=8,
                        num_stages=3)
    sass = sm90_sass("automp.kernels.int8_gemm", "_int8_gemm_kernel", POINTERS, _constexprs(big), 8, 3)
    assert any("IGMMA" in line for line in sass)
    assert any("STG" in line for line in _innermost_loop(sass, "IGMMA"))
    persistent = [c for c in i8_configs(interpret=False) if c.kwargs["PERSISTENT"]]
    for c_type, epilogue in (("*fp16", {}), ("*i8", dict(GELU=True, QUANT_OUT=True))):
        resident = sm90_resident("automp.kernels.int8_gemm", "_int8_gemm_kernel", dict(POINTERS, c_ptr=c_type),
                                 [[_constexprs(c, **epilogue), c.num_warps, c.num_stages] for c in persistent])
        assert all(r >= c.kwargs["PERSISTENT"] for r, c in zip(resident, persistent)), (epilogue, resident)
