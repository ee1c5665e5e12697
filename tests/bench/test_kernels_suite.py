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
