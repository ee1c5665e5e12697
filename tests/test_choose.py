"""The measure-and-choose trial with an injected clock: which path wins, when losers are dropped, how the timed
module is picked, and the verdict cache (write, read, corrupt file)."""
import json

import pytest
import torch.nn as nn

from automp.choose import Path, Trial, TrialConfig, Verdict, VerdictCache, module_key


class FakeClock:
    """Advances by the cost of the path that ran since the last tick: the trial sees exactly those costs.
    Subclasses change `seconds` (compilation, drift)."""

    def __init__(self, cost: dict[Path, float]):
        self.cost, self.now, self.steps = cost, 0.0, 0

    def __call__(self) -> float:
        return self.now

    def seconds(self, trial: Trial) -> float:
        return self.cost[trial.current]

    def run(self, trial: Trial, member: int = 1) -> None:
        trial.tick(member)
        self.now += self.seconds(trial)
        self.steps += 1


def run_until_verdict(cost: dict[Path, float], config: TrialConfig | None = None, limit: int = 100,
                      clock: FakeClock | None = None, order: list[Path] | None = None):
    clock = clock or FakeClock(cost)
    trial = Trial(order or list(cost), config or TrialConfig(), clock, lambda: None)
    ran: list[Path] = []
    for _ in range(limit):
        if trial.verdict is not None:
            break
        ran.append(trial.current)
        clock.run(trial)
    return trial, ran


def test_fastest_path_wins_and_timings_are_the_measured_ones():
    cost = {Path.EAGER_LOW: 0.010, Path.COMPILED: 0.007, Path.FP32: 0.012}
    trial, _ = run_until_verdict(cost, TrialConfig(give_up=10.0))
    assert trial.verdict.path is Path.COMPILED
    assert trial.verdict.timings_ms == pytest.approx({p.value: 1e3 * c for p, c in cost.items()})


def test_warmup_iterations_are_not_timed():
    # the compiled path's first iterations include compilation: if they were timed, FP32 would win
    class Compiling(FakeClock):
        def seconds(self, trial):
            first = trial.current is Path.COMPILED and self.steps < 2  # the compiled path's first two iterations
            return 5.0 if first else self.cost[trial.current]

    cost = {Path.COMPILED: 0.005, Path.FP32: 0.010}
    trial, _ = run_until_verdict(cost, TrialConfig(give_up=100.0), clock=Compiling(cost))
    assert trial.verdict.path is Path.COMPILED
    assert max(trial.samples[Path.COMPILED]) == pytest.approx(0.005)


def test_a_one_off_slow_first_sample_does_not_drop_the_fastest_path():
    class OneOff(FakeClock):  # the compiled path's first timed iteration is 1.8x its others (seen on an H100)
        compiled_runs = 0

        def seconds(self, trial):
            c = self.cost[trial.current]
            if trial.current is Path.COMPILED:
                self.compiled_runs += 1
                if self.compiled_runs == 2:  # after its one warm-up iteration
                    return 1.8 * c
            return c

    cost = {Path.EAGER_LOW: 0.0375, Path.COMPILED: 0.031, Path.FP32: 0.145}
    trial, _ = run_until_verdict(cost, TrialConfig(warmup={Path.EAGER_LOW: 1, Path.COMPILED: 1, Path.FP32: 1},
                                                   block=1),  # a sample of one iteration: the one-off undiluted
                                 clock=OneOff(cost), order=[Path.EAGER_LOW, Path.COMPILED, Path.FP32])
    assert max(trial.samples[Path.COMPILED]) == pytest.approx(1.8 * 0.031)  # the one-off was timed
    assert trial.verdict.path is Path.COMPILED and Path.COMPILED not in trial.abandoned
    assert Path.FP32 in trial.abandoned and len(trial.samples[Path.FP32]) == 1  # 3.9x: dropped after one round


def test_a_clear_loser_is_dropped_after_one_round():
    cost = {Path.EAGER_LOW: 0.010, Path.FP32: 0.050}
    config = TrialConfig(measure=5, give_up=1.3)
    trial, ran = run_until_verdict(cost, config)
    assert trial.verdict.path is Path.EAGER_LOW
    assert len(trial.samples[Path.FP32]) == 1 and Path.FP32 in trial.abandoned
    assert ran.count(Path.FP32) == 1 + config.block  # one warm-up, one timed sample


class Pipelined(FakeClock):
    """Each path has host and device seconds per iteration. Right after a sync the device waits for the host:
    the iteration costs both; back to back they overlap and it costs the larger (a training loop's steady state)."""

    def __init__(self, host: dict[Path, float], device: dict[Path, float]):
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
    host, device = {Path.EAGER_LOW: 0.009, Path.COMPILED: 0.002}, {Path.EAGER_LOW: 0.001, Path.COMPILED: 0.008}
    outcomes = {}
    for block in (1, 2, 4):
        clock = Pipelined(host, device)
        trial = Trial([Path.EAGER_LOW, Path.COMPILED], TrialConfig(give_up=10.0, block=block), clock, clock.sync)
        ticks = 0
        while trial.verdict is None and ticks < 200:
            clock.run(trial)
            ticks += 1
        outcomes[block] = trial.verdict.timings_ms
        # synchronized once per warm-up or sample (plus the first call), never inside a sample
        samples = sum(len(s) for s in trial.samples.values())
        assert clock.syncs == 1 + samples + len(trial.candidates)
    assert outcomes[1][Path.COMPILED.value] == pytest.approx(outcomes[1][Path.EAGER_LOW.value])
    for block in (2, 4):  # (first iteration synchronized + the rest overlapped) / block
        assert outcomes[block][Path.COMPILED.value] == pytest.approx((10 + 8 * (block - 1)) / block)
        assert outcomes[block][Path.EAGER_LOW.value] == pytest.approx((10 + 9 * (block - 1)) / block)


def test_candidates_alternate_so_drift_hits_all_of_them():
    # the machine slows down steadily; interleaved rounds keep the truly faster path ahead
    class Drifting(FakeClock):
        def seconds(self, trial):
            return self.cost[trial.current] * (1 + 0.02 * self.steps)

    cost = {Path.EAGER_LOW: 0.010, Path.FP32: 0.0101}
    trial, _ = run_until_verdict(cost, TrialConfig(give_up=100.0, fp32_margin=0.0), clock=Drifting(cost),
                                 order=[Path.FP32, Path.EAGER_LOW])
    assert trial.verdict.path is Path.EAGER_LOW


def test_interval_is_timed_on_the_module_called_every_iteration():
    # module 7 is called once (say, a warm-up forward of a teacher); module 1 every iteration: after a few calls of
    # module 1 without module 7 the trial times module 1 and still reaches a verdict
    clock = FakeClock({Path.EAGER_LOW: 0.01, Path.FP32: 0.02})
    trial = Trial([Path.EAGER_LOW, Path.FP32], TrialConfig(), clock, lambda: None)
    trial.tick(7)
    for _ in range(60):
        if trial.verdict:
            break
        clock.run(trial, member=1)
    assert trial.verdict is not None and trial.verdict.path is Path.EAGER_LOW


def test_verdict_cache_round_trip_and_corrupt_file(tmp_path):
    cache = VerdictCache(tmp_path)
    v = Verdict(Path.EAGER_LOW, "measured", {"low-precision-eager": 1.0, "fp32-eager": 2.0})
    cache.put({"k": v})
    got = cache.get("k")
    assert got.path is Path.EAGER_LOW and got.cached and got.timings_ms == v.timings_ms
    assert cache.get("other") is None
    cache.path.write_text("{not json")
    assert cache.get("k") is None  # corrupt: ignored, not fatal
    cache.put({"k2": v, "k3": v})
    stored = json.loads(cache.path.read_text())
    assert stored["k2"]["path"] == stored["k3"]["path"] == "low-precision-eager"
    cache.path.write_text(json.dumps({"k": {"path": "warp-drive"}}))
    assert cache.get("k") is None


def test_module_key_depends_on_shapes_not_values():
    a, b, c = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(4, 9)
    import torch
    x = torch.randn(2, 4)
    assert module_key(a, (x,), "bf16", "cpu") == module_key(b, (x,), "bf16", "cpu")
    assert module_key(a, (x,), "bf16", "cpu") != module_key(c, (x,), "bf16", "cpu")
    assert module_key(a, (x,), "bf16", "cpu") != module_key(a, (torch.randn(3, 4),), "bf16", "cpu")
    assert module_key(a, (x,), "bf16", "cpu") != module_key(a, (x,), "fp16", "cpu")


@pytest.mark.parametrize("lead, chosen", [(0.01, Path.COMPILED_AUTOCAST), (0.10, Path.COMPILED)])
def test_automp_compiled_must_beat_the_hand_written_path_by_more_than_the_noise(lead, chosen):
    cost = {Path.COMPILED: 0.100, Path.COMPILED_AUTOCAST: 0.100 * (1 + lead), Path.EAGER_LOW: 0.2}
    trial, _ = run_until_verdict(cost)
    assert trial.verdict.path is chosen
    assert ("hand-written loop's own path is kept" in trial.verdict.reason) == (chosen is Path.COMPILED_AUTOCAST)
    assert trial.verdict.timings_ms[Path.COMPILED.value] == pytest.approx(100.0)  # the measured timings, unchanged


@pytest.mark.parametrize("lead, chosen", [(0.02, Path.FP32), (0.10, Path.EAGER_LOW)])
def test_another_path_must_beat_the_script_as_written_by_more_than_the_noise(lead, chosen):
    # a 2% lead on a shared CPU became 0.92x of FP32 in steady state (automp demo): the script as written is kept
    cost = {Path.FP32: 0.100 * (1 + lead), Path.EAGER_LOW: 0.100}
    trial, _ = run_until_verdict(cost)
    assert trial.verdict.path is chosen
    assert ("the script runs as written" in trial.verdict.reason) == (chosen is Path.FP32)


def test_the_anchor_rule_and_the_fp32_rule_compose():
    # automp-compiled leads the anchor by 1% (anchor kept), and the anchor leads FP32 by 2%: FP32 is kept
    cost = {Path.COMPILED: 0.100, Path.COMPILED_AUTOCAST: 0.101, Path.FP32: 0.103}
    trial, _ = run_until_verdict(cost)
    assert trial.verdict.path is Path.FP32
