"""automp.kernels.decode_attention: the split-KV kernel (interpreted on the CPU) and the op's torch reference against
a float64 softmax over the valid slots, on odd shapes and masks; strided caches; tracing; bad input."""
import importlib

import pytest
import torch

import automp.kernels as K
from automp.kernels import ops
from kernel_testutil import DEVICE, TOL, rel_err

da = importlib.import_module("automp.kernels.decode_attention")  # automp.kernels.decode_attention is the function

# (B, Hq, Hkv, D, L): G = Hq / Hkv of 4, 1, 4 and 20 (two 16-head blocks); D = 80 masks its 128-wide tile; L = 37
# ends in a partial tile and L = 256 spans 16 interpreter tiles, most of them skipped under a short prefix.
SHAPES = [(1, 4, 1, 64, 37), (3, 8, 8, 80, 37), (1, 32, 8, 128, 256), (3, 4, 1, 128, 1), (3, 32, 8, 64, 37),
          (1, 8, 8, 80, 256), (3, 4, 1, 80, 256), (1, 40, 2, 32, 37)]
MASKS = ["prefix", "padded", "full", "mixed"]


def _mask(kind: str, b: int, length: int, g: torch.Generator) -> torch.Tensor:
    """valid [B, L]: a causal prefix of random length, a left-padded window (pads False, then the tokens, then the
    unreached tail), the whole cache, or rows cycling through prefix / padded / all False."""
    valid = torch.zeros(b, length, dtype=torch.bool)
    for i in range(b):
        row = kind if kind != "mixed" else ("empty", "prefix", "padded")[i % 3]
        end = int(torch.randint(1, length + 1, (), generator=g))
        if row == "full":
            valid[i] = True
        elif row == "prefix":
            valid[i, :end] = True
        elif row == "padded":
            valid[i, int(torch.randint(0, end, (), generator=g)):end] = True
    return valid.to(DEVICE)


def _inputs(b, hq, hkv, d, length, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g).to(dtype).to(DEVICE)
               for shape in ((b, hq, d), (b, hkv, length, d), (b, hkv, length, d)))
    return q, k, v, g


def _reference(q, k, v, valid, scale):
    """float64 softmax(scale * q . k) . v over the valid slots of the fp16/bf16 inputs; NaN for an empty row."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    scores = q.double().reshape(b, hkv, hq // hkv, d) @ k.double().transpose(-1, -2) * scale
    p = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
    return (p @ v.double().masked_fill(~valid[:, None, :, None], 0.0)).reshape(b, hq, d)


def _check(out, q, k, v, valid, scale, tol):
    """Rows with a valid slot match the float64 reference within tol; rows with none are exactly zero."""
    assert out.shape == q.shape and out.dtype == q.dtype and not out.isnan().any()
    empty = ~valid.any(dim=1)
    assert (out[empty] == 0).all()
    if (~empty).any():
        ref = _reference(q, k, v, valid, scale)
        assert rel_err(out[~empty], ref[~empty]) < tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("b,hq,hkv,d,length", SHAPES)
def test_matches_float64_reference(poison, monkeypatch, b, hq, hkv, d, length, kind, dtype):
    """The op through the kernel (poison NaN-fills its output and scratch: any unwritten element shows) and through
    its CPU torch reference, both against float64."""
    q, k, v, g = _inputs(b, hq, hkv, d, length, dtype)
    valid, scale = _mask(kind, b, length, g), d ** -0.5
    _check(K.decode_attention(q, k, v, valid, scale), q, k, v, valid, scale, TOL[dtype])
    if DEVICE == "cpu":
        with monkeypatch.context() as m:
            m.setattr(ops, "INTERPRET", False)
            _check(K.decode_attention(q, k, v, valid, scale), q, k, v, valid, scale, TOL[dtype])


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 16, 20])
def test_every_split_count_merges_to_the_same_attention(poison, splits):
    """Forced splits, up to more programs than the cache has tiles (those see nothing and write m = -inf); a short
    prefix leaves most splits with no valid tile. Repeated calls agree bit for bit (the merge has a fixed order)."""
    q, k, v, _ = _inputs(2, 8, 2, 64, 256, torch.float16, seed=1)
    valid = torch.zeros(2, 256, dtype=torch.bool, device=DEVICE)
    valid[0, :40] = True
    valid[1, 3:200] = True
    out = da.decode_attention(q, k, v, valid, 0.125, splits=splits)
    _check(out, q, k, v, valid, 0.125, TOL[torch.float16])
    assert torch.equal(out, da.decode_attention(q, k, v, valid, 0.125, splits=splits))


def test_strided_caches_and_query(poison):
    """k: a window along L of a larger static cache; v: a transpose of a [B, L, Hkv, D] buffer (last dim
    contiguous); q: a transpose with a strided last dim; valid: a column slice. Strides go to the kernel as given."""
    b, hq, hkv, d, length = 3, 8, 2, 80, 45
    g = torch.Generator().manual_seed(2)
    big = torch.randn(b, hkv, 300, d, generator=g).to(torch.bfloat16).to(DEVICE)
    k = big[:, :, 17:17 + length]
    v = torch.randn(b, length, hkv, d, generator=g).to(torch.bfloat16).to(DEVICE).transpose(1, 2)
    q = torch.randn(b, d, hq, generator=g).to(torch.bfloat16).to(DEVICE).transpose(1, 2)
    valid = torch.zeros(b, 2 * length, dtype=torch.bool, device=DEVICE)[:, ::2]  # every other byte
    valid[:, :30] = True
    valid[1, :5] = False
    assert not (k.is_contiguous() or v.is_contiguous() or q.is_contiguous() or valid.is_contiguous())
    _check(K.decode_attention(q, k, v, valid, 0.1), q, k, v, valid, 0.1, TOL[torch.bfloat16])
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim strided too: slower, still right
    _check(K.decode_attention(q, kt, v, valid, 0.1), q, kt, v, valid, 0.1, TOL[torch.bfloat16])


def test_invalid_slots_never_count(poison):
    """Stale cache contents, NaN included, in slots marked False (pads, the unreached tail) do not reach the output:
    the kernel reads them as zeros and its partly valid tiles mask their scores."""
    q, k, v, g = _inputs(3, 8, 2, 64, 70, torch.float16, seed=3)
    valid = _mask("mixed", 3, 70, g)
    bad = ~valid[:, None, :, None].expand_as(k)
    k_nan, v_nan = k.masked_fill(bad, float("nan")), v.masked_fill(bad, float("inf"))
    _check(K.decode_attention(q, k_nan, v_nan, valid, 0.125), q, k, v, valid, 0.125, TOL[torch.float16])


def test_split_chooser():
    """About _WAVES programs per SM, never more splits than tiles, at least one."""
    assert da.splits_for(1, 8, 1, 4096, 64, 132) == 33
    assert da.splits_for(1, 8, 1, 100, 64, 132) == 2
    assert da.splits_for(64, 8, 1, 4096, 64, 132) == 1
    assert da.splits_for(1, 1, 1, 1 << 20, 64, 132) == da._MAX_SPLITS
    assert da.splits_for(2, 8, 1, 0, 64, 132) == 1


def test_opcheck_and_torch_compile():
    """Schema and fake impl (opcheck), then a fullgraph compile around the op that reproduces eager bit for bit."""
    q, k, v, g = _inputs(2, 8, 2, 32, 20, torch.float16, seed=4)
    valid = _mask("mixed", 2, 20, g)
    torch.library.opcheck(torch.ops.automp.decode_attention, (q, k, v, valid, 0.25),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))

    def step(q, k, v, valid):
        return K.decode_attention(q * 2, k, v, valid, 0.125) + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(q, k, v, valid), step(q, k, v, valid))


def _bad_cases():
    h = torch.float16
    q, k, valid = torch.randn(2, 8, 64, dtype=h), torch.randn(2, 2, 10, 64, dtype=h), torch.ones(2, 10, dtype=bool)
    return [
        ((q[0], k, k, valid), "q must be \\[B, Hq, D\\]"),
        ((q, k[0], k[0], valid), "k and v must be \\[B, Hkv, L, D\\]"),
        ((q, k, k[:, :, :5], valid), "of one shape"),
        ((q[:, :7], k, k, valid), "Hq=7 must be a multiple of KV heads Hkv=2"),
        ((q.float(), k.float(), k.float(), valid), "q must be float16 or bfloat16"),
        ((q, k.bfloat16(), k, valid), "must match q dtype"),
        ((q[:1], k, k, valid), "in batch B and head dim D"),
        ((q[..., :32], k, k, valid), "in batch B and head dim D"),
        ((torch.randn(2, 8, 320, dtype=h), torch.randn(2, 2, 10, 320, dtype=h),
          torch.randn(2, 2, 10, 320, dtype=h), valid), "head dim D=320 is unsupported"),
        ((q, k, k, valid.int()), "valid must be a bool mask"),
        ((q, k, k, valid[:, :9]), "valid must be \\[B, L\\]"),
        ((q, k, k, valid.to("meta")), "all tensors must be on one device"),
    ]


@pytest.mark.parametrize("args,match", _bad_cases())
def test_bad_input_is_a_one_line_value_error(args, match):
    with pytest.raises(ValueError, match=match) as err:
        K.decode_attention(*args, 0.125)
    assert "\n" not in str(err.value) and str(err.value).startswith("automp.kernels.decode_attention: ")
