"""A root module's path over a run: the verdict of its trial, the re-measurement in steady state, and the moves
off a path afterwards (recompiles, CUDA graphs that no longer fit the script, every module on FP32, gradients
with respect to inputs, a script that manages precision itself).

`RootPaths` is the part of `automp.runtime.session.Session` that changes a root's path once a trial or a re-measurement has
spoken: everything here reads and writes the session's roots, cache and report, and nothing here runs a module.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from automp.runtime import compiled_paths, graph_pool, input_grads
from automp.runtime.trial import COMPILED_PATHS, Path, Trial, Verdict, agreed, confirmation, for_ranks
from automp.runtime.recompile_watch import CompileWatch, watch_for
from automp.runtime.unread_outputs import FieldReads


@dataclass
class Root:
    """One root module's state: its path (or trial), the compiled callables it may run, and why automp left it."""

    label: str
    device: torch.device
    low: torch.dtype
    key: str = ""
    path: Path | None = None  # None while its trial runs
    trial: Trial | None = None
    verdict: Verdict | None = None  # what decided its path
    confirm: Trial | None = None  # the verdict's re-measurement in steady state, while it runs (choose.confirmation)
    compiled: Callable[..., Any] | None = None
    stock: Callable[..., Any] | None = None  # stock Inductor, run under autocast (Path.COMPILED_AUTOCAST)
    graphed: Callable[..., Any] | None = None  # the same, replayed as CUDA graphs (Path.GRAPHED)
    graphs: int = 0  # graphs compiled for this root (recompiles included)
    aside: str | None = None  # why automp leaves this module as written
    fields: FieldReads = field(default_factory=FieldReads)  # its output fields the script reads (unread_outputs)
    params: list[torch.Tensor] | None = None  # its parameters, for the eager path's shared weight casts
    lockstep: bool = False  # called by every rank at once (a DDP module): its verdicts are rank 0's (choose.agreed)
    eager_only: bool = False  # the script takes gradients with respect to its input (automp.runtime.input_grads)
    watch: CompileWatch | None = None  # its compiled path's recompiles since the verdict (automp.runtime.recompile_watch)


class RootPaths:
    """Session's path decisions (a mixin: the attributes it uses are Session's fields)."""

    def _settle(self, trial: Trial) -> None:
        self.unfinished.pop(trial, None)
        members = [r for r in self.roots.values() if r.trial is trial and r.path is None]
        self._confirm(members, self._conclude(members, trial), trial)

    def _conclude(self, members: list[Root], trial: Trial) -> Verdict:
        """A trial's (or re-measurement's) verdict for its members, rank 0's under DDP, decided and cached."""
        verdict = agreed(trial.verdict) if any(r.lockstep for r in members) else trial.verdict
        for root in members:
            self._decide(root, verdict)
        self._remember(members, verdict)
        return verdict

    def _remember(self, members: list[Root], verdict: Verdict) -> None:
        """The verdict in the cache, one entry per module: the fields a module's script leaves unread are its own."""
        self.cache.put({r.key: replace(verdict, detach=r.fields.detach) for r in members})

    def _confirm(self, members: list[Root], verdict: Verdict, after: Trial | None) -> None:
        """Start the verdict's re-measurement in steady state (choose.confirmation), if it has one. Modules whose
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

    def _confirmed(self, trial: Trial) -> None:
        """The re-measurement is in: its winner runs from now on, and the cache keeps the confirmed verdict."""
        members = [r for r in self.roots.values() if r.confirm is trial]
        for root in members:
            root.confirm = None
        self._conclude(members, trial)

    def _decide(self, root: Root, verdict: Verdict) -> None:
        root.path, root.trial, root.verdict = verdict.path, None, verdict
        # under DDP every rank must run the same path: a rank's own compile times are not a shared verdict
        root.watch = None if root.lockstep else watch_for(verdict, self.trial_config.churn)
        # the compiled paths that lost: their graphs (and whatever device memory they hold) go with them
        left = root.graphed if root.path is not Path.GRAPHED else None
        if root.path is Path.GRAPHED and root.graphed is not None:  # won a trial it ran in
            compiled_paths.release_cached(root.device)
        for path, attribute in BUILT.items():
            if root.path is not path:
                setattr(root, attribute, None)
        if left is not None:
            self._release_graphs(left.pool)
        self.recorder.add_choice(root.label, verdict.as_dict(), verdict.reason)
        self._pause_scaling_if_fp32()

    def _give_up_compiled(self, root: Root, watch: CompileWatch) -> None:
        """Its compiled path recompiled more than it saved (automp.runtime.recompile_watch): the eager path it beat from now
        on, and in the cache, so the next run does not compile it."""
        verdict = watch.verdict(root.verdict)
        self._decide(root, verdict)
        self._remember([root], verdict)

    def _check_graphs_fit(self, root: Root) -> None:
        """Before CUDA graphs are built in a trial: the script's memory so far must leave room for their pool."""
        memory = compiled_paths.device_memory(root.device)
        why = None if memory is None else compiled_paths.graphs_fit(*memory)
        if why is not None:
            root.trial.exclude({Path.GRAPHED}, why)
        else:
            compiled_paths.release_cached(root.device)

    def _graphs_for_one_module(self) -> None:
        """CUDA graphs only while automp runs a single module. Cudagraph trees start a new generation of their
        memory at a compiled call after a backward: a GAN's discriminator backward, then its call on the generator's
        output, freed the generator's saved activations before the generator's backward (an H100 run of the zoo's
        DCGAN crashed on "accessing tensor output of CUDAGraphs that has been overwritten", BENCHMARKS.md, fourth
        session). So a second module that automp runs takes CUDA graphs out of every trial, and a module already on
        them moves to the same graphs without them (a forced path stays)."""
        roots = [r for r in self.roots.values() if r.aside is None]
        if len(roots) < 2:
            return
        why = (f"{Path.GRAPHED.value} not for a script whose modules ({', '.join(r.label for r in roots)}) run under "
               f"automp together: CUDA graph memory of one module is reused when another's backward runs")
        for root in roots:  # a re-measurement of a graphed verdict ends with _leave_graphs
            if root.trial is not None and root.trial.verdict is None and Path.GRAPHED in root.trial.alive:
                root.trial.exclude({Path.GRAPHED}, why)
            if root.path is Path.GRAPHED and self.config.forced_path is None:
                self._leave_graphs(root, why)

    def _leave_graphs(self, root: Root, why: str | None = None) -> None:
        """A training call on CUDA graphs compiled a new graph after the verdict: the module meets new input shapes
        (padded batches of another length, a last short batch), and each shape would be recorded again, with memory
        of its own. The same graphs without CUDA graphs from now on, and in the cache. `why`: another reason."""
        old = root.verdict
        why = why or (f"{Path.GRAPHED.value} recompiled after its verdict (new input shapes): CUDA graphs would be "
                      f"recorded again for every shape, so it runs without them")
        verdict = Verdict(Path.COMPILED_AUTOCAST, f"{why} ({old.reason})", dict(old.timings_ms))
        root.confirm = None
        self._decide(root, verdict)
        self._remember([root], verdict)

    def _release_graphs(self, pool: graph_pool.PoolRelease, last: bool = False) -> None:
        self.releasing = graph_pool.Releasing(pool, self.recorder.add_setting).retry(last)

    def _pause_scaling_if_fp32(self) -> None:
        """Loss scaling exists for fp16 gradients. Once every module runs FP32 (its measured winner) there are none,
        and scaling would only add kernels to every backward — on a launch-bound script, a slowdown automp chose.
        A module that appears later and needs a trial brings it back (see _new_root)."""
        if self.scaler is None or any(r.aside is None and r.path is not Path.FP32 for r in self.roots.values()):
            return  # some module runs (or may run, mid-trial) in low precision
        self.recorder.loss_scale = self.scaler.summary()
        self.recorder.add_fallback("loss scaling", "off: every module runs FP32, no fp16 gradients to protect")
        self._stop_scaling()
        self.scaling_paused = True

    def _stop_scaling(self) -> None:
        """Loss scaling's autograd hooks off, where they are on."""
        if self.scaler is not None:
            from automp.scaling import autograd_hook
            autograd_hook.uninstall()
            self.scaler = None

    def _step_aside(self, root: Root, why: str, user_precision: bool = False) -> None:
        if root.trial is not None:  # it joined a trial at its first call: it is no longer waiting for a verdict
            waiting = self.unfinished.get(root.trial, [])
            if root.label in waiting:
                waiting.remove(root.label)
        root.aside, root.path, root.trial, root.confirm, root.watch = why, None, None, None, None
        if self.layout is not None:
            for module in [m for m, r in self.roots.items() if r is root]:
                self.layout.forget(module)
        self.recorder.add_choice(root.label, None, why)
        self.scaling_paused = False  # never bring scaling back on top of the script's own
        if user_precision:
            self._stop_scaling()

    def _eager_only(self, root: Root) -> None:
        """Off the compiled paths for good (automp.runtime.input_grads): out of its trial, or onto a new trial of the eager
        paths if a compiled one had won (or straight to low precision eager where the configuration forced one)."""
        root.eager_only = True
        self.recorder.add_fallback(root.label, input_grads.REASON)
        if root.path is None:
            root.trial.exclude(COMPILED_PATHS, f"{root.label} {input_grads.REASON}")
            if root.trial.verdict is not None:
                self._settle(root.trial)
            return
        if root.path not in COMPILED_PATHS:
            return
        root.confirm = None
        if self.config.forced_path is not None:
            self._decide(root, Verdict(Path.EAGER_LOW, f"path forced by configuration, but {input_grads.REASON}", {}))
            return
        root.trial = Trial([Path.EAGER_LOW, Path.FP32], for_ranks(self.trial_config), self.clock, sync_for(root.device),
                           note=input_grads.REASON)
        root.path, root.compiled, root.stock, root.watch = None, None, None, None
        self.unfinished[root.trial] = [root.label]


BUILT = {Path.COMPILED: "compiled", Path.COMPILED_AUTOCAST: "stock", Path.GRAPHED: "graphed"}  # Root's field


def built(root: Root, path: Path) -> Callable[..., Any] | None:
    """The compiled function of `path` (a compiled path), once built."""
    return getattr(root, BUILT[path])


def sync_for(device: torch.device) -> Callable[[], None]:
    """What a trial on `device` waits for the device with."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
