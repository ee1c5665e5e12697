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
    monkeypatch.setattr(gemv_quant, "_GEMV_SPLIT_MIN_K", 0)
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


def _case(quantize, n, k, group, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    qw, s = quantize((torch.randn(n, k, generator=g) * 0.02).to(DEVICE), group)
    x = (torch.randn(k, generator=g) * scale).to(torch.float16).to(DEVICE)
    return qw, s, x, K.dequantize_weight(qw, s, k).double() @ x.double()


WORD_PATH = "words" if DEVICE == "cpu" else "f16x2"


@pytest.mark.parametrize("quantize", [K.quantize_weight_int8, K.quantize_weight_int4])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("n,k,group", [(37, 520, 32), (21, 640, 64), (9, 1000, None), (5, 72, 32)])
def test_word_path_matches_float64_reference(poison, quantize, split_k, n, k, group):
    """fp16 x and whole words take the word layout (f16x2 on the GPU, its plain-Triton twin here); K = 520, 1000, 72
    leave a partial last tile (the masked word loads). Both decodings match the reference."""
    qw, s, x, ref = _case(quantize, n, k, group)
    assert gemv_quant.word_path(qw, x) == WORD_PATH
    for path in ("bytes", WORD_PATH):
        y = gemv_quant.quant_gemv(qw, s, x, split_k=split_k, path=path)
        assert not y.isnan().any() and rel_err(y, ref) < TOL[torch.float16], path


@pytest.mark.parametrize("quantize", [K.quantize_weight_int8, K.quantize_weight_int4])
@pytest.mark.parametrize("scale", [2e-3, 1.0, 3000.0])
def test_word_path_keeps_small_and_large_activations(poison, quantize, scale):
    """The word path sums products in fp16 halves: activations of 3000 must not overflow, and 2e-3 must not lose
    precision to subnormals. Codes reach their extremes whatever the weights' scale (0.02: outputs stay inside
    fp16's range)."""
    qw, s, x, ref = _case(quantize, 33, 256, 64, scale=scale, seed=1)
    y = gemv_quant.quant_gemv(qw, s, x)
    assert y.isfinite().all() and rel_err(y, ref) < TOL[torch.float16]


def test_word_path_choice_and_bad_path():
    qw, s, x, _ = _case(K.quantize_weight_int4, 8, 64, 32)
    assert gemv_quant.word_path(qw, x.to(torch.bfloat16)) == "bytes"  # the f16x2 arithmetic is fp16's
    strided = torch.randn(64, 2, dtype=torch.float16, device=DEVICE)[:, 0]
    assert gemv_quant.word_path(qw, strided) == "bytes"
    q8, _ = K.quantize_weight_int8(torch.randn(8, 66), 32)  # K % 4 != 0
    assert gemv_quant.word_path(q8.to(DEVICE), torch.randn(66, dtype=torch.float16, device=DEVICE)) == "bytes"
    with pytest.raises(ValueError, match="path 'words' does not apply"):
        gemv_quant.quant_gemv(qw, s, x.to(torch.bfloat16), path="words")
    with pytest.raises(ValueError, match="path 'tiles'"):
        gemv_quant.quant_gemv(qw, s, x, path="tiles")


class _NoSplitSum:
    def __getitem__(self, grid):
        raise AssertionError("the GEMV split K (it launched the partials' sum)")


def test_single_row_gemv_leaves_k_4096_unsplit(poison, monkeypatch):
    """The GEMV's own threshold (measured: K = 4096 ran fastest unsplit at every 8B width) sits above the rows
    kernel's, which would split this shape: the GEMV must launch no partials' sum."""
    assert gemv_quant._gemv_split(16, 4096, 128, 132)[0] > 1  # the rows kernel's rule
    monkeypatch.setattr(gemv_quant, "_split_sum_kernel", _NoSplitSum())
    qw, s = K.quantize_weight_int8(torch.randn(16, 4096, device=DEVICE) * 0.02, 128)
    x = torch.randn(4096, dtype=torch.float16, device=DEVICE)
    y = gemv_quant.quant_gemv(qw, s, x)
    assert rel_err(y, K.dequantize_weight(qw, s, 4096).double() @ x.double()) < TOL[torch.float16]


def test_a_k_4096_row_can_be_one_tile_and_split_ranges_keep_their_tiles_whole():
    """The GPU configs the autotuner times (the interpreter runs one): a 4096-deep tile is offered for an unsplit
    K = 4096 GEMV (one memory round trip per program) and pruned where a split's range is shorter, as every tile that
    does not divide the range is."""
    configs = gemv_quant._qgemv_configs(interpret=False)
    unsplit = gemv_quant._qgemv_prune(configs, {"K": 4096, "K_SPAN": 4096, "BITS": 4})
    assert any(c.kwargs["BLOCK_K"] == 4096 for c in unsplit)
    split = gemv_quant._qgemv_prune(configs, {"K": 8192, "K_SPAN": 1024, "BITS": 4})
    assert split and all(1024 % c.kwargs["BLOCK_K"] == 0 for c in split)


@pytest.mark.parametrize("quantize", [K.quantize_weight_int8, K.quantize_weight_int4])
@pytest.mark.parametrize("n,k,group", [(37, 519, 32), (21, 1000, 256), (9, 640, None)])
def test_partials_are_each_split_programs_own_product(poison, monkeypatch, quantize, n, k, group):
    """quant_gemv(..., partials=True) and the op behind the compiled fold: row j is the product over split program j's
    K range alone (float64 reference of that range), unsummed; the CPU reference op gives the same rows. `poison`
    NaN-fills torch.empty, so a partial no program wrote comes out NaN."""
    monkeypatch.setattr(gemv_quant, "_GEMV_SPLIT_MIN_K", 0)
    qw, s = quantize(torch.randn(n, k, device=DEVICE), group)
    x = torch.randn(k, dtype=torch.float16, device=DEVICE)
    _, split, span = gemv_quant._plan(qw, s, x)
    assert split == gemv_quant.partial_count(qw, s, x) > 1
    w = K.dequantize_weight(qw, s, k).double()
    want = torch.stack([w[:, j * span:(j + 1) * span] @ x.double()[j * span:(j + 1) * span] for j in range(split)])
    # the kernel's own rounding (half-precision tile sums on the word path) against the float32 reference's
    for out, tol in ((torch.ops.automp.quant_gemv_partials(qw, s, x), TOL[torch.float16]),
                     (gemv_quant.reference_partials(qw, s, x), 1e-5)):
        assert out.dtype == torch.float32 and out.shape == (split, n) and not out.isnan().any()
        assert all(rel_err(out[j], want[j]) < tol for j in range(split))
    assert rel_err(gemv_quant.quant_gemv(qw, s, x, partials=True).sum(0), w @ x.double()) < TOL[torch.float16]


def test_unsplit_partials_are_one_float32_row(poison):
    qw, s = K.quantize_weight_int4(torch.randn(24, 256, device=DEVICE), 128)
    x = torch.randn(256, dtype=torch.float16, device=DEVICE)
    out = torch.ops.automp.quant_gemv_partials(qw, s, x)
    assert out.shape == (1, 24) and out.dtype == torch.float32
    assert rel_err(out[0], K.dequantize_weight(qw, s, 256).double() @ x.double()) < TOL[torch.float16]


@pytest.mark.parametrize("fold", [True, False])
def test_a_compiled_gemv_leaves_its_split_sum_to_the_next_kernel(monkeypatch, fold):
    """Traced by torch.compile, quant_gemv hands Inductor the split partials and their sum: the generated code calls
    the partials op and no split-sum kernel, and the sum lands inside the consumer's one kernel (here a residual add
    and an RMSNorm). With FOLD_SPLIT_SUMS off the step calls the GEMV op as eager mode does. Same result either way."""
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setattr(gemv_quant, "_GEMV_SPLIT_MIN_K", 0)
    monkeypatch.setattr(K, "FOLD_SPLIT_SUMS", fold)
    qw, s = K.quantize_weight_int4(torch.randn(40, 1024, device=DEVICE), 128)
    x, res = torch.randn(1024, dtype=torch.float16, device=DEVICE), torch.randn(40, dtype=torch.float16, device=DEVICE)
    assert gemv_quant.partial_count(qw, s, x) > 1

    def step(x, res):
        r = (K.quant_gemv(qw, s, x) + res).float()
        return (r * torch.rsqrt(r.pow(2).mean() + 1e-6)).half()

    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(step, fullgraph=True), x, res)
    code = "\n".join(code)
    assert ("quant_gemv_partials" in code) == fold and ("automp.quant_gemv.default" in code) != fold
    monkeypatch.setattr(gemv_quant, "_GEMV_SPLIT_MIN_K", 1 << 30)  # unsplit: nothing to fold, the GEMV op as eager
    torch._dynamo.reset()
    unsplit, unsplit_code = run_and_get_code(torch.compile(step, fullgraph=True), x, res)
    assert "quant_gemv_partials" not in "\n".join(unsplit_code) and rel_err(unsplit, out) < TOL[torch.float16]
    r = (K.dequantize_weight(qw, s, 1024).double() @ x.double() + res.double())
    assert rel_err(out, r * torch.rsqrt(r.pow(2).mean() + 1e-6)) < TOL[torch.float16]
    if fold and DEVICE == "cpu":  # Inductor's C++ kernels: the sum is one more load inside the norm's loop
        assert len(set(__import__("re").findall(r"cpp_fused\w+(?= = )", code))) == 1
