import pytest
import torch

import automp.kernels as K
from kernel_testutil import DEVICE, TOL, rel_err


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(19, 45, 70), (64, 80, 96), (1, 16, 17), (33, 7, 50)])
def test_gemm_matches_float64(poison, dtype, m, n, k):
    a, b = torch.randn(m, k, dtype=dtype, device=DEVICE), torch.randn(k, n, dtype=dtype, device=DEVICE)
    c = K.gemm(a, b)
    assert c.dtype == dtype and c.shape == (m, n) and torch.isfinite(c).all()
    assert rel_err(c, a.double() @ b.double()) < TOL[dtype]


def test_gemm_transposed_operands_are_handled(poison):
    a = torch.randn(30, 21, dtype=torch.float16, device=DEVICE).t()  # [21, 30], M-stride 1
    b = torch.randn(40, 30, dtype=torch.float16, device=DEVICE).t()  # [30, 40], N-stride 30
    assert rel_err(K.gemm(a, b), a.double() @ b.double()) < TOL[torch.float16]


def test_gemm_rejects_bad_inputs():
    a = torch.randn(4, 8, dtype=torch.float16, device=DEVICE)
    with pytest.raises(TypeError, match="gemm.*float16 or bfloat16"):
        K.gemm(a.float(), a.float().t())
    with pytest.raises(TypeError, match="must match"):
        K.gemm(a, torch.randn(8, 3, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="a \\[M, K\\] and b \\[K, N\\]"):
        K.gemm(a, torch.randn(7, 3, dtype=torch.float16, device=DEVICE))


def test_tile_families_are_pruned_by_m():
    from automp.kernels.gemm import MID_M, SKINNY_M, _cfg, prune_by_m

    configs = [_cfg(16, 64, 128, 4, 4), _cfg(64, 64, 128, 4, 4), _cfg(64, 128, 128, 4, 4), _cfg(128, 128, 64, 4, 4),
               _cfg(128, 256, 64, 8, 3)]
    tiles = lambda m: sorted((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"])  # noqa: E731
                             for c in prune_by_m(configs, {"M": m}))
    assert tiles(8) == [(16, 64)]  # skinny M: only tiles near its height
    assert tiles(SKINNY_M) == [(16, 64), (64, 64), (64, 128)]
    assert len(tiles(128)) == 5  # the band: a few square tiles would leave SMs idle, both are tuned
    assert tiles(MID_M + 1) == [(64, 128), (128, 128), (128, 256)]  # large M: tiles of >= WIDE_TILE only
    assert prune_by_m([configs[0]], {"M": 4096}) == [configs[0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA graphs")
def test_graph_bench_times_a_launch_and_leaves_its_output_right():
    from automp.kernels.gemm import graph_bench
    a, b = (torch.randn(128, 768, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.full((128, 128), float("nan"), device="cuda", dtype=torch.float16)
    q50, q20, q80 = graph_bench(lambda: torch.mm(a, b.t(), out=out), quantiles=(0.5, 0.2, 0.8))
    assert 0 < q20 <= q50 <= q80 < 10  # milliseconds per launch
    assert rel_err(out.float(), a.float() @ b.float().t()) < 1e-2
    assert graph_bench(lambda: torch.mm(a, b.t(), out=out), None) > 0
