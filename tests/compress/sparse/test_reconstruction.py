"""refit: the kept weights and the bias solve each row's (regularised) least-squares problem, checked against a
float64 reference; pruned weights stay zero; bad masks and shapes raise."""
import pytest
import torch
import torch.nn as nn

from automp.compress.sparse import refit
from automp.compress.sparse.masks import two_four_mask


def _problem(bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(16, 12, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(12, 16, generator=g))
    x = torch.randn(400, 16, generator=g)
    y = x @ torch.randn(16, 12, generator=g) + 0.3  # a dense map the pruned layer can only approximate
    keep = two_four_mask(lin.weight)
    with torch.no_grad():
        lin.weight.mul_(keep)
    return lin, keep, x, y


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ridge", [0.0, 0.5])
def test_refit_solves_each_row_least_squares(bias, ridge):
    lin, keep, x, y = _problem(bias)
    w0 = lin.weight.detach().double().clone()
    before = (lin(x) - y).norm().item()
    refit(lin, keep, x, y, ridge=ridge, chunk=5)  # chunk smaller than the rows: the batching is exercised
    assert torch.equal(lin.weight != 0, keep)  # same support, every kept weight refitted
    xd = torch.cat([x, torch.ones(len(x), 1)], 1).double() if bias else x.double()
    lam = ridge * float((x.double() ** 2).sum(0).mean())
    for r in range(12):
        cols = keep[r].nonzero()[:, 0]
        a = xd[:, torch.cat([cols, torch.tensor([16])])] if bias else xd[:, cols]
        pen = torch.cat([torch.full((len(cols),), lam), torch.zeros(int(bias))]).double()
        prior = torch.cat([w0[r, cols], torch.zeros(int(bias), dtype=torch.float64)])
        ref = torch.linalg.solve(a.T @ a + pen.diag(), a.T @ y[:, r].double() + pen * prior)
        got = torch.cat([lin.weight[r, cols], lin.bias[r:r + 1] if bias else lin.weight[r, :0]]).double()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-3, r
    assert (lin(x) - y).norm().item() < before


def test_refit_rejects_bad_masks_and_shapes():
    lin, keep, x, y = _problem()
    ragged = keep.clone()
    ragged[0, keep[0].nonzero()[0, 0]] = False
    with pytest.raises(ValueError, match="same number of kept weights in every row"):
        refit(lin, ragged, x, y)
    with pytest.raises(ValueError, match="bool mask"):
        refit(lin, keep.float(), x, y)
    with pytest.raises(ValueError, match=r"x \[n, 16\] and y \[n, 12\]"):
        refit(lin, keep, x, y[:, :5])
