"""SparsitySchedule: the cubic ramp's values, masks that follow it during training and only ever grow, the 2:4
ramp over layers (least damaged first), attach() to an optimizer, bad arguments."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.compress.sparse import SparsityConfig, SparsitySchedule, finalize, get_masks
from automp.compress.sparse import masks as M
from automp.compress.sparse import pruning as P


@pytest.fixture(autouse=True)
def _finalize_leftovers():
    yield
    for model in list(P._ACTIVE):
        finalize(model)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 32),
                         nn.GELU(), nn.Linear(32, 8))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 16, generator=g)
    return x, torch.sin(x[:, :8])


def test_amount_follows_the_cubic_ramp():
    sched = SparsitySchedule(_model(), SparsityConfig("unstructured", 0.8), steps=100, every=10, begin=20)
    assert sched.amount_at(0) == sched.amount_at(20) == 0.0
    for t in (25, 50, 70, 119):
        assert sched.amount_at(t) == pytest.approx(0.8 * (1 - (1 - (t - 20) / 100) ** 3))
    assert sched.amount_at(120) == sched.amount_at(10_000) == pytest.approx(0.8)
    assert sched.amount_at(30) - sched.amount_at(20) > sched.amount_at(120) - sched.amount_at(110)  # fast, then slow


def test_masks_follow_the_ramp_during_training_and_never_shrink():
    model = _model()
    steps, every = 23, 5  # not a multiple: the final amount must still be reached at the last step
    sched = SparsitySchedule(model, SparsityConfig("unstructured", 0.75), steps=steps, every=every)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-2)
    sched.attach(opt)
    x, y = _batch()
    pruned = {n: torch.zeros_like(m) for n, m in get_masks(model).items()}
    for t in range(1, steps + 6):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()  # attach(): calls sched.step()
        assert sched.t == t
        last = t - t % every if t < steps else steps
        want = sched.amount_at(last)
        for n, keep in get_masks(model).items():
            w = dict(model.named_modules())[n].weight
            assert abs(int((~keep).sum()) - want * keep.numel()) <= 1, (t, n)
            assert (w[~keep] == 0).all()
            assert (~keep)[pruned[n]].all()  # once pruned, always pruned
            pruned[n] = ~keep
    assert sched.done and sched.report().sparsity == pytest.approx(0.75, abs=2e-3)


def test_two_four_ramps_over_layers_least_damaged_first():
    model = _model(seed=3)
    with torch.no_grad():
        model[0].weight.mul_(torch.tensor([1.0, 1.0, 0.01, 0.01] * 4))  # already near 2:4: almost no damage
    names = ["0", "2", "4", "6"]
    damage = {n: M.two_four_damage(model.get_submodule(n).weight) for n in names}
    sched = SparsitySchedule(model, SparsityConfig("2:4", layers=[n for n in names if n != "6"]), steps=9, every=3)
    assert {r.pattern for r in sched.report().layers} == {"dense"} and sched.report().sparsity == 0
    order = []
    for t in range(1, 10):
        sched.step()
        patterns = {r.name: r.pattern for r in sched.report().layers}
        done = [n for n, p in patterns.items() if p == "2:4"]
        order += [n for n in done if n not in order]
        if t % 3 == 0:
            assert len(done) == math.ceil(sched.amount_at(t) * 3 - 1e-9)
        for n in done:
            w = model.get_submodule(n).weight
            assert ((w != 0).reshape(w.shape[0], -1, 4).sum(-1) == 2).all()
    assert len(order) == 3 and order[0] == "0"  # the least damaged layer goes first
    assert damage["0"] < min(damage["2"], damage["4"])
    assert (model[6].weight != 0).all()  # not matched


def test_bad_arguments():
    model = _model()
    cfg = SparsityConfig("unstructured", 0.5)
    for kw, what in ((dict(steps=0), "steps"), (dict(steps=10, every=0), "every"),
                     (dict(steps=10, begin=-1), "begin"), (dict(steps=2.5), "steps")):
        with pytest.raises(ValueError, match=what):
            SparsitySchedule(model, cfg, **kw)
    SparsitySchedule(model, cfg, steps=10)
    with pytest.raises(ValueError, match="already has sparsity masks"):
        SparsitySchedule(model, cfg, steps=10)
