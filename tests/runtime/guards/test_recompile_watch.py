"""A compiled path that keeps recompiling after its trial goes back to the eager path it beat
(automp.runtime.guards.recompile_watch): the balance itself, then a session with an injected clock in which each compiled graph
costs seconds."""
import torch
import torch.nn as nn

from automp.runtime.decisions import FORCED, MEASURED, RECOMPILES, Route, Verdict
from automp.runtime.trial import TrialConfig
from automp.config import AutoMPConfig
from automp.runtime.guards.recompile_watch import CompileWatch, watch_for
from automp.runtime.session import Session

from tests.runtime.sessions import candidates

TIMINGS = {"automp-compiled": 20.0, "low-precision-eager": 25.0, "fp32-eager": 30.0}


def test_the_watch_falls_back_to_the_fastest_eager_path_the_verdict_measured():
    watch = watch_for(Verdict(Route.COMPILED, "trial", dict(TIMINGS), rule=MEASURED), churn=3)
    assert watch.fallback is Route.EAGER_LOW and watch.lead_ms == 5.0
    stock = watch_for(Verdict(Route.COMPILED_AUTOCAST, "trial", {"autocast-compiled": 20.0, "fp32-eager": 26.0},
                              rule=MEASURED), 3)
    assert stock.fallback is Route.FP32 and stock.lead_ms == 6.0


def test_nothing_is_watched_without_a_compiled_path_an_eager_timing_or_a_churn():
    assert watch_for(Verdict(Route.EAGER_LOW, "trial", dict(TIMINGS), rule=MEASURED), 3) is None
    assert watch_for(Verdict(Route.COMPILED, "forced by configuration", {}, rule=FORCED), 3) is None
    assert watch_for(Verdict(Route.COMPILED, "trial", {"automp-compiled": 20.0, "autocast-compiled": 21.0},
                             rule=MEASURED), 3) is None
    assert watch_for(Verdict(Route.COMPILED, "trial", dict(TIMINGS), rule=MEASURED), 0) is None


def test_the_path_is_given_up_at_the_churn_th_late_recompile_that_cost_more_than_it_saved():
    watch = CompileWatch(Route.EAGER_LOW, lead_ms=5.0, churn=3, quiet=10)
    assert not any(watch.observe(True, 10.0) for _ in range(10))  # the path settling: not counted
    assert watch.recompiles == 0
    assert not watch.observe(True, 10.0) and not watch.observe(True, 10.0)  # two late ones: a last short batch
    assert not any(watch.observe(False, 0.02) for _ in range(50))
    assert watch.observe(True, 10.0)  # 30 s of compiling against 63 x 5 ms saved
    assert watch.recompiles == 3 and watch.calls == 63


def test_a_lead_that_paid_for_its_recompiles_keeps_the_path():
    watch = CompileWatch(Route.EAGER_LOW, lead_ms=5.0, churn=3, quiet=10)
    assert not any(watch.observe(i % 100 == 50, 0.1) for i in range(1000))  # 10 recompiles, 1 s against 5 s saved
    assert watch.recompiles == 10


class Churning(nn.Module):
    """A model whose graph depends on a Python number the test changes: each change recompiles (Dynamo specializes a
    module's int attributes), as a detector's data-dependent frames do when training moves its proposals."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.k = nn.Linear(16, 32), nn.Linear(32, 4), 1

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * self.k)


QUIET = 10  # CompileWatch.quiet


def _train(monkeypatch, churn: tuple[int, int] | None, per_graph_s: float, calls: int = 50):
    """A trial that compiled graphs win (injected clock), then `calls` training calls; churn=(a, b): the calls a to b-1
    after the verdict change the model's number (Dynamo stops recompiling a frame after 8). Each compiled graph
    advances the clock by per_graph_s.
    The paths each call ran, the report, and the first call that ran the verdict's path."""
    cost = {Route.FP32: 0.030, Route.EAGER_LOW: 0.025, Route.COMPILED: 0.020}
    now = [0.0]
    holder: list[Session] = []

    def clock() -> float:
        return now[0] + per_graph_s * sum(r.graphs for r in holder[0].roots.values())

    session = Session(AutoMPConfig(dtype="bf16", inner="eager", spec="h100"),
                      trial_config=TrialConfig(confirm_after=0), clock=clock, candidates=candidates(cost))
    holder.append(session)
    session.install()
    torch.manual_seed(0)
    net, x = Churning(), torch.randn(8, 16)
    ran, settled_at = [], None
    try:
        for i in range(calls):
            root = session.roots.get(net)
            if churn is not None and settled_at is not None and churn[0] <= i - settled_at < churn[1]:
                net.k += 1
            out = net(x)
            root = session.roots[net]
            path = root.trial.current if root.path is None else root.path
            if settled_at is None and root.path is not None:
                settled_at = i
            ran.append(path)
            now[0] += cost[path]
            out.sum().backward()
    finally:
        report = session.uninstall()
    return ran, report, settled_at


def test_a_compiled_path_that_keeps_recompiling_goes_eager_and_the_next_run_starts_there(monkeypatch, fresh_session):
    ran, report, first = _train(monkeypatch, churn=(QUIET, 10**6), per_graph_s=5.0)
    assert ran[first] is Route.COMPILED and ran[-1] is Route.EAGER_LOW
    gave_up = first + ran[first:].index(Route.EAGER_LOW)
    assert QUIET < gave_up - first <= QUIET + 3  # at the third recompile after the quiet calls
    (choice,) = report["choices"]
    assert choice["path"] == Route.EAGER_LOW.value
    assert choice["rule"] == RECOMPILES
    torch._dynamo.reset()
    ran2, report2, _ = _train(monkeypatch, churn=None, per_graph_s=5.0, calls=5)
    assert set(ran2) == {Route.EAGER_LOW} and report2["choices"][0]["cached"]  # no trial, no compile
    assert not report2.get("compiles")


def test_a_compiled_path_that_stops_recompiling_or_whose_lead_pays_stays_compiled(monkeypatch, fresh_session):
    ran, report, _ = _train(monkeypatch, churn=None, per_graph_s=5.0)
    assert ran[-10:] == [Route.COMPILED] * 10 and report["choices"][0]["path"] == Route.COMPILED.value
    torch._dynamo.reset()
    ran, report, _ = _train(monkeypatch, churn=(QUIET, 10**6), per_graph_s=1e-4)
    assert ran[-1] is Route.COMPILED and report["choices"][0]["path"] == Route.COMPILED.value
    assert report["compiles"]["Churning"] >= 5  # it did recompile: the lead paid for it


def test_recompiles_while_the_path_settles_do_not_move_it(monkeypatch, fresh_session):
    """A second and third input shape, and more, in the first calls after the verdict: the path settling."""
    ran, report, first = _train(monkeypatch, churn=(1, QUIET - 1), per_graph_s=5.0)
    assert ran[-1] is Route.COMPILED and report["choices"][0]["path"] == Route.COMPILED.value
    assert report["compiles"]["Churning"] >= QUIET - 2


def test_a_ddp_modules_path_is_not_watched_every_rank_must_run_the_same_one(fresh_session):
    """A rank's own compile times are not a verdict the ranks share (choose.agreed): no watch on lockstep roots."""
    from automp.runtime.paths import Root

    session = Session(AutoMPConfig(dtype="bf16", inner="eager", spec="h100"))
    verdict = Verdict(Route.COMPILED, "trial", dict(TIMINGS), rule=MEASURED)
    alone = Root("Net", torch.device("cpu"), torch.bfloat16)
    ranked = Root("DistributedDataParallel", torch.device("cpu"), torch.bfloat16, lockstep=True)
    for root in (alone, ranked):
        session.paths.decide(root, verdict)
    assert alone.watch is not None and alone.watch.fallback is Route.EAGER_LOW
    assert ranked.watch is None
