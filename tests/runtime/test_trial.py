"""The measure-and-choose trial with an injected clock: which path wins, when losers are dropped, how the timed
module is picked, and the re-measurement in steady state (the verdict cache: test_verdict_cache.py)."""
import pytest
import torch

from automp.runtime.decisions import (ANCHOR_KEPT, AS_WRITTEN, CONFIRMED, FORCED, MEASURED, ONLY_LEFT,
                                      RECORD_LAST, REMEASURED, Route, Verdict)
from automp.runtime.starts import candidate_paths
from automp.runtime.trial import Trial, TrialConfig


class FakeClock:
    """Advances by the cost of the path that ran since the last tick: the trial sees exactly those costs.
    Subclasses change `seconds` (compilation, drift)."""

    def __init__(self, cost: dict[Route, float]):
        self.cost, self.now, self.steps = cost, 0.0, 0

    def __call__(self) -> float:
        return self.now

    def seconds(self, trial: Trial) -> float:
        return self.cost[trial.current]

    def run(self, trial: Trial, member: int = 1) -> None:
        trial.tick(member)
        self.now += self.seconds(trial)
        self.steps += 1


def run_until_verdict(cost: dict[Route, float], config: TrialConfig | None = None, limit: int = 100,
                      clock: FakeClock | None = None, order: list[Route] | None = None, later=()):
    clock = clock or FakeClock(cost)
    trial = Trial(order or list(cost), config or TrialConfig(), clock, lambda: None, later=later)
    ran: list[Route] = []
    for _ in range(limit):
        if trial.verdict is not None:
            break
        ran.append(trial.current)
        clock.run(trial)
    return trial, ran


def iterations(cost, config=None, order=None):
    """The path each iteration of a trial with RECORD_LAST ran, as a session runs it (the path after the tick)."""
    clock = FakeClock(cost)
    trial = Trial(order or list(cost), config or TrialConfig(), clock, lambda: None, later=RECORD_LAST)
    ran = []
    while trial.verdict is None and len(ran) < 100:
        clock.run(trial)
        ran.append(trial.current)
    return trial, ran[:-1]  # the last: the verdict's path, after the trial


def test_fastest_path_wins_and_timings_are_the_measured_ones():
    cost = {Route.EAGER_LOW: 0.010, Route.COMPILED: 0.007, Route.FP32: 0.012}
    trial, _ = run_until_verdict(cost, TrialConfig(give_up=10.0))
    assert trial.verdict.path is Route.COMPILED
    assert trial.verdict.timings_ms == pytest.approx({p.value: 1e3 * c for p, c in cost.items()})


def test_warmup_iterations_are_not_timed():
    # the compiled path's first iterations include compilation: if they were timed, FP32 would win
    class Compiling(FakeClock):
        def seconds(self, trial):
            first = trial.current is Route.COMPILED and self.steps < 2  # the compiled path's first two iterations
            return 5.0 if first else self.cost[trial.current]

    cost = {Route.COMPILED: 0.005, Route.FP32: 0.010}
    trial, _ = run_until_verdict(cost, TrialConfig(give_up=100.0), clock=Compiling(cost))
    assert trial.verdict.path is Route.COMPILED
    assert max(trial.samples[Route.COMPILED]) == pytest.approx(0.005)


class OneOff(FakeClock):
    """`path`'s `nth` iteration, its first timed one, takes 1.8x its others (a compiled path's, seen on an H100)."""

    def __init__(self, cost: dict[Route, float], path: Route, nth: int):
        super().__init__(cost)
        self.path, self.nth, self.runs = path, nth, 0

    def seconds(self, trial):
        c = self.cost[trial.current]
        if trial.current is self.path:
            self.runs += 1
            if self.runs == self.nth:
                return 1.8 * c
        return c


def test_a_one_off_slow_first_sample_does_not_drop_the_fastest_path():
    cost = {Route.EAGER_LOW: 0.0375, Route.COMPILED: 0.031, Route.FP32: 0.145}
    trial, _ = run_until_verdict(cost, TrialConfig(warmup={Route.EAGER_LOW: 1, Route.COMPILED: 1, Route.FP32: 1},
                                                   block=1),  # a sample of one iteration: the one-off undiluted
                                 clock=OneOff(cost, Route.COMPILED, 2),  # after its one warm-up iteration
                                 order=[Route.EAGER_LOW, Route.COMPILED, Route.FP32])
    assert max(trial.samples[Route.COMPILED]) == pytest.approx(1.8 * 0.031)  # the one-off was timed
    assert trial.verdict.path is Route.COMPILED and Route.COMPILED not in trial.abandoned
    assert Route.FP32 in trial.abandoned and len(trial.samples[Route.FP32]) == 1  # 3.9x: dropped after one round


def test_a_clear_loser_is_dropped_after_one_round():
    cost = {Route.EAGER_LOW: 0.010, Route.FP32: 0.050}
    config = TrialConfig(measure=5, give_up=1.3)
    trial, ran = run_until_verdict(cost, config)
    assert trial.verdict.path is Route.EAGER_LOW
    assert len(trial.samples[Route.FP32]) == 1 and Route.FP32 in trial.abandoned
    assert ran.count(Route.FP32) == 1 + config.block  # one warm-up, one timed sample


class Pipelined(FakeClock):
    """Each path has host and device seconds per iteration. Right after a sync the device waits for the host:
    the iteration costs both; back to back they overlap and it costs the larger (a training loop's steady state)."""

    def __init__(self, host: dict[Route, float], device: dict[Route, float]):
        super().__init__({p: max(host[p], device[p]) for p in host})
        self.host, self.device, self.synced, self.syncs = host, device, True, 0

    def sync(self) -> None:
        self.synced, self.syncs = True, self.syncs + 1

    def seconds(self, trial: Trial) -> float:
        p = trial.current
        cost = self.host[p] + self.device[p] if self.synced else self.cost[p]
        self.synced = False
        return cost


def test_a_sample_runs_its_iterations_back_to_back_as_the_script_will():
    # eager: launch-bound (9 ms host, 1 ms device); compiled: 2 ms host, 8 ms device. One synchronized iteration
    # costs 10 ms on both, so a trial of single synchronized iterations cannot tell them apart; back to back the
    # compiled path is 8 ms and eager 9 ms, and the trial's samples of two iterations see it.
    host, device = {Route.EAGER_LOW: 0.009, Route.COMPILED: 0.002}, {Route.EAGER_LOW: 0.001, Route.COMPILED: 0.008}
    outcomes = {}
    for block in (1, 2, 4):
        clock = Pipelined(host, device)
        trial = Trial([Route.EAGER_LOW, Route.COMPILED], TrialConfig(give_up=10.0, block=block), clock, clock.sync)
        ticks = 0
        while trial.verdict is None and ticks < 200:
            clock.run(trial)
            ticks += 1
        outcomes[block] = trial.verdict.timings_ms
        # synchronized once per warm-up or sample (plus the first call), never inside a sample
        samples = sum(len(s) for s in trial.samples.values())
        assert clock.syncs == 1 + samples + len(trial.candidates)
    assert outcomes[1][Route.COMPILED.value] == pytest.approx(outcomes[1][Route.EAGER_LOW.value])
    for block in (2, 4):  # (first iteration synchronized + the rest overlapped) / block
        assert outcomes[block][Route.COMPILED.value] == pytest.approx((10 + 8 * (block - 1)) / block)
        assert outcomes[block][Route.EAGER_LOW.value] == pytest.approx((10 + 9 * (block - 1)) / block)


def test_candidates_alternate_so_drift_hits_all_of_them():
    # the machine slows down steadily; interleaved rounds keep the truly faster path ahead
    class Drifting(FakeClock):
        def seconds(self, trial):
            return self.cost[trial.current] * (1 + 0.02 * self.steps)

    cost = {Route.EAGER_LOW: 0.010, Route.FP32: 0.0101}
    trial, _ = run_until_verdict(cost, TrialConfig(give_up=100.0, fp32_margin=0.0), clock=Drifting(cost),
                                 order=[Route.FP32, Route.EAGER_LOW])
    assert trial.verdict.path is Route.EAGER_LOW


def test_interval_is_timed_on_the_module_called_every_iteration():
    # module 7 is called once (say, a warm-up forward of a teacher); module 1 every iteration: after a few calls of
    # module 1 without module 7 the trial times module 1 and still reaches a verdict
    clock = FakeClock({Route.EAGER_LOW: 0.01, Route.FP32: 0.02})
    trial = Trial([Route.EAGER_LOW, Route.FP32], TrialConfig(), clock, lambda: None)
    trial.tick(7)
    for _ in range(60):
        if trial.verdict:
            break
        clock.run(trial, member=1)
    assert trial.verdict is not None and trial.verdict.path is Route.EAGER_LOW


@pytest.mark.parametrize("contender", [Route.COMPILED, Route.GRAPHED])
@pytest.mark.parametrize("lead, kept", [(0.01, True), (0.10, False)])
def test_a_compiled_contender_must_beat_the_hand_written_path_by_more_than_the_noise(contender, lead, kept):
    # automp's own pass, or the same graphs replayed as CUDA graphs (a memory pool and fixed addresses): each is worth
    # it only where it clearly takes time away from autocast-compiled
    cost = {contender: 0.100, Route.COMPILED_AUTOCAST: 0.100 * (1 + lead), Route.EAGER_LOW: 0.2}
    trial, _ = run_until_verdict(cost)
    assert trial.verdict.path is (Route.COMPILED_AUTOCAST if kept else contender)
    assert trial.verdict.rule == (ANCHOR_KEPT if kept else MEASURED)
    assert trial.verdict.timings_ms[contender.value] == pytest.approx(100.0)  # the measured timings, unchanged


def test_cuda_graphs_are_a_candidate_on_cuda_only():
    assert Route.GRAPHED in candidate_paths("cuda", 10.0, "bf16")[0]
    assert Route.GRAPHED not in candidate_paths("cpu", 10.0, "bf16")[0]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_gemm_rate_in_the_reason_says_which_way_it_goes(device):
    """The calibrated gain is low precision's GEMM rate over FP32's: above 1 its GEMMs are faster, below 1 slower.
    "measured 10.8x FP32" read either way; the words say the direction."""
    paths, why = candidate_paths(device, 0.25, "bfloat16")  # a quarter of FP32's rate: 4x slower
    assert paths == [Route.FP32]
    assert "bfloat16 GEMMs took 4.0x as long as FP32" in why and "GEMMs ran" not in why and "0.25x" not in why
    paths, why = candidate_paths(device, 10.8, "bfloat16")
    assert Route.EAGER_LOW in paths
    assert "bfloat16 GEMMs ran 10.8x as fast as FP32" in why and "took" not in why
    assert "ran 1.1x as fast as FP32" in candidate_paths(device, 1.1, "bfloat16")[1]  # faster, but not enough
    assert "not measured" in candidate_paths(device, 0.0, "bfloat16")[1]


@pytest.mark.parametrize("lead, chosen", [(0.02, Route.FP32), (0.10, Route.EAGER_LOW)])
def test_another_path_must_beat_the_script_as_written_by_more_than_the_noise(lead, chosen):
    # a 2% lead on a shared CPU became 0.92x of FP32 in steady state (automp demo): the script as written is kept
    cost = {Route.FP32: 0.100 * (1 + lead), Route.EAGER_LOW: 0.100}
    trial, _ = run_until_verdict(cost)
    assert trial.verdict.path is chosen
    assert trial.verdict.rule == (AS_WRITTEN if chosen is Route.FP32 else MEASURED)


def test_the_anchor_rule_and_the_fp32_rule_compose():
    # automp-compiled leads the anchor by 1% (anchor kept), and the anchor leads FP32 by 2%: FP32 is kept
    cost = {Route.COMPILED: 0.100, Route.COMPILED_AUTOCAST: 0.101, Route.FP32: 0.103}
    trial, _ = run_until_verdict(cost)
    assert trial.verdict.path is Route.FP32


def test_a_verdict_is_re_measured_only_against_eager_paths_that_came_close():
    from automp.runtime.trial import confirmation
    timings = {Route.COMPILED.value: 100.0, Route.EAGER_LOW.value: 120.0, Route.FP32.value: 140.0,
               Route.COMPILED_AUTOCAST.value: 101.0}
    config = TrialConfig()  # confirm_within 25%: low precision eager is re-measured, FP32 (40% slower) is not
    measured = Verdict(Route.COMPILED, "trial", timings, rule=MEASURED)
    trial = confirmation(measured, config, lambda: 0.0, lambda: None)
    assert trial.candidates == [Route.COMPILED, Route.EAGER_LOW] and trial.incumbent is Route.COMPILED
    assert trial.current is Route.COMPILED  # the verdict's path runs on first, untimed, for confirm_after iterations
    wide = TrialConfig(confirm_within=0.5)
    assert confirmation(measured, wide, lambda: 0.0, lambda: None).candidates == [
        Route.COMPILED, Route.FP32, Route.EAGER_LOW]
    for verdict, cfg in [(Verdict(Route.FP32, "", timings, rule=MEASURED), config),  # as written: nothing to guard
                         (Verdict(Route.COMPILED, "", timings, rule=MEASURED, confirmed=True), config),  # done once
                         (Verdict(Route.COMPILED, "forced", {}, rule=FORCED), config),  # never timed
                         (measured, TrialConfig(confirm_after=0)),  # switched off
                         (measured, TrialConfig(confirm_within=0.1))]:  # none close
        assert confirmation(verdict, cfg, lambda: 0.0, lambda: None) is None


def run_confirmation(trial_cost: dict[Route, float], steady_cost: dict[Route, float], config: TrialConfig):
    """A trial under `trial_cost` (the script's first iterations), then its confirmation under `steady_cost`."""
    from automp.runtime.trial import confirmation
    trial, _ = run_until_verdict(trial_cost, config)
    clock = FakeClock(steady_cost)
    again = confirmation(trial.verdict, config, clock, lambda: None)
    ran = []
    while again is not None and again.verdict is None and len(ran) < 200:
        ran.append(again.current)
        clock.run(again)
    return trial.verdict, again, ran


def test_the_confirmation_replaces_a_verdict_the_cold_start_misled():
    # Faster R-CNN on an H100: in the trial both eager paths measured 130 ms against the compiled graphs' 113 ms;
    # afterwards the eager loops ran about 100 ms. Re-measured in steady state, the eager path wins.
    config = TrialConfig()
    first, again, ran = run_confirmation(
        {Route.COMPILED: 0.113, Route.EAGER_LOW: 0.130, Route.FP32: 0.131, Route.COMPILED_AUTOCAST: 0.140},
        {Route.COMPILED: 0.115, Route.EAGER_LOW: 0.098, Route.FP32: 0.107, Route.COMPILED_AUTOCAST: 0.115}, config)
    assert first.path is Route.COMPILED and not first.confirmed and first.rule == MEASURED
    assert ran[:config.confirm_after] == [Route.COMPILED] * config.confirm_after  # steady state before timing
    assert again.verdict.path is Route.EAGER_LOW and again.verdict.confirmed
    assert again.verdict.rule == REMEASURED
    assert again.verdict.timings_ms[Route.EAGER_LOW.value] == pytest.approx(98.0)


@pytest.mark.parametrize("lead, chosen", [(0.01, Route.COMPILED), (0.10, Route.EAGER_LOW)])
def test_the_confirmation_keeps_its_incumbent_within_the_noise(lead, chosen):
    steady = {Route.COMPILED: 0.100 * (1 + lead), Route.EAGER_LOW: 0.100, Route.FP32: 0.2, Route.COMPILED_AUTOCAST: 0.2}
    _, again, _ = run_confirmation({Route.COMPILED: 0.100, Route.EAGER_LOW: 0.110, Route.FP32: 0.2,
                                    Route.COMPILED_AUTOCAST: 0.2}, steady, TrialConfig())
    assert again.verdict.path is chosen and again.verdict.confirmed
    assert again.verdict.rule == (CONFIRMED if chosen is Route.COMPILED else REMEASURED)


def test_the_confirmation_gives_the_script_back_when_its_lead_over_fp32_is_noise():
    steady = {Route.EAGER_LOW: 0.100, Route.FP32: 0.102}
    _, again, _ = run_confirmation({Route.EAGER_LOW: 0.100, Route.FP32: 0.120}, steady, TrialConfig())
    assert again.verdict.path is Route.FP32 and again.verdict.rule == AS_WRITTEN


def test_a_trial_goes_on_without_the_paths_it_excludes():
    cost = {Route.EAGER_LOW: 0.020, Route.COMPILED: 0.010, Route.FP32: 0.030}
    clock = FakeClock(cost)
    trial = Trial(list(cost), TrialConfig(give_up=10.0), clock, lambda: None)
    while trial.current is not Route.COMPILED:  # into the compiled path's warm-up
        clock.run(trial)
    clock.run(trial)
    trial.exclude({Route.COMPILED, Route.COMPILED_AUTOCAST}, "test: no compile")
    assert trial.current is not Route.COMPILED and Route.COMPILED not in trial.alive
    ran = []
    while trial.verdict is None and len(ran) < 100:
        ran.append(trial.current)
        clock.run(trial)
    assert Route.COMPILED not in ran and trial.verdict.path is Route.EAGER_LOW
    assert Route.COMPILED.value not in trial.verdict.timings_ms and "test: no compile" in trial.verdict.reason
    assert trial.verdict.timings_ms[Route.EAGER_LOW.value] == pytest.approx(20.0)  # no interval spans the switch
    with pytest.raises(ValueError, match="all of its candidates"):
        Trial([Route.COMPILED], TrialConfig(), clock, lambda: None).exclude({Route.COMPILED}, "x")
    alone = Trial([Route.EAGER_LOW, Route.COMPILED], TrialConfig(), clock, lambda: None)
    while alone.current is not Route.COMPILED:  # low precision eager warmed up, nothing timed yet
        clock.run(alone)
    alone.exclude({Route.COMPILED}, "test: no compile")  # one candidate left, never timed
    assert alone.verdict.path is Route.EAGER_LOW and alone.verdict.rule == ONLY_LEFT


def test_evaluation_calls_inside_a_training_loop_are_not_iterations():
    # every third iteration the script evaluates: five calls without grad, cheap and path-independent here; counted
    # as iterations they would make every sample that holds them look fast (the old behaviour: medians ~half)
    cost = {Route.EAGER_LOW: 0.020, Route.FP32: 0.030}
    clock = FakeClock(cost)
    trial = Trial(list(cost), TrialConfig(give_up=10.0, fp32_margin=0.0), clock, lambda: None)
    for i in range(200):
        if trial.verdict is not None:
            break
        clock.run(trial)  # a training iteration
        if i % 3 == 2:
            for _ in range(5):
                trial.tick(1, training=False)
    assert trial.verdict.timings_ms == pytest.approx({p.value: 1e3 * c for p, c in cost.items()})


def test_a_script_that_never_trains_has_its_inference_calls_timed():
    cost = {Route.EAGER_LOW: 0.020, Route.FP32: 0.030}
    clock = FakeClock(cost)
    trial = Trial(list(cost), TrialConfig(), clock, lambda: None)
    for _ in range(100):
        if trial.verdict is not None:
            break
        trial.tick(1, training=False)
        clock.now += cost[trial.current]
    assert trial.verdict is not None and trial.verdict.path is Route.EAGER_LOW


# the zoo's ResNet-50 on an H100 (one trial's timings): FP32 eager is 5x the compiled paths
RESNET = {Route.EAGER_LOW: 0.0347, Route.COMPILED: 0.0300, Route.COMPILED_AUTOCAST: 0.0304, Route.GRAPHED: 0.0245,
          Route.FP32: 0.150}


def test_cuda_graphs_are_recorded_after_the_first_round_has_dropped_fp32():
    """RECORD_LAST: the graphs' pool must not sit beside FP32 eager's activations. FP32 is timed and dropped before
    autocast-graphed's recording (its second iteration; the first, the graph trees' warm-up, runs before everything:
    TrialConfig.early_warmup), and autocast-graphed still wins on the samples it got."""
    trial, ran = iterations(RESNET)
    recording = ran.index(Route.GRAPHED, 1)
    assert Route.FP32 in ran[:recording] and Route.FP32 not in ran[recording:]
    assert Route.FP32 in trial.abandoned and len(trial.samples[Route.FP32]) == 1
    assert trial.verdict.path is Route.GRAPHED
    assert len(trial.samples[Route.GRAPHED]) == TrialConfig().measure - 1  # timed from the second round on
    assert trial.verdict.timings_ms[Route.GRAPHED.value] == pytest.approx(24.5)


# the zoo's T5-small: FP32 eager is 2x the fastest compiled path, inside the compiled paths' first-sample margin
T5 = {Route.EAGER_LOW: 0.040, Route.COMPILED: 0.030, Route.COMPILED_AUTOCAST: 0.031, Route.GRAPHED: 0.016, Route.FP32: 0.060}


def test_an_eager_loser_is_dropped_by_the_later_rounds_margin_before_the_graphs_are_recorded():
    """An eager path compiles nothing, so its first sample is not a one-off: with CUDA graphs to be recorded after
    round 1, 2x the best drops it then, before the graph pool exists (T5's trial had reserved 7.1 GiB beside FP32's
    4.7). A compiled path at 1.8x the best on its first sample stays: its first timed iteration can be that slow.
    Without graphs to come, the eager path keeps the first round's wider margin too."""
    trial, ran = iterations(T5)
    assert Route.FP32 in trial.abandoned and len(trial.samples[Route.FP32]) == 1
    assert Route.FP32 not in ran[ran.index(Route.GRAPHED, 1):]  # after the first (early warm-up) iteration
    assert Route.EAGER_LOW in trial.abandoned and len(trial.samples[Route.EAGER_LOW]) == 1  # 1.33x > give_up 1.3
    assert trial.verdict.path is Route.GRAPHED
    unrecorded = {p: c for p, c in T5.items() if p is not Route.GRAPHED}
    clock = OneOff(unrecorded, Route.COMPILED, 3)  # its first timed iteration after two warm-up ones
    trial, _ = run_until_verdict(unrecorded, TrialConfig(block=1), clock=clock)
    assert max(trial.samples[Route.COMPILED]) == pytest.approx(1.8 * 0.030)
    assert len(trial.samples[Route.COMPILED]) > 1 and trial.verdict.path is Route.COMPILED
    assert Route.FP32 in trial.abandoned and len(trial.samples[Route.FP32]) == 2  # dropped after round 2, not 1


def test_a_later_paths_first_warmup_iteration_runs_before_every_other_candidate():
    """The graph trees' warm-up run while the process holds the least (TrialConfig.early_warmup): the graphed path's
    first iteration comes first, the rest of its warm-up (recording) after the first round, its warm-up as long as
    before in all; a path with one warm-up iteration, or early_warmup 0 (the default), keeps all of it for later."""
    order = [Route.COMPILED_AUTOCAST, Route.EAGER_LOW, Route.GRAPHED, Route.FP32]
    early = TrialConfig(early_warmup=1)
    trial, ran = iterations(RESNET, early, order)
    warmup = TrialConfig().warmup[Route.GRAPHED]
    graphed = [i for i, p in enumerate(ran) if p is Route.GRAPHED]
    assert graphed[0] == 0 and ran[1] is Route.COMPILED_AUTOCAST
    first_round_end = max(i for i, p in enumerate(ran) if p is Route.FP32)
    assert all(i > first_round_end for i in graphed[1:warmup])  # recorded after the first round, as before
    samples = trial.samples[Route.GRAPHED]  # then timed; its warm-up as long as before in all
    assert samples and len(graphed) == warmup + TrialConfig().block * len(samples)
    _, late = iterations(RESNET, TrialConfig(), order)
    assert late[0] is Route.COMPILED_AUTOCAST and late.index(Route.GRAPHED) > late.index(Route.FP32)
    one = {**TrialConfig().warmup, Route.GRAPHED: 1}
    _, once = iterations(RESNET, TrialConfig(warmup=one, early_warmup=1), order)
    assert once[0] is Route.COMPILED_AUTOCAST and once.count(Route.GRAPHED) == len(graphed) - warmup + 1


def test_without_later_the_graphs_are_recorded_before_fp32_is_timed():
    """The same trial without `later`: what RECORD_LAST changes (FP32 runs after the graphs were recorded)."""
    _, ran = run_until_verdict(RESNET)
    assert Route.FP32 in ran[ran.index(Route.GRAPHED):]


def test_a_later_candidate_with_a_slow_first_sample_is_judged_by_the_first_rounds_margin():
    """Its first sample comes in the second round, where the others are judged by give_up: a one-off slow first
    sample (1.4-1.8x on an H100) must not drop it."""
    clock = OneOff(RESNET, Route.GRAPHED, 4)  # after its three warm-up iterations
    trial, _ = run_until_verdict(RESNET, TrialConfig(block=1), clock=clock, later=RECORD_LAST)
    assert max(trial.samples[Route.GRAPHED]) == pytest.approx(1.8 * 0.0245)
    assert trial.verdict.path is Route.GRAPHED and Route.GRAPHED not in trial.abandoned


def test_a_later_candidate_is_measured_even_when_one_round_would_decide():
    trial, ran = run_until_verdict(RESNET, TrialConfig(measure=1), later=RECORD_LAST)
    assert trial.samples[Route.GRAPHED] and trial.verdict.path is Route.GRAPHED


def test_a_trial_of_later_candidates_only_or_with_the_others_excluded_still_decides():
    trial, ran = run_until_verdict({Route.GRAPHED: 0.01}, later=RECORD_LAST)
    assert trial.verdict.path is Route.GRAPHED and set(ran) == {Route.GRAPHED} and len(ran) > 1  # warmed up, not deferred
    clock = FakeClock({Route.EAGER_LOW: 0.03, Route.GRAPHED: 0.02})
    trial = Trial([Route.EAGER_LOW, Route.GRAPHED], TrialConfig(), clock, lambda: None, later=RECORD_LAST)
    for _ in range(3):
        clock.run(trial)
    trial.exclude({Route.EAGER_LOW}, "a member cannot run it")
    for _ in range(40):
        if trial.verdict is not None:
            break
        clock.run(trial)
    assert trial.verdict is not None and trial.verdict.path is Route.GRAPHED


def test_a_calibration_not_cached_is_named_in_the_reason():
    """A calibration that failed its own sanity check serves this run only; the path decision it fed says so."""
    from automp.precision.calibrate import Calibration
    from automp.runtime.starts import CalibratedCandidates

    def calibration(doubts):
        return Calibration(device="cpu: test", torch_version=torch.__version__,
                           gemm_tflops={"float32": {"large": 1.0}, "bfloat16": {"large": 0.5}}, bandwidth_gbps=10.0,
                           launch_us=5.0, measured_at="2026-01-01T00:00:00Z", doubts=doubts)

    cpu = torch.device("cpu")
    trusted = CalibratedCandidates("/nonexistent")
    trusted.calibrations[cpu] = calibration(())
    doubted = CalibratedCandidates("/nonexistent")
    doubted.calibrations[cpu] = calibration(("the copy: the median run took 4.7x the fastest",))
    paths, why = trusted(cpu, torch.bfloat16)
    same_paths, doubted_why = doubted(cpu, torch.bfloat16)
    assert same_paths == paths and "not cached" not in why
    assert "not cached" in doubted_why and "4.7x the fastest" in doubted_why


class Device:
    """A host that issues each iteration in `host` seconds and a device that runs it in `device` seconds, queued
    behind what it still runs: the trial's sync waits for the device to finish."""

    def __init__(self, host: dict[Route, float], device: dict[Route, float]):
        self.host, self.device, self.now, self.done = host, device, 0.0, 0.0

    def __call__(self) -> float:
        return self.now

    def sync(self) -> None:
        self.now = max(self.now, self.done)

    def run(self, trial: Trial) -> None:
        trial.tick(1)
        path = trial.current
        self.done = max(self.done, self.now) + self.device[path]
        self.now += self.host[path]


@pytest.mark.parametrize("host, bound", [(0.06, True), (0.08, False)])
def test_graphs_are_judged_launch_bound_only_where_the_host_issued_every_compiled_sample_far_ahead(host, bound):
    device = {Route.COMPILED_AUTOCAST: 0.1, Route.FP32: 0.2}
    clock = Device({p: host for p in device}, device)
    trial = Trial(list(device), TrialConfig(give_up=100.0), clock, clock.sync)
    for _ in range(100):
        if trial.verdict is not None:
            break
        clock.run(trial)
    shares = trial.host_shares[Route.COMPILED_AUTOCAST]
    assert shares and max(shares) == pytest.approx(host / 0.1)  # the step's own figures, sample by sample
    assert trial.verdict.timings_ms[Route.COMPILED_AUTOCAST.value] == pytest.approx(100.0)  # device time, not host
    why = trial.launch_bound()
    assert (why is not None) == bound
    if bound:
        assert trial.bounds[Route.GRAPHED.value] == {"rule": "graphs-device-bound", "host_share": 0.6, "limit": 0.7}
        assert "the device, not the launches, sets the step's time" in why


def test_without_a_compiled_sample_graphs_are_not_judged():
    trial = Trial([Route.GRAPHED, Route.FP8_GRAPHED], TrialConfig(), lambda: 0.0, lambda: None)
    assert trial.launch_bound() is None and trial.bounds == {}


def test_the_verdict_names_the_candidate_that_raised_the_peak_memory():
    # a fake allocator: each path's iteration reaches its own high-water mark; the peak only ever rises
    held = {Route.COMPILED_AUTOCAST: 5 * 2**30, Route.EAGER_LOW: 9 * 2**30, Route.FP32: 7 * 2**30}
    cost = {Route.COMPILED_AUTOCAST: 0.010, Route.EAGER_LOW: 0.011, Route.FP32: 0.030}
    top = [2**30]
    clock = FakeClock(cost)
    trial = Trial(list(cost), TrialConfig(), clock, lambda: None, peak=lambda: top[0])
    for _ in range(100):
        if trial.verdict is not None:
            break
        clock.run(trial)  # the call: the trial's bookkeeping, then the iteration on the current path,
        top[0] = max(top[0], held[trial.current])  # which sets its mark
    # the anchor's path ran first and raised the peak to 5 GiB; eager raised it to 9; FP32's 7 never raised it
    assert trial.verdict.peaks_gib == {Route.COMPILED_AUTOCAST.value: 5.0, Route.EAGER_LOW.value: 9.0}
    assert trial.verdict.as_dict()["peaks_gib"] == trial.verdict.peaks_gib
    assert "peaks_gib" not in Verdict(Route.FP32, "", {}, rule=MEASURED).as_dict()  # off CUDA: nothing reported


def test_the_verdict_carries_each_paths_host_share_per_sample():
    host = {Route.COMPILED_AUTOCAST: 0.002, Route.EAGER_LOW: 0.006}
    device = {Route.COMPILED_AUTOCAST: 0.010, Route.EAGER_LOW: 0.008}
    clock = Device(host, device)
    trial = Trial(list(host), TrialConfig(), clock, clock.sync)
    while trial.verdict is None:
        clock.run(trial)
    shares = trial.verdict.host_shares
    assert set(shares) == {Route.COMPILED_AUTOCAST.value, Route.EAGER_LOW.value}
    assert len(shares[Route.COMPILED_AUTOCAST.value]) == len(trial.samples[Route.COMPILED_AUTOCAST])
    assert shares[Route.COMPILED_AUTOCAST.value] == pytest.approx([0.2] * len(shares[Route.COMPILED_AUTOCAST.value]))
    assert shares[Route.EAGER_LOW.value] == pytest.approx([0.75] * len(shares[Route.EAGER_LOW.value]))
