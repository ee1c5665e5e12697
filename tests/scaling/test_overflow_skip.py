"""An inf/nan in a backward skips exactly the optimizer step it would have poisoned, for any optimizer."""
import pytest
import torch
import torch.nn.functional as F
from tests.scaling.fp16_nets import HalfMLP, rel, twin

from automp.scaling import LossScaleConfig, LossScaler, autograd_hook, install, skip

BAD_STEP = 3


def _batch(step: int, poison: bool = False):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    if poison:
        x[0, 0] = float("inf")
    return x, y


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                      lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)],
                         ids=["adam", "sgd-momentum"])
def test_forced_overflow_skips_exactly_that_step(make_opt):
    torch.manual_seed(0)
    model = HalfMLP()
    ref = twin(model)
    ref_opt = make_opt(ref.parameters())
    for step in range(7):
        if step != BAD_STEP:  # the FP32 reference simply never takes the poisoned step
            ref_opt.zero_grad()
            F.mse_loss(ref(_batch(step)[0]), _batch(step)[1]).backward()
            ref_opt.step()
    opt = make_opt(model.parameters())
    scaler = install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    for step in range(7):
        before = _snapshot(model)
        state_before = {k: v.clone() for k, v in opt.state[model.l1.weight].items()}
        opt.zero_grad()
        F.mse_loss(model(_batch(step, poison=step == BAD_STEP)[0]), _batch(step)[1]).backward()
        opt.step()
        changed = [not torch.equal(a, b) for a, b in zip(before, _snapshot(model))]
        if step == BAD_STEP:
            assert not any(changed)
            after = opt.state[model.l1.weight]
            assert after.keys() == state_before.keys()
            assert all(torch.equal(after[k], state_before[k]) for k in after)  # Adam's step / momentum untouched
            assert scaler.scale == 2.0 ** 9
        else:
            assert all(changed)
    assert scaler.summary() == {"scale": 2.0 ** 9, "overflow_steps": 1, "steps": 7}
    assert skip.skipped_steps() == 1
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.isfinite(p).all() and rel(p.detach(), r.detach()) < 5e-3
    if isinstance(opt, torch.optim.Adam):
        assert int(opt.state[model.l1.weight]["step"]) == 6


def test_two_losses_two_optimizers_only_the_overflowing_one_skips():
    torch.manual_seed(1)
    a, b = HalfMLP(), HalfMLP()
    opt_a, opt_b = torch.optim.Adam(a.parameters(), lr=1e-2), torch.optim.Adam(b.parameters(), lr=1e-2)
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    x, y = _batch(0)
    bad_x, _ = _batch(0, poison=True)
    before_a, before_b = _snapshot(a), _snapshot(b)
    opt_a.zero_grad(), opt_b.zero_grad()
    F.mse_loss(a(bad_x), y).backward()  # both losses first, then both steps: the marks are per parameter
    F.mse_loss(b(x), y).backward()
    opt_a.step(), opt_b.step()
    assert all(torch.equal(p, q) for p, q in zip(before_a, _snapshot(a)))
    assert all(not torch.equal(p, q) for p, q in zip(before_b, _snapshot(b)))
    assert all(torch.isfinite(p.grad).all() for p in b.parameters())
    opt_a.zero_grad()
    F.mse_loss(a(x), y).backward()
    opt_a.step()  # the mark is gone: the next clean step is taken
    assert all(not torch.equal(p, q) for p, q in zip(before_a, _snapshot(a)))


def test_overflow_in_one_micro_batch_skips_the_accumulated_step_and_counts_once():
    torch.manual_seed(2)
    model = HalfMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    before = _snapshot(model)
    for micro in range(4):
        x, y = _batch(micro, poison=micro == 1)
        F.mse_loss(model(x), y).backward()
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(before, _snapshot(model)))
    assert scaler.overflow_steps == 1 and scaler.scale == 2.0 ** 9


def test_autograd_grad_overflow_marks_its_inputs():
    torch.manual_seed(3)
    model = HalfMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    x, y = _batch(0, poison=True)
    gs = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    for p, g in zip(model.parameters(), gs):
        p.grad = g
    before = _snapshot(model)
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(before, _snapshot(model)))


def test_overflow_from_the_scale_itself_backs_off_until_it_fits():
    """An fp16 loss cannot carry a 2^16 gradient seed (fp16 max is 65504): the first steps back off, then train."""
    torch.manual_seed(4)
    model = HalfMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = install(LossScaler())
    x, y = _batch(0)
    for _ in range(4):
        opt.zero_grad()
        F.mse_loss(model(x).half(), y.half()).backward()
        opt.step()
    assert scaler.overflow_steps >= 1 and scaler.scale <= 2.0 ** 15
    assert scaler.steps - scaler.overflow_steps >= 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_flag_does_not_follow_a_freed_parameter_to_its_reused_id():
    """Flags are kept per backward by parameter id (scaling/skip.py); a parameter freed before its step can leave its
    id to a new tensor. The weak reference kept with each id tells them apart: the newcomer's step is not skipped."""
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    try:
        old = torch.nn.Parameter(torch.randn(3))
        skip.record(torch.ones(1), [old])  # an overflow, never stepped
        record = skip._records[-1]
        assert record.flags({id(old)})
        freed = id(old)
        del old
        assert not record.flags({freed})  # whatever holds that id now was not flagged
        assert not record.alive()
        new = torch.nn.Parameter(torch.randn(3))
        opt = torch.optim.SGD([new], lr=0.1)
        skip._records[-1].pending.add(id(new))  # the id reuse, forced: CPython may or may not hand it out again
        record.refs.setdefault(id(new), record.refs[freed])  # ... under the freed parameter's (dead) reference
        new.grad = torch.ones(3)
        before = new.detach().clone()
        opt.step()
        assert not torch.equal(new.detach(), before)  # stepped: the stale flag did not apply
        assert skip.skipped_steps() == 0
    finally:
        autograd_hook.uninstall()


def test_records_of_freed_parameters_are_pruned():
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    try:
        for _ in range(3 * skip._PRUNE_AT):  # backward calls whose parameters are dropped without a step
            p = torch.nn.Parameter(torch.randn(2))
            skip.record(torch.zeros(1), [p])
            del p
        assert len(skip._records) <= skip._PRUNE_AT
        kept = torch.nn.Parameter(torch.randn(2))
        skip.record(torch.ones(1), [kept])
        assert any(r.flags({id(kept)}) for r in skip._records)  # live flags survive the pruning
    finally:
        autograd_hook.uninstall()
