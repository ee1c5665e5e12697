"""The FP8 step against its bf16 twin in the trial (injected clock): the margin FP8 must clear, and CUDA graphs that
do not fit giving way to the same paths without them."""
import pytest

from automp.runtime.decisions import BF16_TWIN, MEASURED, TWIN_KEPT, Route, WITHOUT_GRAPHS
from automp.runtime.trial import Trial, TrialConfig
from tests.runtime.test_trial import FakeClock, run_until_verdict


@pytest.mark.parametrize("fp8_ms, wins", [(9.0, True), (9.9, False), (11.0, False)])
def test_fp8_must_beat_its_bf16_twin_by_more_than_the_margin(fp8_ms: float, wins: bool) -> None:
    """FP8 changes numerics: 1% faster than bf16 is noise (TrialConfig.anchor_margin, 3%), 10% is a gain."""
    cost = {Route.GRAPHED: 0.010, Route.FP8_GRAPHED: fp8_ms / 1e3}
    trial, _ = run_until_verdict(cost, TrialConfig(give_up=10.0), later=[Route.GRAPHED, Route.FP8_GRAPHED])
    assert trial.verdict.path is (Route.FP8_GRAPHED if wins else Route.GRAPHED)
    assert trial.verdict.rule == (TWIN_KEPT if fp8_ms == 9.9 else MEASURED)  # 11 ms: bf16 simply measured faster


def test_graphs_that_do_not_fit_give_way_to_the_same_paths_without_them() -> None:
    cost = {Route.COMPILED_AUTOCAST: 0.010, Route.FP8_COMPILED: 0.008}
    clock = FakeClock(cost)
    trial = Trial([Route.GRAPHED, Route.FP8_GRAPHED], TrialConfig(give_up=10.0), clock, lambda: None,
                  later=[Route.GRAPHED, Route.FP8_GRAPHED])
    assert trial.current is Route.GRAPHED
    trial.substitute(WITHOUT_GRAPHS, "no room for graphs")
    assert trial.candidates == [Route.COMPILED_AUTOCAST, Route.FP8_COMPILED]
    assert trial.current is Route.COMPILED_AUTOCAST
    for _ in range(100):
        if trial.verdict is not None:
            break
        clock.run(trial)
    assert trial.verdict.path is Route.FP8_COMPILED and trial.verdict.rule == MEASURED
    assert set(trial.verdict.timings_ms) == {Route.COMPILED_AUTOCAST.value, Route.FP8_COMPILED.value}


def test_a_timed_path_cannot_be_substituted() -> None:
    cost = {Route.GRAPHED: 0.010, Route.FP8_GRAPHED: 0.008}
    clock = FakeClock(cost)
    trial = Trial(list(cost), TrialConfig(give_up=10.0, measure=4), clock, lambda: None)
    while not trial.samples[Route.GRAPHED]:
        clock.run(trial)
    with pytest.raises(ValueError, match="already timed"):
        trial.substitute(WITHOUT_GRAPHS, "too late")


def test_every_fp8_path_has_a_bf16_twin_without_fp8() -> None:
    assert set(BF16_TWIN) == {Route.FP8_COMPILED, Route.FP8_GRAPHED}
    assert all("fp8" not in twin.value for twin in BF16_TWIN.values())
