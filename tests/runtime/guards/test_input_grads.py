"""Modules whose input gradient the script differentiates again (WGAN-GP's gradient penalty) stay off the compiled
paths: through a compiled module the script's own `torch.autograd.grad(..., create_graph=True)` would raise."""
import pytest
import torch
import torch.nn as nn

import automp
from automp.config import AutoMPConfig
from automp.runtime.decisions import DOUBLE_BACKWARD, INPUT_GRADS, Route
from automp.runtime.trial import TrialConfig
from automp.runtime.guards.input_grads import asks_input_grad

from tests.runtime.sessions import inject


def test_which_calls_ask_for_an_input_gradient():
    x, w = torch.randn(2, 3), nn.Parameter(torch.randn(3))
    assert asks_input_grad((x.requires_grad_(),), {})
    assert asks_input_grad((), {"inputs": torch.randn(2, requires_grad=True)})
    assert not asks_input_grad((torch.randn(2, 3),), {})
    assert not asks_input_grad((torch.randn(2, 3, requires_grad=True) * 2,), {})  # not a leaf: a GAN's fake
    assert not asks_input_grad((w,), {})  # a parameter's gradient is the usual one


def _wgan_gp(iterations: int, penalty_from: int = 0):
    """A WGAN-GP loop: the critic's gradient with respect to a mix of real and fake, then its norm's gradient."""
    torch.manual_seed(0)
    g, d = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 12)), nn.Sequential(
        nn.Linear(12, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    od, og = torch.optim.Adam(d.parameters(), lr=1e-4), torch.optim.Adam(g.parameters(), lr=1e-4)
    for i in range(iterations):
        real, z = torch.randn(16, 12), torch.randn(16, 8)
        fake = g(z).detach()
        loss_d = d(fake).mean() - d(real).mean()
        if i >= penalty_from:
            mix = (0.5 * real + 0.5 * fake).requires_grad_(True)
            grad, = torch.autograd.grad(d(mix).sum(), mix, create_graph=True)
            loss_d = loss_d + 10 * ((grad.norm(dim=1) - 1) ** 2).mean()
        od.zero_grad()
        loss_d.backward()
        od.step()
        og.zero_grad()
        (-d(g(z)).mean()).backward()
        og.step()
    return loss_d.item()


def _enable_timed(monkeypatch, config: TrialConfig | None = None) -> None:
    """automp enabled with every path but stock Inductor as candidates, on an injected clock where automp's compiled
    graphs are the fastest: each module call advances it by a quarter of its path's cost."""
    cost = {Route.FP32: 0.030, Route.EAGER_LOW: 0.020, Route.COMPILED: 0.010}
    now = [0.0]
    inject(monkeypatch, candidates=lambda device, low: (list(cost), "test"), clock=lambda: now[0],
           trial_config=config)
    automp.enable(dtype="bf16", inner="eager", spec="h100")
    session = automp._session
    real_run = session._run
    monkeypatch.setattr(session, "_run", lambda m, r, p, a, k: now.__setitem__(0, now[0] + cost[p] / 4) or real_run(
        m, r, p, a, k))


def test_a_gradient_penalty_takes_the_critic_off_the_compiled_paths(monkeypatch, fresh_session):
    # automp's compiled graphs would win the trial on time, and would crash the penalty's double backward
    _enable_timed(monkeypatch)
    _wgan_gp(60)
    rep = automp.disable()
    assert {c["path"] for c in rep["choices"]} <= {Route.EAGER_LOW.value, Route.FP32.value}
    assert all("automp-compiled" not in c["timings_ms"] for c in rep["choices"])
    assert any(f.get("rule") == INPUT_GRADS for f in rep["fallbacks"])


@pytest.mark.parametrize("penalty_from", [0, 12])
def test_a_forced_compiled_path_gives_way_when_the_penalty_starts(penalty_from, fresh_session):
    automp.enable(dtype="bf16", inner="eager", path="compile")
    _wgan_gp(16, penalty_from)
    rep = automp.disable()
    paths = {c["module"]: c["path"] for c in rep["choices"]}
    assert paths == {"Sequential": Route.COMPILED.value, "Sequential#2": Route.EAGER_LOW.value}  # the critic moved


def test_a_compiled_winner_gives_way_to_an_eager_trial_when_the_penalty_starts(monkeypatch, fresh_session):
    _enable_timed(monkeypatch, TrialConfig(confirm_after=0))
    _wgan_gp(70, penalty_from=40)  # the trial settles on the compiled path first, then the penalty starts
    rep = automp.disable()
    paths = {c["module"]: c["path"] for c in rep["choices"]}
    assert paths["Sequential"] == Route.COMPILED.value  # the generator keeps its verdict
    assert paths["Sequential#2"] == Route.EAGER_LOW.value


SECOND_ORDER = """
import torch, torch.nn as nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
for _ in range(30):
    loss = net(torch.randn(4, 8)).pow(2).mean()
    grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)  # a gradient of a gradient
    sum(g.pow(2).sum() for g in grads).backward()
"""


def test_a_double_backward_crash_is_explained_and_the_next_run_stays_eager(tmp_path, monkeypatch, capsys,
                                                                          fresh_session):
    # a gradient of a gradient with respect to parameters: nothing at the module's call shows it, so the first run
    # meets torch.compile's refusal; automp says why and what to do, and the next run keeps the module eager
    from automp.launcher import run_script
    script = tmp_path / "second_order.py"
    script.write_text(SECOND_ORDER)
    paths = [Route.COMPILED, Route.EAGER_LOW, Route.FP32]
    inject(monkeypatch, candidates=lambda device, low: (list(paths), "test"))
    assert run_script(str(script), [], AutoMPConfig.from_env(dtype="bf16", inner="eager")) == 1
    err = capsys.readouterr().err
    assert "double backward" in err and "automp run --path eager" in err and "Sequential" in err
    report = tmp_path / "r.json"
    assert run_script(str(script), [], AutoMPConfig.from_env(dtype="bf16", inner="eager", report=str(report))) == 0
    import json
    rep = json.loads(report.read_text())
    (choice,) = rep["choices"]
    assert choice["path"] in (Route.EAGER_LOW.value, Route.FP32.value)
    assert Route.COMPILED.value not in choice["timings_ms"]
    assert any(f.get("rule") == DOUBLE_BACKWARD for f in rep["fallbacks"])


def test_other_errors_of_the_script_get_no_hint(fresh_session):
    automp.enable(dtype="bf16", path="eager")
    try:
        assert automp.script_failed(ValueError("the script's own bug")) is None
    finally:
        automp.disable()
