"""A trial's verdict re-measured in steady state (trial.confirmation), driven through a session with an injected
clock: the switch, the cache, a script that ends first, a GAN's two modules."""
import torch
import torch.nn as nn

from automp.runtime.decisions import MEASURED, REMEASURED, Route
from automp.runtime.trial import TrialConfig
from automp.config import AutoMPConfig
from automp.runtime.session import Session

from .sessions import candidates


def _clocked_session(now: list[float], paths, **trial) -> Session:
    """An installed session whose trials of `paths` read `now[0]` as their clock (TrialConfig fields as
    keywords)."""
    session = Session(AutoMPConfig(dtype="bf16", inner="eager", spec="h100"), trial_config=TrialConfig(**trial),
                      clock=lambda: now[0], candidates=candidates(paths))
    session.install()
    return session


def test_a_verdict_is_re_measured_in_steady_state_and_the_cache_keeps_the_confirmed_one(monkeypatch, fresh_session):
    """The eager paths are slow in the script's first iterations (the trial) and fast afterwards: the trial chooses
    the compiled graphs, the confirmation puts the module on the eager path, and a second run starts there with
    nothing left to measure."""
    cold = {Route.FP32: 0.030, Route.EAGER_LOW: 0.025, Route.COMPILED: 0.020}
    steady = {Route.FP32: 0.030, Route.EAGER_LOW: 0.012, Route.COMPILED: 0.020}

    def run(calls: int):
        now = [0.0]
        session = _clocked_session(now, cold, confirm_within=0.3)
        torch.manual_seed(0)
        net, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16)
        ran, settled_at = [], None
        try:
            for i in range(calls):
                out = net(x)
                root = session.roots[net]
                path = root.trial.current if root.path is None else (
                    root.confirm.current if root.confirm else root.path)
                ran.append(path)
                now[0] += (steady if root.path is not None else cold)[path]
                out.sum().backward()
                if settled_at is None and session.settled():
                    settled_at = i
        finally:
            report = session.uninstall()
        return ran, settled_at, report

    ran, settled_at, report = run(120)
    (choice,) = report["choices"]
    assert choice["path"] == Route.EAGER_LOW.value and choice["confirmed"] and not choice["cached"]
    assert choice["rule"] == REMEASURED
    first_eager = ran.index(Route.COMPILED) + ran[ran.index(Route.COMPILED):].index(Route.EAGER_LOW)
    assert ran[-1] is Route.EAGER_LOW and settled_at is not None and settled_at > first_eager
    ran2, settled2, report2 = run(5)  # the cached verdict is the confirmed one: no trial, no re-measurement
    assert set(ran2) == {Route.EAGER_LOW} and settled2 == 0 and report2["choices"][0]["cached"]


def test_a_script_that_ends_before_the_re_measurement_keeps_the_trials_verdict(monkeypatch, fresh_session):
    cost = {Route.FP32: 0.024, Route.EAGER_LOW: 0.020}  # FP32 within 25%: it is to be re-measured
    now = [0.0]
    session = _clocked_session(now, cost)
    net, x = nn.Linear(16, 4), torch.randn(8, 16)
    try:
        while session.roots.get(net) is None or session.roots[net].path is None:
            net(x).sum().backward()
            root = session.roots[net]
            now[0] += cost[root.trial.current if root.path is None else root.path]
        assert not session.settled() and session.roots[net].confirm is not None
    finally:
        report = session.uninstall()
    (choice,) = report["choices"]
    assert choice["path"] == Route.EAGER_LOW.value and not choice["confirmed"] and choice["rule"] == MEASURED
    assert choice["confirm_unfinished"]  # its re-measurement was due: the script ended first


def test_a_generator_and_discriminator_are_re_measured_together(monkeypatch, fresh_session, tmp_path):
    """Two roots that shared a trial share its re-measurement, and so do their cached verdicts in the next run:
    every iteration runs one path for both, so each timed interval measures one path."""
    cold = {Route.FP32: 0.030, Route.EAGER_LOW: 0.020}
    steady = {Route.FP32: 0.010, Route.EAGER_LOW: 0.020}  # FP32 is faster once warm

    def run(n: int):
        now = [0.0]
        session = _clocked_session(now, cold, confirm_within=0.6)
        torch.manual_seed(0)
        g, d = nn.Linear(8, 16), nn.Linear(16, 1)
        calls = []  # the path each call of this iteration ran on
        real_run = session._run
        monkeypatch.setattr(session, "_run", lambda module, root, path, a, k: calls.append(path) or real_run(
            module, root, path, a, k))
        iterations = []
        try:
            for _ in range(n):
                calls.clear()
                fake = g(torch.randn(4, 8))  # the DCGAN pattern: D on the detached fake, then on the fake
                out = d(fake.detach()).sum() + d(fake).sum()
                iterations.append(set(calls))
                now[0] += (steady if session.roots[g].path is not None else cold)[calls[0]]
                out.backward()
        finally:
            report = session.uninstall()
        assert all(len(paths) == 1 for paths in iterations)  # one path per iteration, through every switch
        return iterations, report

    iterations, report = run(120)
    assert {Route.FP32} in iterations and {Route.EAGER_LOW} in iterations
    assert [c["path"] for c in report["choices"]] == [Route.FP32.value] * 2
    assert all(c["confirmed"] and c["rule"] == REMEASURED for c in report["choices"])
    # a run that ends after its trial but before the re-measurement caches unconfirmed verdicts ...
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "second"))
    _, report = run(25)
    assert [(c["path"], c["confirmed"]) for c in report["choices"]] == [(Route.EAGER_LOW.value, False)] * 2
    # ... which the next run re-measures, both modules in one re-measurement
    iterations, report = run(80)
    assert [(c["path"], c["confirmed"]) for c in report["choices"]] == [(Route.FP32.value, True)] * 2
    assert iterations[0] == {Route.EAGER_LOW} and iterations[-1] == {Route.FP32}
