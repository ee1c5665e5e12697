"""The FP8 step's bf16 twin forecast from the FP8 step's warm-up and its layers' predicted saving (TrialConfig.
twin_margin), with an injected clock: a clear forecast keeps the FP8 step without ever running the twin, a close one
times the twin as before, and every path to turning it off leaves the trial as it was."""
import math

import pytest

from automp.runtime.decisions import ONLY_LEFT, RECORD_LAST, TWIN_FORECAST, Route
from automp.runtime.ranks import for_ranks
from automp.runtime.trial import TWIN_CLOSE, Trial, TrialConfig
from tests.runtime.test_trial import FakeClock

STEP = {Route.GRAPHED: 0.130, Route.FP8_GRAPHED: 0.110}  # seconds per iteration


def run(saving_ms, config=None, cost=STEP):
    """(trial, the path each of its iterations ran) of the FP8 trial as RootPaths.start builds it; a session runs a
    call on the path current after the call's tick, and the call whose tick decides is the verdict's."""
    clock = FakeClock(cost)
    trial = Trial(list(cost), config or TrialConfig(), clock, lambda: None, later=RECORD_LAST, saving_ms=saving_ms)
    ran = []
    while trial.verdict is None and len(ran) < 100:
        clock.run(trial)
        ran.append(trial.current)
    return trial, ran[:-1]


def test_a_clear_forecast_keeps_the_fp8_step_and_never_runs_the_twin():
    trial, ran = run(saving_ms=25.0)  # forecast 110 + 25 = 135 ms: 23% slower than the FP8 step
    assert Route.GRAPHED not in ran  # never called, so never compiled and its graphs never recorded
    assert ran == [Route.FP8_GRAPHED] * (TrialConfig().warmup[Route.FP8_GRAPHED] + 1)  # its warm-up, then one alone
    assert trial.verdict.path is Route.FP8_GRAPHED and trial.verdict.rule == TWIN_FORECAST
    bound = trial.verdict.bounds[Route.GRAPHED.value]
    assert bound["rule"] == TWIN_FORECAST
    assert bound["fp8_ms"] == pytest.approx(110.0) and bound["forecast_ms"] == pytest.approx(135.0)
    assert "autocast-graphed not run" in trial.verdict.reason and "135.0 ms" in trial.verdict.reason
    assert trial.verdict.reason.endswith("fp8-graphed kept on that forecast")


@pytest.mark.parametrize("saving_ms", [5.0, 10.5])  # 4.5% and 9.5% of the FP8 step: inside the 10% margin
def test_a_close_forecast_times_the_twin_as_before(saving_ms):
    trial, ran = run(saving_ms)
    warm = TrialConfig().warmup[Route.FP8_GRAPHED] + 1
    assert ran[:warm] == [Route.FP8_GRAPHED] * warm  # the FP8 step's warm-up and forecast iteration, then the twin's
    assert ran[warm] is Route.GRAPHED and trial.samples[Route.GRAPHED] and trial.samples[Route.FP8_GRAPHED]
    assert trial.verdict.bounds[Route.GRAPHED.value]["rule"] == TWIN_CLOSE
    assert trial.verdict.path is Route.FP8_GRAPHED and trial.verdict.rule != TWIN_FORECAST


def test_the_forecast_is_judged_after_the_fp8_steps_warmup_not_on_its_compile_or_recording():
    class Compiling(FakeClock):  # the FP8 step's warm-up: a 60 s compile, then a recording at twice its step
        def seconds(self, trial):
            if trial.current is Route.FP8_GRAPHED and self.steps < TrialConfig().warmup[Route.FP8_GRAPHED]:
                return 60.0 if self.steps == 0 else 2 * self.cost[trial.current]
            return self.cost[trial.current]

    clock = Compiling(STEP)
    trial = Trial(list(STEP), TrialConfig(), clock, lambda: None, later=RECORD_LAST, saving_ms=25.0)
    while trial.verdict is None and clock.steps < 100:
        clock.run(trial)
    assert trial.verdict.bounds[Route.GRAPHED.value]["fp8_ms"] == pytest.approx(110.0)
    assert trial.verdict.rule == TWIN_FORECAST


@pytest.mark.parametrize("how", ["no saving", "margin inf", "distributed"])
def test_without_a_forecast_the_trial_runs_as_before(how, monkeypatch):
    config = TrialConfig()
    saving = 25.0
    if how == "no saving":
        saving = None
    elif how == "margin inf":
        config = TrialConfig(twin_margin=math.inf)
    else:
        monkeypatch.setattr("automp.runtime.ranks.distributed", lambda: True)
        config = for_ranks(config)
    trial, ran = run(saving, config)
    assert ran[0] is Route.GRAPHED  # the candidates' own order: the twin's warm-up first
    assert Route.GRAPHED.value not in trial.verdict.bounds and trial.samples[Route.GRAPHED]


def test_a_trial_without_an_fp8_twin_pair_ignores_the_saving():
    cost = {Route.COMPILED_AUTOCAST: 0.010, Route.EAGER_LOW: 0.020}
    trial, ran = run(25.0, cost=cost)
    assert trial.verdict.path is Route.COMPILED_AUTOCAST and not trial.verdict.bounds
    assert trial.verdict.rule != ONLY_LEFT
