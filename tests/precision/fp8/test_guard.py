"""The loss guard of FP8 runs (automp.precision.fp8.guard): the divergence rules on a loss series, the install and its
undo, and, end to end on CPU, a non-finite step that leaves the weights and the optimizer state as they were."""
import contextlib
import math

import pytest
import torch
import torch.nn as nn
from torch.optim import optimizer as optim_module

from automp.precision.fp8.guard import NONFINITE, SPIKE, LossWatch


@contextlib.contextmanager
def installed(watch):
    """The watch installed for the block, undone after it whatever happens."""
    undo = watch.install()
    try:
        yield watch
    finally:
        undo()


def _watch(**kw):
    seen = []
    return LossWatch(seen.append, **kw), seen


def _feed(watch, values):
    for v in values:
        watch.observe(torch.tensor(float(v)))


def _steady(n):
    """A decreasing loss with a little noise around 3.0."""
    return [3.0 - 0.01 * i + 0.05 * math.sin(i) for i in range(n)]


def test_one_spiking_batch_that_recovers_does_not_fire():
    """patience=2: a single hard batch is not a divergence; it is not added to the median either."""
    watch, seen = _watch(window=32, history=16)
    _feed(watch, _steady(20) + [6.0, 2.8, 6.0, 2.8, 2.8])
    assert seen == [] and not watch.fired


def test_a_steady_decreasing_loss_never_fires():
    watch, seen = _watch()
    _feed(watch, _steady(200))
    assert seen == [] and not watch.fired and watch.steps_seen == 200


def test_a_spike_to_twice_the_median_fires_with_its_step_and_median():
    watch, seen = _watch(window=32, history=16)
    losses = _steady(20)
    median = sorted(losses)[len(losses) // 2 - 1: len(losses) // 2 + 1]
    _feed(watch, losses + [2 * 3.0, 6.5, 2.9])
    assert len(seen) == 1
    d = seen[0]
    assert d.rule == SPIKE and d.step == 21 and d.loss == 6.5
    assert d.median == pytest.approx(sum(median) / 2)
    assert watch.fired


def test_a_jump_before_history_losses_exist_does_not_fire():
    watch, seen = _watch(history=16)
    _feed(watch, [3.0] * 10 + [30.0, 3.0])
    assert seen == []


def test_nan_at_step_3_fires_nonfinite_once_only():
    watch, seen = _watch()
    _feed(watch, [3.0, 2.9, 2.8, float("nan"), float("inf"), 100.0] + [50.0] * 40)
    assert len(seen) == 1
    d = seen[0]
    assert (d.step, d.rule) == (3, NONFINITE) and d.median == pytest.approx(2.9) and math.isnan(d.loss)
    assert d.as_dict() == {"step": 3, "loss": "nan", "median": d.median, "rule": NONFINITE}
    assert watch.steps_seen == 46


def test_a_loss_at_or_below_zero_is_watched_for_nonfinite_values_only():
    watch, seen = _watch(history=4)
    _feed(watch, [-2.0] * 10 + [-0.5, 5.0])
    assert seen == []
    _feed(watch, [float("-inf")])
    assert [d.rule for d in seen] == [NONFINITE]


@pytest.mark.parametrize("kw, word", [({"window": 0}, "window"), ({"history": 40}, "history"),
                                      ({"factor": 1.0}, "factor"), ({"factor": float("nan")}, "factor")])
def test_bad_bounds_are_refused_by_name(kw, word):
    with pytest.raises(ValueError, match=word):
        LossWatch(lambda d: None, **kw)


def test_install_and_undo_restore_backward_exactly_and_remove_the_hooks():
    before = torch.Tensor.__dict__["backward"]
    pre, post = len(optim_module._global_optimizer_pre_hooks), len(optim_module._global_optimizer_post_hooks)
    watch, seen = _watch()
    undo = watch.install()
    try:
        assert torch.Tensor.backward is not before
        with pytest.raises(RuntimeError, match="already installed"):
            watch.install()
        with pytest.raises(RuntimeError, match="already installed"):
            LossWatch(lambda d: None).install()
    finally:
        undo()
    assert torch.Tensor.__dict__["backward"] is before
    assert len(optim_module._global_optimizer_pre_hooks) == pre
    assert len(optim_module._global_optimizer_post_hooks) == post
    undo()  # a second undo does nothing

    model, opt = _model_and(torch.optim.SGD, lr=0.1)
    _step(model, opt, nan=True)  # no longer watched: the nan update goes through
    assert watch.steps_seen == 0 and watch.skipped_steps == 0 and seen == []
    assert not torch.isfinite(model.weight).all()
    LossWatch(lambda d: None).install()()  # another watch may install once this one is undone


def test_a_non_scalar_backward_passes_through_unobserved():
    watch, _ = _watch()
    with installed(watch):
        x = torch.ones(3, requires_grad=True)
        y = x * 2
        y.backward(torch.ones_like(y))
        assert torch.equal(x.grad, torch.full((3,), 2.0))
        (x * 3).sum().backward(retain_graph=False)  # a scalar: observed, its arguments passed on
        assert torch.equal(x.grad, torch.full((3,), 5.0))
    assert watch.steps_seen == 1


def _model_and(opt_cls, **kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, opt_cls(model.parameters(), **kw)


def _step(model, opt, nan=False):
    opt.zero_grad()
    loss = model(torch.randn(5, 4)).pow(2).mean()
    if nan:
        loss = loss * float("nan")
    loss.backward()
    opt.step()


def _fused_supported(opt_cls, **kw):
    try:
        model, opt = _model_and(opt_cls, fused=True, **kw)
        _step(model, opt)
        return True
    except (RuntimeError, ValueError):
        return False


OPTIMIZERS = [
    pytest.param(torch.optim.AdamW, {"lr": 0.01, "fused": True}, id="fused-adamw",
                 marks=pytest.mark.skipif(not _fused_supported(torch.optim.AdamW, lr=0.01),
                                          reason="this torch build has no fused AdamW on CPU")),
    pytest.param(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "fused": True}, id="fused-sgd",
                 marks=pytest.mark.skipif(not _fused_supported(torch.optim.SGD, lr=0.1, momentum=0.9),
                                          reason="this torch build has no fused SGD on CPU")),
    pytest.param(torch.optim.SGD, {"lr": 0.1}, id="sgd"),
    pytest.param(torch.optim.AdamW, {"lr": 0.01}, id="adamw"),
]


@pytest.mark.parametrize("opt_cls, kw", OPTIMIZERS)
def test_a_nan_step_leaves_weights_and_state_unchanged_and_the_next_step_updates(opt_cls, kw):
    watch, seen = _watch()
    model, opt = _model_and(opt_cls, **kw)
    handed = []  # what the step itself was given: the fused ones decide the skip on the device, through found_inf
    opt.register_step_pre_hook(lambda o, args, kwargs: handed.append(getattr(o, "found_inf", None)))
    with installed(watch):
        for _ in range(3):
            _step(model, opt)
        before = [p.detach().clone() for p in model.parameters()]
        state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[model.weight].items()}
        _step(model, opt, nan=True)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        for k, v in opt.state[model.weight].items():
            assert torch.equal(v, state[k]) if torch.is_tensor(v) else v == state[k], k
        assert not hasattr(opt, "found_inf")
        assert watch.skipped_steps == 1
        assert [(d.rule, d.step) for d in seen] == [(NONFINITE, 3)]
        _step(model, opt)
        assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert all(torch.isfinite(p).all() for p in model.parameters())
        _step(model, opt, nan=True)  # after the report, a non-finite step still never reaches the weights
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert watch.skipped_steps == 2 and len(seen) == 1
        if kw.get("fused"):  # decided on the device, but for a fused SGD's first momentum step (loss scaling's rule)
            first_on_host = kw.get("momentum", 0) != 0
            assert (handed[0] is None) == first_on_host
            assert [float(f) for f in handed[int(first_on_host):]] == [0.0, 0.0, 0.0, 1.0, 0.0, 1.0][int(first_on_host):]
        else:
            assert handed == [None] * 6


@pytest.mark.skipif(not _fused_supported(torch.optim.SGD, lr=0.1, momentum=0.9),
                    reason="this torch build has no fused SGD on CPU")
def test_a_nan_first_step_of_fused_sgd_leaves_no_uninitialised_momentum_buffer():
    """Fused SGD creates its momentum buffers with empty_like before the kernel: a first step skipped in the kernel
    would keep garbage in them for every later step, so the first step is decided on the host."""
    watch, _ = _watch()
    model, opt = _model_and(torch.optim.SGD, lr=0.1, momentum=0.9, fused=True)
    with installed(watch):
        _step(model, opt, nan=True)
        assert "momentum_buffer" not in opt.state[model.weight] and watch.skipped_steps == 1
        _step(model, opt)  # the first real step: the buffer starts as the gradient
        assert torch.equal(opt.state[model.weight]["momentum_buffer"], model.weight.grad)


def test_a_found_inf_set_by_someone_else_is_left_to_them():
    if not _fused_supported(torch.optim.AdamW, lr=0.01):
        pytest.skip("this torch build has no fused AdamW on CPU")
    watch, _ = _watch()
    model, opt = _model_and(torch.optim.AdamW, lr=0.01, fused=True)
    with installed(watch):
        _step(model, opt)
        theirs = torch.tensor(0.0)
        opt.found_inf = theirs
        _step(model, opt, nan=True)
        assert opt.found_inf is theirs  # not replaced, not deleted


def test_accumulated_micro_batches_skip_the_step_if_any_loss_was_nonfinite():
    watch, _ = _watch()
    model, opt = _model_and(torch.optim.SGD, lr=0.1)
    with installed(watch):
        _step(model, opt)
        before = model.weight.detach().clone()
        opt.zero_grad()
        for i in range(3):
            loss = model(torch.randn(2, 4)).sum()
            (loss * float("nan") if i == 0 else loss).backward()
        opt.step()
        assert torch.equal(model.weight, before) and watch.skipped_steps == 1


def test_a_watch_with_the_skip_off_reports_but_lets_the_step_through():
    watch, seen = _watch(skip_nonfinite=False)
    model, opt = _model_and(torch.optim.SGD, lr=0.1)
    with installed(watch):
        _step(model, opt, nan=True)
    assert [d.rule for d in seen] == [NONFINITE] and watch.skipped_steps == 0
    assert not torch.isfinite(model.weight).all()


def test_a_loss_computed_in_a_step_closure_belongs_to_that_step_not_the_next():
    watch, _ = _watch()
    model, opt = _model_and(torch.optim.SGD, lr=0.1)
    with installed(watch):
        _step(model, opt)

        def closure():
            opt.zero_grad()
            loss = model(torch.randn(5, 4)).sum() * float("nan")
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.ones_like(p))
        _step(model, opt)
        assert not torch.equal(model.weight, torch.ones_like(model.weight)) and watch.skipped_steps == 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_on_cuda_a_steady_step_never_waits_for_the_device_and_a_nan_step_is_skipped_there():
    watch, seen = _watch()
    torch.manual_seed(0)
    model = nn.Linear(64, 64).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    x = torch.randn(32, 64, device="cuda")

    def step(nan=False):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        (loss * float("nan") if nan else loss).backward()
        opt.step()

    with installed(watch):
        step()  # the first step of a fused optimizer is decided on the host
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(20):
                step()
            before = [p.detach().clone() for p in model.parameters()]
            step(nan=True)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert opt.state[model.weight]["step"].item() == 21
        watch.flush()
        assert [(d.rule, d.step) for d in seen] == [(NONFINITE, 21)] and watch.skipped_steps == 1
        step()
        assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@cuda
def test_on_cuda_a_spike_is_reported_once_its_copy_has_landed():
    watch, seen = _watch(history=4)
    for v in [3.0] * 8 + [9.0, 9.0]:  # patience 2: the second loss in a row above the bound is reported
        watch.observe(torch.tensor(v, device="cuda", requires_grad=True) * 1.0)
    watch.flush()
    assert [(d.rule, d.step, d.median) for d in seen] == [(SPIKE, 9, 3.0)]
