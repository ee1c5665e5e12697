"""Never slower: time the ways a model can run during its first training iterations and keep the fastest.

A cost model predicts; only the device knows. Small scripts are launch- or host-bound, where casts and compiled graphs
buy nothing, and compiling a big model is only worth it when Inductor beats the eager kernels. So, like PAI's online
feedback tuning, each newly seen root module runs a short trial: a few whole iterations per candidate path (stock
Inductor under autocast — what a careful user would hand-write, so automp is never slower than that either — FP32 eager
as written, low precision eager, and the compiled graphs replayed as CUDA graphs, which take the host's launch work
away where a step is host-bound; automp's own graph pass runs where the configuration forces it), timed from one call
of the module to its next call — forward, backward, optimizer step and the data loading in between, everything the
user waits for. The fastest path is kept for
the rest of the run, re-measured once in steady state against the eager paths that came close (`confirmation`), and the
verdict is cached on disk per module shape, dtype and device (automp.runtime.verdicts), so the next run of the same
script starts on the winner and pays nothing.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from automp.runtime.decisions import (ANCHOR_KEPT, AS_WRITTEN, BF16_TWIN, COMPILED_PATHS, CONFIRMED, EAGER_PATHS,
                                      GRAPHS_DEVICE_BOUND, MEASURED, ONLY_LEFT, REMEASURED, TWIN_FORECAST, TWIN_KEPT,
                                      Route, Verdict)
from automp.runtime.fp32_bound import RULED_OUT, Fp32Floor

TWIN_CLOSE = "bf16-twin-forecast-close"  # Verdict.bounds: the twin's forecast was not clear enough, it is timed


@dataclass
class TrialConfig:
    """warmup: iterations of a candidate that are not timed (compilation, allocator and autotuning warm-up); measure:
    rounds of timed samples (one per candidate per round, each `block` iterations); give_up: after the second and later
    rounds, a candidate whose fastest sample is this much slower than the best median is dropped — a clear loser needs
    no more evidence, and every trial iteration of a slow path is time the user loses. give_up_first: the same after the
    first round, where each candidate has one sample and one sample can be a one-off: the first timed iteration of a
    compiled path can still carry compile-time work and measure well above its later ones, which dropped the path that
    would have won. Where CUDA graphs are recorded after this round (RECORD_LAST), an eager path's first sample is
    judged by give_up: it compiles nothing, so its first timed iteration is like its later ones, and a clear eager
    loser kept into the second round ran beside the graph pool recorded then, lifting the trial's peak memory above
    the FP32 script's own. Without graphs to come (a CPU) the first round keeps its wider margin: one sample on a shared
    host can be a one-off for any path. anchor_margin: autocast-compiled is what a user hand-writes (stock Inductor
    under torch.autocast), so keeping it can never leave the script slower than that; automp's own graph pass replaces
    it only when it measured faster by more than the margin. Two identical loops differ by a few percent from run to
    run (BENCHMARKS.md, "Noise"), and trials that chose automp-compiled on a lead far inside
    that noise were then slower in an interleaved run. fp32_margin: the same for the script as written (FP32 eager):
    any other path changes the script's numerics, so it must lead by more than the noise to be kept; on a small shared
    CPU, low precision chosen on a lead inside the noise then ran slower than FP32. confirm_after: a verdict for a
    path other than FP32 eager is re-measured once, after this many iterations on it, against the eager paths that
    came within confirm_within of it (see `confirmation`); 0: never. churn: a compiled path's recompiling training
    calls after its verdict before it may go back to the eager path it beat, if compiling cost more than it saved
    (automp.runtime.guards.recompile_watch); 0: never. give_up also rules FP32 eager out before it runs, by a lower
    bound of its step (automp.runtime.fp32_bound). graphs_host_share: CUDA graphs take the host's work of launching
    kernels off the step; where the host issued every timed sample of the compiled paths without graphs in at most
    this share of the sample's time, waiting for the device the rest, the device never waited for it and graphs have
    little to hide, so they are not recorded (`launch_bound`): their compile and memory pool cost the trial time and
    memory for next to nothing. A host ahead of the device keeps its queue full, so the gaps between kernels that graphs
    also shorten stay small. The share is set between two measured models (BENCHMARKS.md, "Against the strongest
    loop"): Llama-3.2-1B dims issued its compiled samples in about 0.6 of their time and its graphs gained less than
    anchor_margin while their pool lifted the trial's memory; GPT-2 issued them in 0.8-0.9 and its graphs gained
    several times anchor_margin. early_warmup: iterations of each `later` path's warm-up that run first, before any
    other candidate (taken from its warm-up, never all of it): a CUDA-graph path's first call is the graph trees'
    warm-up run, which records nothing and replays nothing, but allocates in the graph pool; run while the process
    holds the least (no other path's activations or compile), it peaks like the hand-written loop's own first step,
    where after the compiled candidates' steps it lifted GPT-2's trial above them (BENCHMARKS.md, "Against the
    strongest loop"). Its pool then stays reserved until the recording (RootPaths.check_early_pool), beside every
    other candidate's steps: 0 by default, since measured it cost more than it saved. It lowered GPT-2's allocated
    peak but not its reserved one, raised ViT-L/16's a little, and where graphs then leave as launch-bound (Llama-3.2-1B
    dims) the pool's whole reservation came on top of the trial's (docs/runtime.md). twin_margin: an
    FP8 step whose own warm-up time plus the milliseconds its FP8 layers are predicted to save (the device table's
    GEMM times, automp.precision.fp8.choice.saving_ms) forecasts its bf16 twin slower by more than this share is kept
    without compiling or timing the twin (`_judge_twin`): at Llama-3.2-1B dims the twin's compile was the whole of
    the FP8 first run's excess over torchao's, and its recording step the trial's peak memory (BENCHMARKS.md, "FP8
    training"). Over three times anchor_margin: on ViT-L/16 the table's predicted saving, a few percent of the step,
    did not hold on the whole step (the FP8 step measured slower), so only a clear forecast skips the measurement;
    inf: the twin is always timed (under torch.distributed, ranks.for_ranks)."""

    warmup: dict[Route, int] = field(default_factory=lambda: {Route.FP32: 1, Route.EAGER_LOW: 1, Route.COMPILED: 2,
                                                             Route.COMPILED_AUTOCAST: 2, Route.GRAPHED: 3,
                                                             Route.FP8_COMPILED: 2, Route.FP8_GRAPHED: 3})
    measure: int = 4  # even: alternating rounds then cancel a linear drift exactly (x block iterations each)
    block: int = 2  # iterations per timed sample, run back to back as the script runs them (see Trial)
    give_up: float = 1.3
    give_up_first: float = 2.5
    switch_after: int = 4  # another module called this often between two calls of the timed one: time that one
    anchor_margin: float = 0.03  # automp-compiled or autocast-graphed must beat autocast-compiled by more than this
    fp32_margin: float = 0.03  # any other path must beat FP32 eager (the script as written) by more than this
    confirm_after: int = 10  # the trial already ran each path 9 or more times: the process is mostly warm
    confirm_within: float = 0.25
    churn: int = 3
    graphs_host_share: float = 0.7
    early_warmup: int = 0
    twin_margin: float = 0.10


class Trial:
    """The state machine of one trial over a group of root modules that are new at the same time (a GAN's
    generator and discriminator): all of them run the current candidate, so the timed interval measures that
    candidate for the whole iteration. `tick()` is called at every call of any member; the interval is taken
    between two calls of the "clock" member — the first one called, or whichever another member outnumbers.

    First each candidate warms up (untimed), then the candidates take turns, one timed sample each per round:
    interleaving, in alternating order, cancels drift (a neighbour's load, clocks, a data loader warming up) that would
    bias back-to-back blocks. After each round a candidate slower than `give_up` x the best median is dropped
    (`give_up_first` while it has one sample; for an eager path only while no graphs are to be recorded). Candidates in
    `later` are warmed up after the first round, and timed from the second on (RECORD_LAST says why).

    A sample is `block` iterations run back to back, with the device synchronized only at its two ends: the script
    after the trial overlaps one iteration's host work with the previous one's kernels, and a sample of one
    synchronized iteration does not: timed one synchronized iteration at a time, a path can measure slower or faster
    than its unsynchronized steps by as much as the margins the trial decides by. Two iterations halve that error.

    `floor` (automp.runtime.fp32_bound): low precision eager warms up before FP32 eager, its GEMMs counted in its first
    iteration, and FP32 eager is dropped before it ever runs where that count bounds it above give_up x its second."""

    def __init__(self, candidates: list[Route], config: TrialConfig, clock: Callable[[], float],
                 sync: Callable[[], None], note: str = "", incumbent: Route | None = None,
                 warmup: Mapping[Route, int] | None = None, clock_member: int | None = None,
                 later: Iterable[Route] = (), floor: Fp32Floor | None = None,
                 peak: Callable[[], int] | None = None, saving_ms: float | None = None):
        if not candidates:
            raise ValueError("a trial needs at least one candidate path")
        self.candidates, self.config, self.clock, self.sync = list(candidates), config, clock, sync
        self.note = note  # why these candidates: goes into the verdict's reason
        self.incumbent = incumbent  # a confirmation's path so far: another low-precision path must clearly beat it
        warmup = config.warmup if warmup is None else warmup
        self.samples: dict[Route, list[float]] = {c: [] for c in candidates}
        self.host_shares: dict[Route, list[float]] = {}  # per timed sample: the share of it the host took to issue it
        self.alive = list(candidates)
        self.abandoned: set[Route] = set()
        later = set(later)
        # not warmed up yet; with nothing else to time first, nothing waits
        self._later = [] if all(c in later for c in candidates) else [c for c in candidates if c in later]
        # (path, timed, iterations): a warm-up or a timed sample, one synchronized interval each; the later paths'
        # early warm-up first (TrialConfig.early_warmup), the rest of it when they are warmed up after the first round
        early = {c: min(config.early_warmup, warmup.get(c, 1) - 1) for c in self._later}
        self._warmup = {**warmup, **{c: warmup.get(c, 1) - n for c, n in early.items() if n > 0}}
        self._queue: list[tuple[Route, bool, int]] = [(c, False, n) for c, n in early.items() if n > 0] + [
            (c, False, warmup.get(c, 1)) for c in candidates if c not in self._later and warmup.get(c, 1) > 0]
        self.floor = floor
        self.bounds: dict[str, dict[str, Any]] = {}  # Verdict.bounds
        # the device's peak allocated bytes so far (None off CUDA), and by each path's value the peak it rose to in
        # one of its intervals: which candidate set the trial's peak memory (Verdict.peaks_gib)
        self.peak, self.peaks, self._peak_start = peak, {}, 0
        self._count: Any = None  # the GEMM count of the interval running, while it bounds FP32 eager (_begin)
        self._counted: tuple[Any, int] | None = None  # the count and its iterations, until the next one is timed
        if floor is not None:  # FP32's warm-up after low precision eager's, which bounds it: one counted iteration,
            # then one or more (its own warm-up's remainder) that the bound is judged against
            self._queue = [q for p, timed, n in self._queue for q in (
                [(p, timed, 1), (p, timed, max(1, n - 1))] if p is Route.EAGER_LOW and not timed else [(p, timed, n)])]
            self._queue.sort(key=lambda q: q[0] is Route.FP32)
        # saving_ms: what the FP8 path's layers are predicted to save per step. Its warm-up then runs before its bf16
        # twin's, and one more iteration after it alone, the twin's forecast (TrialConfig.twin_margin, _judge_twin):
        # the last warm-up iteration of a graphed path can still be its recording, slower than its steady step
        fp8 = next((p for p in candidates if BF16_TWIN.get(p) in candidates), None)
        warming = [q for q in self._queue if q[0] is fp8 and not q[1]]
        self.saving_ms = saving_ms if warming and config.twin_margin < math.inf else None
        if self.saving_ms is not None:
            others = [q for q in self._queue if q[0] is not fp8]
            self._queue = [*warming, (fp8, False, 1)] + others
        self._rounds = 0
        self._clock_member = clock_member  # a confirmation times the module its trial timed
        self._others: dict[int, int] = {}
        self._trains = False  # a call with grad mode on was seen: calls without it no longer count (tick)
        self._start: float | None = None  # when the queue head's interval began
        self._done = 0  # iterations of the queue head finished
        self.verdict: Verdict | None = None
        self.graphs_checked = False  # its CUDA graphs passed automp.runtime.paths.RootPaths.check_graphs_fit
        self.pool_checked = False  # the pool of their early warm-up passed RootPaths.check_early_pool
        self._refill()

    @property
    def current(self) -> Route:
        return self.verdict.path if self.verdict else self._queue[0][0]

    @property
    def warming_early(self) -> bool:
        """The queue head is a later path's early warm-up (TrialConfig.early_warmup): its graphs' checks (memory,
        launch-bound) wait for its recording, when the other candidates have been measured."""
        return self.verdict is None and bool(self._queue) and self._queue[0][0] in self._later

    def progress(self) -> tuple[Route, int | None]:
        """The path running now and the round its timed sample belongs to (of config.measure), None in a warm-up:
        what the status line on a terminal shows (automp.runtime.progress)."""
        timed = bool(self._queue) and self._queue[0][1] and self.verdict is None
        return self.current, min(self._rounds, self.config.measure) if timed else None

    def tick(self, member: int, training: bool = True) -> None:
        """A call of `member`. training: the call records a graph for a backward (grad mode on). Once the trial has
        seen one, calls without grad (an evaluation inside the training loop, generate()'s decoding steps) are not
        iterations: their time falls inside the interval of the training call around them. A script that never
        trains (inference) has every call timed."""
        if self.verdict is not None:
            return
        if training:
            self._trains = True
        elif self._trains:
            return
        if self._clock_member is None:
            self._clock_member = member
        if member != self._clock_member:
            self._others[member] = self._others.get(member, 0) + 1
            if self._others[member] > self.config.switch_after:  # the first module was a one-off call
                self._clock_member, self._others, self._start, self._done = member, {}, None, 0
            else:
                return
        self._others = {}
        if self._start is None:
            self.sync()
            self._begin()
            return
        path, timed, iterations = self._queue[0]
        self._done += 1
        if self._done < iterations:
            return  # inside a sample: the loop runs on unsynchronized, as it will after the trial
        issued = self.clock()
        self.sync()
        now = self.clock()
        if self.peak is not None and (top := self.peak()) > self._peak_start:
            self.peaks[path.value] = max(top, self.peaks.get(path.value, 0))
        if timed:
            self.samples[path].append((now - self._start) / iterations)
            if now > self._start:
                self.host_shares.setdefault(path, []).append((issued - self._start) / (now - self._start))
        elif self._count is not None:
            self._counted, self._count = (self._count, iterations), None
        elif self._counted is not None and path is Route.EAGER_LOW:
            self._judge_fp32(now - self._start, iterations)
        elif self.saving_ms is not None and len(self._queue) > 1 and self._queue[1][0] is BF16_TWIN.get(path):
            self._judge_twin(path, (now - self._start) / iterations)
        self._queue.pop(0)
        self._done = 0
        if not self._queue:
            self._refill()
        self._begin()  # bookkeeping above is not charged to the next candidate

    def counted(self, module: Any, forward: Callable[[], Any]) -> Any:
        """forward(), a call of `module` on the current path; its GEMMs counted while they bound FP32 eager."""
        return forward() if self._count is None else self._count.run(module, forward)

    def _begin(self) -> None:
        """An interval starts now. Low precision eager's warm-up, with FP32 eager's still to come, is counted."""
        head = self._queue[0] if self._queue and self.verdict is None else None
        bounds = (self.floor is not None and head is not None and head[0] is Route.EAGER_LOW and not head[1]
                  and self._counted is None and Route.FP32.value not in self.bounds
                  and any(p is Route.FP32 and not timed for p, timed, _ in self._queue))
        self._count = self.floor.open() if bounds else None
        if self.peak is not None:
            self._peak_start = self.peak()
        self._start = self.clock()

    def _judge_fp32(self, seconds: float, iterations: int) -> None:
        """Low precision eager's warm-up after its counted iteration ended: FP32 eager out where the count bounds it
        above give_up x this one (automp.runtime.fp32_bound says why that is the trial's own rule)."""
        (count, counted), self._counted = self._counted, None
        record, why = self.floor.judge(count, counted, seconds, iterations, self.config.give_up,
                                       Route.EAGER_LOW.value)
        self.bounds[Route.FP32.value] = record
        if record["rule"] == RULED_OUT:
            self.exclude({Route.FP32}, why)
        elif why:
            self._add_note(why)

    def _judge_twin(self, path: Route, seconds: float) -> None:
        """The FP8 step's iteration after its warm-up ended, its bf16 twin's warm-up next: the twin out of the trial,
        never compiled, where the forecast of its step, this iteration plus the FP8 layers' predicted saving, is slower
        by more than twin_margin. The figures go into the verdict's bounds either way."""
        twin, saving, self.saving_ms = BF16_TWIN[path], self.saving_ms, None
        ms, margin = 1e3 * seconds, self.config.twin_margin
        ruled_out = saving > margin * ms
        self.bounds[twin.value] = {"rule": TWIN_FORECAST if ruled_out else TWIN_CLOSE, "fp8_ms": round(ms, 3),
                                   "saving_ms": saving, "forecast_ms": round(ms + saving, 3), "margin": margin}
        if ruled_out:
            self.exclude({twin}, f"{twin.value} not run: its step is forecast at {ms + saving:.1f} ms, {path.value}'s "
                                 f"{ms:.1f} ms plus the {saving:.1f} ms its FP8 layers are predicted to save, over "
                                 f"{100 * margin:g}% slower")

    def launch_bound(self) -> str | None:
        """Why CUDA graphs are not worth recording in this trial, or None: every timed sample of the compiled paths
        without graphs so far was issued by the host in at most TrialConfig.graphs_host_share of its time (the rest it
        waited for the device). A script that syncs inside its step (`loss.item()`) shows the host busy to the end:
        graphs stay. The figures go into the verdict's bounds."""
        share = max((s for p in (Route.COMPILED_AUTOCAST, Route.FP8_COMPILED) for s in self.host_shares.get(p, ())),
                    default=None)
        limit = self.config.graphs_host_share
        if share is None or share > limit:
            return None
        self.bounds[Route.GRAPHED.value] = {"rule": GRAPHS_DEVICE_BOUND, "host_share": round(share, 3), "limit": limit}
        return (f"CUDA graphs not tried: the host issued each compiled step in at most {100 * share:.0f}% of its "
                f"time and waited for the device the rest: the device, not the launches, sets the step's time, and "
                f"graphs would only shorten the launches")

    def exclude(self, paths: frozenset[Route] | set[Route], why: str) -> None:
        """Take `paths` out of the running trial (a member cannot run them, see automp.runtime.guards.input_grads); a sample of
        one of them in progress is dropped. The other candidates go on as if those had never been in it."""
        remaining = [p for p in self.alive if p not in paths]
        if self.verdict is not None or len(remaining) == len(self.alive):
            return
        if not remaining:
            raise ValueError(f"a trial cannot exclude all of its candidates {[p.value for p in self.alive]}")
        if self._queue and self._queue[0][0] in paths:
            self._start, self._done = None, 0  # the interval restarts at the next call, on a path that stays
        self.alive = remaining
        self._queue = [q for q in self._queue if q[0] not in paths]
        for p in paths:
            self.samples.pop(p, None)
        self._add_note(why)
        if not self._queue:
            self._refill()

    def _add_note(self, why: str) -> None:
        self.note = f"{self.note}; {why}" if self.note else why

    def substitute(self, mapping: Mapping[Route, Route], why: str) -> None:
        """Run mapping's values in place of its keys, none of which has been timed yet: where CUDA graphs do not fit,
        a trial of graphed paths only (the FP8 step against its bf16 twin) goes on with the same graphs without them
        rather than with nothing."""
        if self.verdict is not None or not any(p in mapping for p in self.alive):
            return
        if any(self.samples.get(p) for p in mapping):
            raise ValueError("a trial cannot substitute a path it has already timed")
        swap: Callable[[Route], Route] = lambda p: mapping.get(p, p)
        if self._queue and self._queue[0][0] in mapping:
            self._start, self._done = None, 0  # the interval restarts at the next call, on the path that replaces it
        self.candidates, self.alive, self._later = ([swap(p) for p in ps] for ps in
                                                    (self.candidates, self.alive, self._later))
        self.samples = {swap(p): s for p, s in self.samples.items()}
        self._queue = [(swap(p), timed, n if timed or p not in mapping else self._warmup.get(swap(p), n))
                       for p, timed, n in self._queue]
        self._add_note(why)

    def _refill(self) -> None:
        """Queue the next round, after pruning clear losers; decide when the rounds are done or one is left."""
        if self._queue:
            return
        # unsampled, so never pruned below: a graph pool comes after this round while one waits (TrialConfig says why)
        waiting = [c for c in self._later if c in self.alive]
        if self._rounds:
            sampled = [p for p in self.alive if self.samples[p]]  # none when exclude() took every timed one
            best = min((statistics.median(self.samples[p]) for p in sampled), default=0.0)
            for p in sampled:
                first = len(self.samples[p]) == 1 and (p in COMPILED_PATHS or not waiting)
                factor = self.config.give_up_first if first else self.config.give_up
                if min(self.samples[p]) > factor * best:
                    self.alive.remove(p)
                    self.abandoned.add(p)
        if (self._rounds >= self.config.measure and not waiting) or len(self.alive) == 1:
            self._decide()
            return
        self._rounds += 1
        order = self.alive if self._rounds % 2 else self.alive[::-1]  # A B, B A, ...: linear drift cancels
        warm: list[tuple[Route, bool, int]] = []
        if waiting and self._rounds == 1 and len(waiting) < len(self.alive):
            order = [c for c in order if c not in waiting]
        else:
            warm = [(c, False, self._warmup.get(c, 1)) for c in waiting if self._warmup.get(c, 1) > 0]
            self._later = []
        self._queue = warm + [(c, True, max(1, self.config.block)) for c in order]

    def _measured(self) -> tuple[dict[str, float], Any, str]:
        """Each candidate's median ms (by its value), the fastest candidate still in, and the timings as a reason
        lists them, fastest first."""
        medians = {c: 1e3 * statistics.median(s) for c, s in self.samples.items() if s}
        winner = min(self.alive, key=lambda c: medians.get(c, 0.0))
        parts = ", ".join(f"{c.value} {ms:.2f} ms" + (" (dropped early)" if c in self.abandoned else "")
                          for c, ms in sorted(medians.items(), key=lambda kv: kv[1]))
        return {c.value: ms for c, ms in medians.items()}, winner, parts

    def _decide(self) -> None:
        timings, winner, parts = self._measured()
        why = f"{self.note}; " if self.note else ""
        tie = ""
        inc = self.incumbent
        rule = MEASURED if inc is None else CONFIRMED if winner is inc else REMEASURED
        if inc is not None and winner not in (inc, Route.FP32) and self._within(inc, winner, timings,
                                                                             self.config.anchor_margin):
            tie = (f"; {winner.value} was within {100 * self.config.anchor_margin:g}% of {inc.value} (this "
                   f"measurement's noise), so {inc.value} is kept")
            winner, rule = inc, CONFIRMED
        twin = BF16_TWIN.get(winner)
        if twin is not None and self._within(twin, winner, timings, self.config.anchor_margin):
            tie += (f"; {winner.value} was within {100 * self.config.anchor_margin:g}% of {twin.value} (this "
                    f"measurement's noise), so the step stays bf16")
            winner, rule = twin, TWIN_KEPT
        if winner in (Route.COMPILED, Route.GRAPHED) and self._within(Route.COMPILED_AUTOCAST, winner, timings,
                                                                    self.config.anchor_margin):
            tie += (f"; {winner.value} was within {100 * self.config.anchor_margin:g}% (this measurement's "
                    f"noise), so the hand-written loop's own path is kept")
            winner, rule = Route.COMPILED_AUTOCAST, ANCHOR_KEPT
        if winner is not Route.FP32 and self._within(Route.FP32, winner, timings, self.config.fp32_margin):
            tie += (f"; {winner.value} was within {100 * self.config.fp32_margin:g}% of {Route.FP32.value} (this "
                    f"measurement's noise), so the script runs as written")
            winner, rule = Route.FP32, AS_WRITTEN
        if not parts:
            rule = TWIN_FORECAST if any(b.get("rule") == TWIN_FORECAST for b in self.bounds.values()) else ONLY_LEFT
        measured = (f"measured per iteration: {parts}" if parts else f"{winner.value} kept on that forecast"
                    if rule == TWIN_FORECAST else "the only candidate left, nothing timed")
        self.verdict = Verdict(winner, f"{why}{measured}{tie}", timings, rule=rule,
                               confirmed=inc is not None, bounds=dict(self.bounds),
                               peaks_gib={k: round(v / 2**30, 3) for k, v in self.peaks.items()},
                               host_shares={p.value: [round(x, 3) for x in v] for p, v in self.host_shares.items()})

    def _within(self, kept: Route, winner: Route, timings: dict[str, float], margin: float) -> bool:
        """Whether `kept`, still a candidate, measured within `margin` of the winner's median."""
        ms = timings.get(kept.value)
        return kept in self.alive and ms is not None and ms <= (1 + margin) * timings[winner.value]


def confirmation(verdict: Verdict, config: TrialConfig, clock: Callable[[], float], sync: Callable[[], None],
                 after: Trial | None = None) -> Trial | None:
    """A second, shorter trial that re-measures a verdict once the script runs in steady state, or None when there
    is nothing to re-measure. The trial times every path in the script's first iterations, where allocator, cuDNN
    and data-loader warm-up land on whichever path runs then: a detector's trial measured both eager paths slower than
    automp's compiled graphs, while the same eager loops ran faster than those graphs afterwards. So
    the winner runs `confirm_after` iterations, then is timed again against the eager paths (FP32 as written, low
    precision eager) that the trial measured within `confirm_within` of it: they need no compilation, so
    re-measuring costs a few iterations. The same margins apply, and another low-precision path must beat the
    incumbent by more than the anchor margin: the incumbent's compiled graphs are already paid for. `after`: the
    trial that gave the verdict; its timed module stays the timed one (a GAN's discriminator, called twice per
    iteration, would otherwise split iterations in two)."""
    if verdict.path is Route.FP32 or verdict.confirmed or config.confirm_after <= 0:
        return None
    own = verdict.timings_ms.get(verdict.path.value)
    if own is None:
        return None
    rivals = [p for p in EAGER_PATHS if p is not verdict.path and p.value in verdict.timings_ms
              and verdict.timings_ms[p.value] <= (1 + config.confirm_within) * own]
    if not rivals:
        return None
    before = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(verdict.timings_ms.items(), key=lambda kv: kv[1]))
    note = (f"re-measured in steady state after {config.confirm_after} iterations on {verdict.path.value} (the "
            f"trial had measured {before})")
    trial = Trial([verdict.path, *rivals], config, clock, sync, note=note, incumbent=verdict.path,
                  warmup={verdict.path: config.confirm_after, **{p: 1 for p in rivals}},
                  clock_member=after._clock_member if after is not None else None)
    trial.bounds = dict(verdict.bounds)  # what kept a path out of the trial keeps it out of its re-measurement
    return trial
