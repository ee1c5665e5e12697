"""Default Adam/AdamW switched to fused at the first step, only where torch would accept fused=True and the user did
not choose. No CUDA here: the refusals are tested as they are, and the switch itself with the CUDA clause lifted
(torch runs fused Adam on CPU too)."""
import pytest
import torch

import automp.runtime.tuning.fused_optimizers as fo
from automp.runtime.tuning.fused_optimizers import OptimizerFuser, why_not


def params(n: int = 2, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)) for _ in range(n)]


def set_grads(ps, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)


@pytest.fixture
def fuser():
    """An installed fuser recording its reports; always uninstalled (the hook is global)."""
    calls = []
    f = OptimizerFuser(lambda opt, n: calls.append((opt, n)))
    f.install()
    f.calls = calls
    yield f
    f.uninstall()


@pytest.fixture
def cuda_clause_lifted(monkeypatch):
    """why_not as it is, except that CPU parameters pass: the switching logic runs without a GPU."""
    real = fo.why_not

    def lifted(optimizer, group, scaling=False):
        reason = real(optimizer, group, scaling)
        return None if reason is not None and "CUDA" in reason else reason

    monkeypatch.setattr(fo, "why_not", lifted)


class MyAdam(torch.optim.Adam):
    pass


class FakeCudaParam:
    """What why_not reads of a parameter, as a CUDA FP32 one would answer; hashable, as optimizer state keys are."""
    is_cuda, dtype, grad = True, torch.float32, None


@pytest.mark.parametrize("make, words", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "SGD without loss scaling"),
    (lambda ps: torch.optim.RMSprop(ps), "not torch's Adam, AdamW or SGD"),
    (lambda ps: MyAdam(ps), "not torch's Adam"),  # exact type: a subclass may override step
    (lambda ps: torch.optim.Adam(ps, foreach=True), "chose fused/foreach"),
    (lambda ps: torch.optim.AdamW(ps, foreach=False), "chose fused/foreach"),
    (lambda ps: torch.optim.Adam(ps, fused=True), "chose fused/foreach"),
    (lambda ps: torch.optim.Adam(ps, differentiable=True), "differentiable"),
    (lambda ps: torch.optim.AdamW(ps), "CUDA"),
], ids=["sgd", "rmsprop", "subclass", "foreach", "foreach-false", "fused", "differentiable", "cpu-params"])
def test_why_not_reasons(make, words):
    """Each refusal names its cause."""
    opt = make(params())
    reason = why_not(opt, opt.param_groups[0])
    assert reason is not None and words in reason


def test_why_not_refuses_optimizer_with_state():
    """Fused keeps step counters on the device; an optimizer that stepped before keeps its implementation. CUDA
    tensors can't exist here, so the group holds stand-ins that pass the CUDA/dtype clause."""
    opt = torch.optim.Adam(params())
    fake = [FakeCudaParam() for _ in range(2)]
    group = {**opt.param_groups[0], "params": fake}
    assert why_not(opt, group) is None  # the stand-ins reach the end: the clause below is what refuses
    opt.state[fake[1]] = {"step": torch.tensor(1.0)}
    reason = why_not(opt, group)
    assert reason is not None and "state" in reason


def test_cpu_params_left_alone(fuser):
    """Without CUDA nothing is switched: the group is as the user built it, and nothing is reported."""
    ps = params()
    opt = torch.optim.AdamW(ps)
    before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    set_grads(ps, 1)
    opt.step()
    after = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert after == before and after["fused"] is None and after["foreach"] is None
    assert fuser.calls == []


def test_switch_at_first_step_reported_once(fuser, cuda_clause_lifted):
    """First step: fused on, foreach off, amp-scaling flag set, reported with the group count; later steps: nothing."""
    ps = params()
    opt = torch.optim.Adam([{"params": ps[:1]}, {"params": ps[1:], "lr": 1e-2}])
    assert not getattr(opt, "_step_supports_amp_scaling", False)
    set_grads(ps, 1)
    opt.step()
    assert all(g["fused"] is True and g["foreach"] is False for g in opt.param_groups)
    assert opt._step_supports_amp_scaling is True
    assert fuser.calls == [(opt, 2)]
    set_grads(ps, 2)
    opt.step()
    assert len(fuser.calls) == 1


def test_user_choice_not_overridden(fuser, cuda_clause_lifted):
    """With the CUDA clause lifted, an explicit foreach=True is still left as chosen and not reported."""
    ps = params()
    opt = torch.optim.Adam(ps, foreach=True)
    set_grads(ps, 1)
    opt.step()
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[0]["foreach"] is True
    assert fuser.calls == []


def test_uninstall_removes_hook(fuser, cuda_clause_lifted):
    """After uninstall a new optimizer keeps its default implementation."""
    fuser.uninstall()
    ps = params()
    opt = torch.optim.AdamW(ps)
    set_grads(ps, 1)
    opt.step()
    assert opt.param_groups[0]["fused"] is None and fuser.calls == []


@pytest.mark.parametrize("cls, kw", [
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),  # switched under loss scaling
], ids=["adam", "adamw", "sgd"])
def test_switched_matches_foreach(cuda_clause_lifted, cls, kw):
    """The switch changes the implementation, not the arithmetic: 5 steps agree with foreach from the same start."""
    fuser = OptimizerFuser(lambda opt, n: None, scaling=lambda: cls is torch.optim.SGD)
    fuser.install()
    try:
        a, b = params(seed=3), params(seed=3)
        switched = cls(a, **kw)
        reference = cls(b, foreach=True, **kw)  # an explicit choice: the fuser leaves it foreach
        for step in range(5):
            set_grads(a, 10 + step)
            set_grads(b, 10 + step)
            switched.step()
            reference.step()
    finally:
        fuser.uninstall()
    assert switched.param_groups[0]["fused"] is True and reference.param_groups[0]["fused"] is None
    for pa, pb in zip(a, b):
        rel = ((pa - pb).norm() / pb.norm()).item()
        assert rel < 1e-5, rel
    assert not torch.equal(a[0], params(seed=3)[0])  # the steps moved the parameters


def test_sgd_is_switched_only_under_loss_scaling(cuda_clause_lifted):
    """Fused SGD is no faster than foreach; it is switched only where loss scaling would otherwise read each step's
    overflow flag on the host (foreach cannot take found_inf), and never with sparse gradients (fused refuses them)."""
    for scaling in (False, True):
        calls = []
        f = OptimizerFuser(lambda opt, n: calls.append(n), scaling=lambda: scaling)
        f.install()
        try:
            ps = params()
            opt = torch.optim.SGD(ps, lr=0.1, momentum=0.9)
            set_grads(ps, 1)
            opt.step()
        finally:
            f.uninstall()
        assert (opt.param_groups[0]["fused"] is True) is scaling and len(calls) == int(scaling)
        assert getattr(opt, "_step_supports_amp_scaling", False) is scaling
    opt = torch.optim.SGD(params(), lr=0.1)
    fake = [FakeCudaParam() for _ in range(2)]
    group = {**opt.param_groups[0], "params": fake}
    assert why_not(opt, group, scaling=True) is None  # the stand-ins pass: the sparse gradient below is what refuses
    fake[1].grad = torch.randn(4, 3).to_sparse()
    reason = why_not(opt, group, scaling=True)
    assert reason is not None and "sparse" in reason


def test_checkpoint_is_written_as_the_script_would_and_loads_back_fused(fuser, cuda_clause_lifted):
    """A checkpoint saved under automp must not carry fused=True (a CPU resume of the plain script would fail), and
    loaded back into the switched optimizer it must stay fused: steps after a save/load cycle still match foreach."""
    a, b = params(seed=4), params(seed=4)
    switched = torch.optim.Adam(a, lr=1e-2)
    reference = torch.optim.Adam(b, lr=1e-2, foreach=True)

    def step(k):
        set_grads(a, k)
        set_grads(b, k)
        switched.step()
        reference.step()

    for k in range(3):
        step(k)
    saved = switched.state_dict()
    assert saved["param_groups"][0]["fused"] is None and saved["param_groups"][0]["foreach"] is None
    assert switched.param_groups[0]["fused"] is True  # the live optimizer is untouched by the hook

    plain = torch.optim.Adam(params(seed=4), lr=1e-2)  # the script without automp, resuming from the checkpoint
    plain.load_state_dict(saved)
    assert plain.param_groups[0]["fused"] is None

    switched.load_state_dict(saved)
    assert switched.param_groups[0]["fused"] is True and switched.param_groups[0]["foreach"] is False
    for k in range(3, 6):
        step(k)
    for pa, pb in zip(a, b):
        assert ((pa - pb).norm() / pb.norm()).item() < 1e-5
