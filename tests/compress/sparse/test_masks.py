"""Mask arithmetic: the 2:4 pattern, exact unstructured counts, largest magnitudes kept, masks that only grow."""
import pytest
import torch

from automp.compress.sparse import masks as M


def _w(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_two_four_keeps_the_two_largest_of_every_group_of_four():
    w = _w(24, 64)
    keep = M.two_four_mask(w)
    groups, kept = w.abs().reshape(24, 16, 4), keep.reshape(24, 16, 4)
    assert (kept.sum(-1) == 2).all()  # exactly 2 per group of 4 along in_features
    # every kept weight is at least as large as every pruned one of its group
    low_kept = groups.masked_fill(~kept, float("inf")).amin(-1)
    high_pruned = groups.masked_fill(kept, -1.0).amax(-1)
    assert (low_kept >= high_pruned).all()
    assert M.is_two_four(w * keep) and not M.is_two_four(w)


def test_two_four_groups_run_along_the_input_dim():
    w = torch.tensor([[1.0, 9.0, 2.0, 8.0, 7.0, 0.5, 6.0, 0.1]])
    assert M.two_four_mask(w).tolist() == [[False, True, False, True, True, False, True, False]]
    with pytest.raises(ValueError, match="multiple of 4"):
        M.two_four_mask(_w(4, 6))


@pytest.mark.parametrize("amount", [0.0, 0.3, 0.5, 0.77, 0.99])
def test_unstructured_prunes_the_amount_to_one_element(amount):
    w = _w(37, 53, seed=1)
    keep = M.magnitude_mask(w, amount)
    pruned = int((~keep).sum())
    assert abs(pruned - amount * w.numel()) <= 1
    if 0 < pruned < w.numel():
        assert w.abs()[keep].min() >= w.abs()[~keep].max()


def test_global_masks_share_one_threshold():
    small, large = _w(16, 32, seed=2) * 0.1, _w(16, 32, seed=3)
    keep = M.global_magnitude_masks({"small": small, "large": large}, 0.5)
    pruned = int((~keep["small"]).sum() + (~keep["large"]).sum())
    assert abs(pruned - 0.5 * 2 * small.numel()) <= 1
    assert (~keep["small"]).float().mean() > 0.85 > 0.15 > (~keep["large"]).float().mean()  # small weights go first
    kept = torch.cat([small[keep["small"]], large[keep["large"]]]).abs()
    gone = torch.cat([small[~keep["small"]], large[~keep["large"]]]).abs()
    assert kept.min() >= gone.max()


def test_new_masks_keep_old_zeros():
    w = _w(8, 16, seed=4)
    first = M.magnitude_mask(w, 0.3)
    # the old mask pruned some large weights (as if training had grown them back): they stay pruned
    forced = first.clone()
    forced[0, w[0].abs().argmax()] = False
    second = M.magnitude_mask(w, 0.6, forced)
    assert not (second & ~forced).any()
    assert abs(int((~second).sum()) - 0.6 * w.numel()) <= 1
    assert not (M.two_four_mask(w, forced) & ~forced).any()


def test_damage_and_sparsity():
    w = _w(8, 16, seed=5)
    d = M.two_four_damage(w)
    kept = w * M.two_four_mask(w)
    assert d == pytest.approx(1 - float((kept ** 2).sum() / (w ** 2).sum()), rel=1e-6)
    assert 0 < d < 0.5  # the pruned half is the smaller half
    assert M.sparsity(kept) == pytest.approx(0.5)
