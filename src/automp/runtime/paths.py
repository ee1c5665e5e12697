"""A root module's path over a run: where it starts (forced, cached, its only candidate, or a trial of the
candidates its device can win on), the verdict of its trial, the re-measurement in steady state, and the moves off
a path afterwards (recompiles, CUDA graphs that no longer fit the script, every module on FP32, gradients with
respect to inputs, a script that manages precision itself).

`RootPaths` makes those decisions for the roots, cache and report the session hands it; nothing here runs a module
(that is automp.runtime.session.Session).
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn as nn

from automp.config import AutoMPConfig
from automp.runtime import compiled_paths, graph_pool
from automp.runtime.guards import input_grads
from automp.runtime.guards.memory_budget import DeviceMemory, MemoryBudget, OverBudget, cuda_memory, gib
from automp.runtime.guards.oom import oom_size
from automp.runtime.fp32_bound import Fp32Floor
from automp.runtime.report import Recorder, notice
from automp.runtime.decisions import (COMPILED_PATHS, EAGER_PATHS, GRAPHED_PATHS, GRAPHS_OFF, INPUT_GRADS,
                                      ONLY_CANDIDATE, RECORD_LAST, SCALING_PAUSED, SCRIPTS_AUTOCAST, TRIAL_OOM,
                                      TRIAL_OVER_MEMORY, UNSETTLED, WITHOUT_GRAPHS, Route, Verdict, forced)
from automp.runtime.trial import Trial, TrialConfig, confirmation
from automp.runtime.ranks import agreed, for_ranks
from automp.runtime.guards.recompile_watch import CompileWatch, watch_for
from automp.runtime.guards.unread_outputs import FieldReads
from automp.runtime.verdicts import VerdictCache
from automp.scaling import Scaling
from automp.world import distributed


@dataclass
class Root:
    """One root module's state: its path (or trial), the compiled callables it may run, and why automp left it."""

    label: str
    device: torch.device
    low: torch.dtype
    key: str = ""
    path: Route | None = None  # None while its trial runs
    trial: Trial | None = None
    verdict: Verdict | None = None  # what decided its path
    confirm: Trial | None = None  # the verdict's re-measurement in steady state, while it runs (trial.confirmation)
    compiled: Callable[..., Any] | None = None
    stock: Callable[..., Any] | None = None  # stock Inductor, run under autocast (Route.COMPILED_AUTOCAST)
    graphed: Callable[..., Any] | None = None  # the same, replayed as CUDA graphs (Route.GRAPHED)
    fp8_stock: Callable[..., Any] | None = None  # stock with its FP8 layers on (Route.FP8_COMPILED)
    fp8_graphed: Callable[..., Any] | None = None  # the same, replayed as CUDA graphs (Route.FP8_GRAPHED)
    fp8_layers: tuple[str, ...] = ()  # its linear layers that run FP8 on the FP8 paths (automp.precision.fp8.choice)
    fp8_saving_ms: float | None = None  # what they are predicted to save per step (the trial's twin forecast)
    graphs: int = 0  # graphs compiled for this root (recompiles included)
    compile_log: dict[str, dict[str, float]] = field(default_factory=dict)  # per stock path (runtime.compile_log)
    aside: str | None = None  # why automp leaves this module as written
    fields: FieldReads = field(default_factory=FieldReads)  # its output fields the script reads (unread_outputs)
    params: list[torch.Tensor] | None = None  # its parameters, for the eager path's shared weight casts
    lockstep: bool = False  # called by every rank at once (a DDP module): its verdicts are rank 0's (ranks.agreed)
    eager_only: bool = False  # the script takes gradients with respect to its input (automp.runtime.guards.input_grads)
    watch: CompileWatch | None = None  # its compiled path's recompiles since the verdict (runtime.guards.recompile_watch)
    rescue: graph_pool.GradRescue | None = None  # its gradients and CUDA graphs' pool, learned from every call


class RootPaths:
    """The decisions that change a root's path once a trial or a re-measurement has spoken.

    Session holds one and calls it; what it reads and writes is declared here: the session's roots, the verdict
    cache, the report, the trial settings and clock (for the re-measurements and eager trials it starts), the
    configuration, loss scaling (paused while everything runs FP32) and `forget` (a module left as written drops
    out of the layout tuning). It also owns the bookkeeping of its moves: the trials still running (`unfinished`,
    reported if the script ends first), the latest re-measurement (`confirming`) and a CUDA graph pool on its way
    back (`releasing`)."""

    def __init__(self, roots: "weakref.WeakKeyDictionary[nn.Module, Root]", cache: VerdictCache, recorder: Recorder,
                 trial_config: TrialConfig, clock: Callable[[], float], config: AutoMPConfig, scaling: Scaling,
                 forget: Callable[[nn.Module], None] = lambda module: None,
                 fp32_rate: Callable[[torch.device], float | None] | None = None,
                 memory: Callable[[torch.device], DeviceMemory | None] = cuda_memory) -> None:
        self.roots, self.cache, self.recorder = roots, cache, recorder
        self.fp32_rate = fp32_rate  # a device's fastest FP32 GEMM TFLOP/s (automp.runtime.fp32_bound); None: no bound
        self.trial_config, self.clock, self.config, self.scaling, self.forget = (trial_config, clock, config,
                                                                                  scaling, forget)
        self.unfinished: dict[Trial, list[str]] = {}  # labels of modules in trials still running
        self.confirming: Trial | None = None  # the latest re-measurement (trial.confirmation), for roots to join
        self.releasing: graph_pool.Releasing | None = None  # CUDA graphs' pool automp left, until it is given back
        self.trial: Trial | None = None  # the trial new roots join while it runs
        self.memory = memory  # a device's memory figures, for the trials' budgets (guards.memory_budget)
        self.budgets: dict[Trial, MemoryBudget] = {}  # the eager candidates' memory budget of each GPU trial

    def start(self, root: Root, cached: Verdict | None, candidates: list[Route], why: str) -> None:
        """A new root's first path: its cached verdict (re-measured in steady state where it has to be), its only
        candidate, or a trial of its candidates, joined with the other new roots' while that trial has the same."""
        if cached is not None:
            if cached.detach:  # what the run that measured it learned the script does not read
                root.fields.detach, root.fields.decided = cached.detach, True
            self.decide(root, cached)
            self.confirm([root], cached, None)
            return
        if len(candidates) > 1:  # a new trial may run fp16: scaling paused for FP32 is needed again
            self.scaling.resume()
        if len(candidates) == 1:
            verdict = Verdict(candidates[0], why, {}, rule=ONLY_CANDIDATE)
            self.decide(root, verdict)
            self.cache.put({root.key: verdict})
            return
        if self.trial is None or self.trial.verdict is not None or self.trial.candidates != candidates:
            memory = self.memory(root.device)
            self.trial = Trial(candidates, for_ranks(self.trial_config), self.clock, sync_for(root.device), note=why,
                               later=RECORD_LAST, floor=self._floor(root, candidates),
                               peak=memory.peak if memory is not None else None, saving_ms=root.fp8_saving_ms)
            self.unfinished[self.trial] = []
            if (memory is not None and Route.COMPILED_AUTOCAST in candidates and set(EAGER_PATHS) & set(candidates)
                    and not distributed()):  # ranks must take the same turns: no rank leaves a candidate alone
                self.budgets[self.trial] = MemoryBudget(memory)
        root.trial = self.trial
        self.unfinished[self.trial].append(root.label)

    def settle(self, trial: Trial) -> None:
        self.unfinished.pop(trial, None)
        self.budgets.pop(trial, None)
        members = [r for r in self.roots.values() if r.trial is trial and r.path is None]
        self.confirm(members, self._conclude(members, trial), trial)

    def _conclude(self, members: list[Root], trial: Trial) -> Verdict:
        """A trial's (or re-measurement's) verdict for its members, rank 0's under DDP, decided and cached."""
        verdict = agreed(trial.verdict) if any(r.lockstep for r in members) else trial.verdict
        for root in members:
            self.decide(root, verdict)
        self._remember(members, verdict)
        return verdict

    def _remember(self, members: list[Root], verdict: Verdict) -> None:
        """The verdict in the cache, one entry per module: the fields a module's script leaves unread are its own."""
        self.cache.put({r.key: replace(verdict, detach=r.fields.detach) for r in members})

    def confirm(self, members: list[Root], verdict: Verdict, after: Trial | None) -> None:
        """Start the verdict's re-measurement in steady state (trial.confirmation), if it has one. Modules whose
        cached verdicts arrive together (a GAN's, settled by one trial in an earlier run) join one re-measurement
        while it has timed nothing yet, as new modules join one trial: every iteration then runs one path."""
        if not members:
            return
        trial = confirmation(verdict, for_ranks(self.trial_config), self.clock, sync_for(members[0].device), after)
        pending = self.confirming
        if (trial is not None and after is None and pending is not None and pending.verdict is None
                and pending.candidates == trial.candidates and not any(pending.samples.values())):
            trial = pending
        if trial is not None:
            self.confirming = trial
        for root in members:
            root.confirm = trial

    def confirmed(self, trial: Trial) -> None:
        """The re-measurement is in: its winner runs from now on, and the cache keeps the confirmed verdict."""
        members = [r for r in self.roots.values() if r.confirm is trial]
        for root in members:
            root.confirm = None
        self._conclude(members, trial)

    def decide(self, root: Root, verdict: Verdict) -> None:
        root.path, root.trial, root.verdict = verdict.path, None, verdict
        # under DDP every rank must run the same path: a rank's own compile times are not a shared verdict
        root.watch = None if root.lockstep else watch_for(verdict, self.trial_config.churn)
        # the compiled paths that lost: their graphs (and whatever device memory they hold) go with them
        # (not when the winner is graphed too: the graphed paths of a root share one pool, which torch gives back
        # only by resetting every tree, the winner's included)
        left = [] if root.path in GRAPHED_PATHS else [built(root, p) for p in GRAPHED_PATHS
                                                       if built(root, p) is not None]
        if root.path in GRAPHED_PATHS and built(root, root.path) is not None:  # won a trial it ran in
            compiled_paths.release_cached(root.device)
        for path, attribute in BUILT.items():
            if root.path is not path:
                setattr(root, attribute, None)
        for graphed in left:
            self.release_graphs(graphed.pool)
        self.recorder.add_choice(root.label, verdict.as_dict(), verdict.reason)
        self._pause_scaling_if_fp32()

    def give_up_compiled(self, root: Root, watch: CompileWatch) -> None:
        """Its compiled path recompiled more than it saved (automp.runtime.guards.recompile_watch): the eager path it beat
        from now on, and in the cache, so the next run does not compile it."""
        verdict = watch.verdict(root.verdict)
        self.decide(root, verdict)
        self._remember([root], verdict)

    def check_graphs_fit(self, root: Root) -> None:
        """Before CUDA graphs are built in a trial: the script's memory so far must leave room for their pool, and the
        step must leave the host launch work for them to take away (Trial.launch_bound). Where they do not, graphs
        built for the trial's early warm-up go, with their pool."""
        root.trial.graphs_checked = True
        memory = compiled_paths.device_memory(root.device)
        why = (None if memory is None else compiled_paths.graphs_fit(*memory)) or root.trial.launch_bound()
        if why is not None:
            self._drop_graphs(root, why)
        else:
            compiled_paths.release_cached(root.device)

    def graphs_for_one_module(self) -> None:
        """CUDA graphs only while automp runs a single module. Cudagraph trees start a new generation of their
        memory at a compiled call after a backward: a GAN's discriminator backward, then its call on the generator's
        output, freed the generator's saved activations before the generator's backward (the zoo's DCGAN crashed on
        "accessing tensor output of CUDAGraphs that has been overwritten"). So a second
        module that automp runs takes CUDA graphs out of every trial, and a module already on them moves to the same
        graphs without them (a forced path stays)."""
        roots = [r for r in self.roots.values() if r.aside is None]
        if len(roots) < 2:
            return
        why = (f"{Route.GRAPHED.value} not for a script whose modules ({', '.join(r.label for r in roots)}) run under "
               f"automp together: CUDA graph memory of one module is reused when another's backward runs")
        for root in roots:  # a re-measurement of a graphed verdict ends with leave_graphs
            if root.trial is not None and root.trial.verdict is None and GRAPHED_PATHS & set(root.trial.alive):
                self._without_graphs(root.trial, why)
            if root.path in GRAPHED_PATHS and forced(self.config) is None:
                self.leave_graphs(root, why)

    def check_early_pool(self, root: Root) -> None:
        """Right after the graphs' early warm-up (TrialConfig.early_warmup), before any other candidate: its pool stays
        reserved beside them until the graphs record (compiled_paths.early_pool_fits). Where another candidate's step
        would not fit beside it, the graphs go now, their pool given back with the gradients it holds copied out
        first (BENCHMARKS.md: a script near the card's limit ran out of memory in its next candidate beside that
        pool)."""
        root.trial.pool_checked = True
        why = compiled_paths.early_pool_fits(root.device)
        if why is not None:
            self._drop_graphs(root, why)

    def _drop_graphs(self, root: Root, why: str) -> None:
        """The trial goes on without CUDA graphs; graphs built for its early warm-up go, with their pool (the
        gradients in it copied out first, so that it can be given back at once)."""
        root.trial.graphs_checked = True
        graphed = [g for g in (built(root, p) for p in GRAPHED_PATHS) if g is not None]
        if graphed and root.rescue is not None:
            root.rescue.evacuate()
        self._without_graphs(root.trial, why)
        for path in GRAPHED_PATHS:
            setattr(root, BUILT[path], None)
        if graphed:  # one pool for all of a root's graphed paths
            graphed[0].pool.seen()  # the warm-up's backward graph, compiled after its call: automp's own
            self.release_graphs(graphed[0].pool)

    @staticmethod
    def _without_graphs(trial: Trial, why: str) -> None:
        """Out of a trial go its CUDA graphs; where they are all it has (the FP8 step against its bf16 twin), the
        same graphs without them take their place."""
        if set(trial.alive) <= GRAPHED_PATHS:
            trial.substitute(WITHOUT_GRAPHS, why)
        else:
            trial.exclude(GRAPHED_PATHS, why)

    def leave_graphs(self, root: Root, why: str | None = None) -> None:
        """A training call on CUDA graphs compiled a new graph after the verdict: the module meets new input shapes
        (padded batches of another length, a last short batch), and each shape would be recorded again, with memory
        of its own. The same graphs without CUDA graphs from now on, and in the cache. `why`: another reason."""
        old = root.verdict
        why = why or (f"{Route.GRAPHED.value} recompiled after its verdict (new input shapes): CUDA graphs would be "
                      f"recorded again for every shape, so it runs without them")
        self.move(root, Verdict(WITHOUT_GRAPHS.get(root.path, Route.COMPILED_AUTOCAST), f"{why} ({old.reason})",
                                dict(old.timings_ms), rule=GRAPHS_OFF, bounds=dict(old.bounds)))

    def move(self, root: Root, verdict: Verdict) -> None:
        """Off its path after the verdict, for good: `verdict` from now on, no re-measurement, and in the cache."""
        root.confirm = None
        self.decide(root, verdict)
        self._remember([root], verdict)

    def release_graphs(self, pool: graph_pool.PoolRelease, last: bool = False) -> None:
        self.releasing = graph_pool.Releasing(pool, self.recorder.add_setting).retry(last)

    def retry_release(self, last: bool = False) -> None:
        """Ask again for the CUDA graph pool automp left (at each module call; `last`: at uninstall, where whatever
        still replays automp's graphs stops too)."""
        graphed = next((g for r in self.roots.values() for g in (r.graphed, r.fp8_graphed) if g is not None),
                       None) if last else None
        if graphed is not None:
            self.release_graphs(graphed.pool, last=True)
        elif self.releasing is not None:
            self.releasing = self.releasing.retry(last)

    def report_unsettled(self) -> None:
        """Trials and re-measurements the script ended (or the module was freed) before: what they had measured."""
        for trial, labels in self.unfinished.items():
            timings = {p.value: 1e3 * min(s) for p, s in trial.samples.items() if s}
            bounds = {"bounds": dict(trial.bounds)} if trial.bounds else {}
            for label in labels:
                self.recorder.add_choice(label, {"path": "unsettled", "rule": UNSETTLED, "timings_ms": timings,
                                                 "cached": False, **bounds},
                                         f"trial unfinished: the script ended (or the module was freed) before its "
                                         f"candidates were measured; it ran {trial.current.value} last")
        for root in self.roots.values():  # the script ended before the verdict was re-measured: it stands as is
            if root.confirm is not None and root.verdict is not None:
                self.recorder.add_choice(root.label, {**root.verdict.as_dict(), "confirm_unfinished": True},
                                         f"{root.verdict.reason}; not "
                                         f"re-measured in steady state: the script ended first")

    def _floor(self, root: Root, candidates: list[Route]) -> Fp32Floor | None:
        """The lower bound that may rule FP32 eager out of a trial before it runs (automp.runtime.fp32_bound): where
        low precision eager, which it is counted on, is a candidate too, and the device has a calibrated FP32 rate.
        Not under torch.distributed, where no candidate is dropped early (ranks.for_ranks)."""
        bounded = (self.fp32_rate is not None and {Route.FP32, Route.EAGER_LOW} <= set(candidates)
                   and not distributed())
        rate = self.fp32_rate(root.device) if bounded else None
        return Fp32Floor(rate) if rate else None

    def _pause_scaling_if_fp32(self) -> None:
        """Loss scaling exists for fp16 gradients. Once every module runs FP32 (its measured winner) there are none,
        and scaling would only add kernels to every backward — on a launch-bound script, a slowdown automp chose.
        A module that appears later and needs a trial brings it back (Session._new_root)."""
        if not self.scaling.on or any(r.aside is None and r.path is not Route.FP32 for r in self.roots.values()):
            return  # some module runs (or may run, mid-trial) in low precision
        self.recorder.add_fallback("loss scaling", "off: every module runs FP32, no fp16 gradients to protect",
                                   SCALING_PAUSED)
        self.scaling.pause()

    def step_aside(self, root: Root, why: str, rule: str) -> None:
        """The module runs as written from now on. `rule` says why, for reports and tools to key on (ASIDE)."""
        if root.trial is not None:  # it joined a trial at its first call: it is no longer waiting for a verdict
            waiting = self.unfinished.get(root.trial, [])
            if root.label in waiting:
                waiting.remove(root.label)
        root.aside, root.path, root.trial, root.confirm, root.watch = why, None, None, None, None
        for module in [m for m, r in self.roots.items() if r is root]:
            self.forget(module)
        self.recorder.add_choice(root.label, as_written(rule), why)
        self.scaling.hand_over(stop=rule == SCRIPTS_AUTOCAST)

    def trial_call(self, root: Root, run: Callable[[Route], Any], module: nn.Module | None = None) -> Any:
        """run(path) for a call of `module` while the root's trial runs. A candidate that runs out of device memory in
        it, or past the trial's memory budget (over_budget), leaves the trial and the call runs again on the next one
        (out_of_memory), so the script loses no step: the error came before the call returned, so nothing of it
        reached the script's autograd graph or its optimizer. What the failed call held is collected once the error
        is gone (its traceback holds the call's frames, and their reference cycles need a collection), before the
        call runs again."""
        budget = self.budgets.get(root.trial) if root.trial is not None else None
        while True:
            path = root.trial.current if root.path is None else root.path
            try:
                if budget is None or root.path is not None:
                    return run(path)
                budget.begin(path)
                with budget.guard(path, module):
                    out = run(path)
                budget.returned(path, out)
                return out
            except torch.OutOfMemoryError as e:
                if budget is not None:
                    budget.cancel()
                if root.path is not None or not self.out_of_memory(root, path, e):
                    raise
            except OverBudget as e:
                budget.cancel()
                self.over_budget(root, path, e, budget)
            gc.collect()
            compiled_paths.release_cached(root.device)

    def over_budget(self, root: Root, path: Route, error: OverBudget, budget: MemoryBudget) -> None:
        """An eager candidate held more memory in its first forward than the anchor's whole iteration
        (automp.runtime.guards.memory_budget): it leaves the trial, and the report says by how much. Where it cannot
        leave for a compiled candidate (the trial's last candidate, or only eager ones left: FP32 eager holds more
        than low precision eager), the budget is off and the call runs again as it was: a budget must never cost the
        script a step or an error of automp's own. (Under torch.distributed no trial has a budget: `start`.)"""
        trial = root.trial
        if trial is None or trial.verdict is not None or path not in trial.alive \
                or all(p in EAGER_PATHS for p in trial.alive if p is not path):
            budget.limit = None
            return
        why = f"{error}, the peak of {Route.COMPILED_AUTOCAST.value}'s iteration (the hand-written loop's path)"
        trial.bounds[path.value] = {"rule": TRIAL_OVER_MEMORY, "held_gib": gib(error.used), **(budget.record or {})}
        trial.exclude({path}, why)
        self.recorder.add_fallback(root.label, why, TRIAL_OVER_MEMORY)
        notice(f"automp: {root.label}: {why}; the trial goes on without it")
        if trial.verdict is not None:
            self.settle(trial)

    def out_of_memory(self, root: Root, path: Route, error: BaseException) -> bool:
        """A trial's candidate ran out of device memory in a call: it leaves the trial, what it built is dropped and
        the device's cached blocks go back, so that the call can run again on the next candidate (True). False where
        the error is the script's to see: the trial has no other candidate, or the module runs in lockstep on several
        ranks, whose trials must take the same turns on every rank (one rank alone leaving a candidate would stall
        the others in their collectives). Where CUDA graphs were warmed up early (TrialConfig.early_warmup) and not
        yet checked, their pool is what this candidate ran out of memory beside: the graphs leave instead, and the
        call runs again on the same candidate."""
        trial = root.trial
        if trial is None or trial.verdict is not None or path not in trial.alive or len(trial.alive) < 2 \
                or root.lockstep:
            return False
        asked = oom_size(error)
        why = f"{path.value} ran out of device memory in the trial{f' (it asked for {asked} more)' if asked else ''}"
        early = [p for p in GRAPHED_PATHS if built(root, p) is not None and p is not path]
        if early and not trial.graphs_checked:  # beside the pool of the graphs' early warm-up: they leave first
            why = f"{why}, beside the CUDA graph pool of {early[0].value}'s warm-up"
            self._drop_graphs(root, why)
            without = "CUDA graphs"
        else:
            trial.exclude({path}, why)
            without = "it"
        self.recorder.add_fallback(root.label, why, TRIAL_OOM)
        notice(f"automp: {root.label}: {why}; the trial goes on without {without}")
        if path in BUILT and path not in trial.alive:  # no reference to its compiled function outlives this
            pool = getattr(built(root, path), "pool", None)
            setattr(root, BUILT[path], None)
            if pool is not None:
                self.release_graphs(pool)
        if trial.verdict is not None:
            self.settle(trial)
        return True

    def keep_eager(self, root: Root, why: str = input_grads.REASON, rule: str = INPUT_GRADS) -> None:
        """Off the compiled paths for good (automp.runtime.guards.input_grads; calls inside torch.func transforms,
        `rule` FUNCTORCH): out of its trial, or onto a new trial of the eager paths if a compiled one had won (or
        straight to low precision eager where the configuration forced one)."""
        root.eager_only = True
        self.recorder.add_fallback(root.label, why, rule)
        if root.path is None:
            root.trial.exclude(COMPILED_PATHS, f"{root.label} {why}")
            if root.trial.verdict is not None:
                self.settle(root.trial)
            return
        if root.path not in COMPILED_PATHS:
            return
        root.confirm = None
        if forced(self.config) is not None:
            self.decide(root, Verdict(Route.EAGER_LOW, f"path forced by configuration, but {why}", {}, rule=rule))
            return
        eager = [Route.EAGER_LOW, Route.FP32]
        root.trial = Trial(eager, for_ranks(self.trial_config), self.clock, sync_for(root.device), note=why,
                           floor=self._floor(root, eager))
        root.path, root.compiled, root.stock, root.watch = None, None, None, None
        self.unfinished[root.trial] = [root.label]


def as_written(rule: str) -> dict[str, Any]:
    """A report choice for a module automp leaves as written."""
    return {"path": "as-written", "timings_ms": {}, "cached": False, "rule": rule}


BUILT = {Route.COMPILED: "compiled", Route.COMPILED_AUTOCAST: "stock", Route.GRAPHED: "graphed",
         Route.FP8_COMPILED: "fp8_stock", Route.FP8_GRAPHED: "fp8_graphed"}  # Root's field


def built(root: Root, path: Route) -> Callable[..., Any] | None:
    """The compiled function of `path` (a compiled path), once built."""
    return getattr(root, BUILT[path])


def sync_for(device: torch.device) -> Callable[[], None]:
    """What a trial on `device` waits for the device with."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
