"""`automp bench kernels`: the decode-attention anchor computes the attention automp's kernel does, and --parts."""
import pytest
import torch

import automp.kernels as K
from automp.bench.suites import kernels


def test_the_sdpa_anchor_is_the_same_attention_as_the_kernel():
    """transformers' decode path (repeat_kv + SDPA with a boolean mask) against automp's op on the same inputs, a
    left-padded row included: the two sides of the benchmark compute one thing."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 8, 64), torch.randn(3, 2, 37, 64), torch.randn(3, 2, 37, 64)
    valid = torch.zeros(3, 37, dtype=torch.bool)
    valid[0, :20], valid[1, 5:30], valid[2] = True, True, True
    ref = kernels._sdpa_decode(q.double(), k.double(), v.double(), valid)
    out = K.decode_attention(q.half(), k.half(), v.half(), valid, 64 ** -0.5).double()
    assert ((out - ref).norm() / ref.norm()).item() < 2e-3


def test_unknown_parts_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        kernels.main(["--parts", "gemv,attn"])
    assert e.value.code == 2 and "--parts: unknown ['attn']" in capsys.readouterr().err


def test_the_planes_part_times_the_kernel_autotuned_and_with_the_scales_prefetch_forced_each_way(monkeypatch):
    """At a tiny product in place of Llama-3-8B's (the interpreter runs it on a CPU), every batch and bit width gets
    three rows against cuBLAS fp16: autotuned over all configs, and over those with PREFETCH_S on or off only, each
    calling the kernel with that choice, its error against float64 carried in the row."""
    monkeypatch.setattr(kernels, "_LLAMA_8B", [("tiny", 40, 256)])
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU host the kernel is compiled, not interpreted
    monkeypatch.setattr(kernels, "_rand",
                        lambda *shape, dtype=torch.float16: torch.randn(*shape, device=device).to(dtype))
    from automp.kernels import planes
    asked = []
    real = planes.quant_planes
    monkeypatch.setattr(planes, "quant_planes", lambda *a, prefetch=None, **kw: asked.append(prefetch) or real(
        *a, prefetch=prefetch, **kw))

    class Rows:
        def __init__(self):
            self.rows = []

        def add(self, name, ours, anchor_name, anchor, nbytes, flops, check=None):
            ours()(), anchor()()
            self.rows.append((name, anchor_name, check))

    rows = Rows()
    kernels.bench_planes(rows, K, quick=False)
    names = [r[0] for r in rows.rows]
    assert len(names) == 3 * 2 * 3 and len(set(names)) == len(names)
    assert all(r[1] == "cuBLAS fp16 mm" and r[2] < 2e-2 for r in rows.rows)
    assert [p for p in asked if p is not None].count(True) == [p for p in asked if p is not None].count(False) == 6
    assert "W4A16 planes tiny 8x40x256, scales ahead" in names
