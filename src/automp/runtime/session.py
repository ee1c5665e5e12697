"""An enabled automp: what it installed (with the undo of each change), the root modules it has seen, and how
each of them runs.

Every top-level call of a module with parameters (a "root": the model, a GAN's generator or discriminator) goes
through `Session.call`. Nested modules are part of their root's graph and are never roots themselves. A root runs
on one `Route` (trial.py): chosen by a short timed trial, read from the verdict cache, forced by the config, or the
script as written when automp has to step aside (the script manages precision itself with torch.autocast, or the
model is already half precision). Every such choice lands in the report with its reason. What changes a root's
path once a trial has spoken is automp.runtime.paths.RootPaths, which the session holds.

The trial's collaborators are passed in, not reached through globals: `candidates` (which paths a device can win
on), `clock`, `cache` (the verdicts) and `fp32_rate` (what bounds FP32 eager, automp.runtime.fp32_bound). A test
injects its own through `open_session`, the factory `automp.enable()` and `automp.compile()` call.
"""
from __future__ import annotations

import time
import weakref
from functools import partial
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from automp.config import AutoMPConfig
from automp.precision import cost
from automp.precision.capture import make_backend, traceable_attention
from automp.precision.paint import PrecisionConfig
from automp.runtime import call_state, compiled_paths, graph_pool, starts
from automp.runtime.guards import input_grads, rnn
from automp.runtime.guards.oom import oom_cause
from automp.runtime.fp8_layers import Fp8Layers
from automp.runtime.guards.graph_breaks import graph_breaks, report_graph_breaks
from automp.runtime.guards.once_logging import ignore_once_logging
from automp.runtime.progress import trial_status
from automp.runtime.outputs import is_lazy_candidate, restore_float32, restore_lazily
from automp.runtime.paths import BUILT, Root, RootPaths, as_written, built
from automp.runtime.starts import CalibratedCandidates, Candidates
from automp.runtime.report import Recorder, dtype_name
from automp.runtime.decisions import (COMPILE_FAILED, COMPILED_PATHS, DOUBLE_BACKWARD, EAGER_PATHS, FP8_PATHS,
                                      FUNCTORCH, GRAPHED_PATHS, HALF_MODEL, IN_TRANSFORM, NO_ROOTS, SCRIPTS_AUTOCAST,
                                      Route, Verdict, forced)
from automp.runtime.trial import TrialConfig
from automp.runtime.ranks import lockstep
from automp.runtime.tuning.allocator import ExpandableSegments
from automp.runtime.tuning.conv_layout import LayoutTuning
from automp.runtime.tuning.conv_tuning import ConvTuning
from automp.runtime.tuning.fused_optimizers import OptimizerFuser
from automp.runtime.tuning.weight_casts import SharedCasts
from automp.runtime.guards.memory_budget import DeviceMemory, cuda_memory
from automp.runtime.guards.unread_outputs import FieldWatch, guess_unread
from automp.runtime.verdicts import VerdictCache, module_key
from automp.scaling import Scaling
from automp.world import distributed

ORIG_CALL = compiled_paths.ORIG_CALL
_NO_ROOTS = ("no module with parameters was called as `model(x)` while automp was on, so nothing ran in low "
             "precision: automp works through nn.Module calls (a script calling `model.forward(x)` runs as written)")


class Session:
    """One enabled automp. `install()` makes every change to torch and the process, each registered with its undo
    where it is made; `uninstall()` runs those undos in reverse, so nothing automp changed outlives it."""

    def __init__(self, config: AutoMPConfig, recorder: Recorder | None = None, *, candidates: Candidates | None = None,
                 clock: Callable[[], float] = time.perf_counter, cache: VerdictCache | None = None,
                 trial_config: TrialConfig | None = None, allocator: ExpandableSegments | None = None,
                 fp8: Fp8Layers | None = None, fp32_rate: Callable[[torch.device], float | None] | None = None,
                 memory: Callable[[torch.device], DeviceMemory | None] = cuda_memory) -> None:
        self.config = config
        self.recorder = recorder if recorder is not None else Recorder()
        self.candidates = candidates or CalibratedCandidates(config.cache_dir)
        self.clock = clock
        self.cache = cache if cache is not None else VerdictCache(config.cache_dir)
        self.trial_config = trial_config or TrialConfig()
        self.allocator = allocator or ExpandableSegments()  # process-wide: restored at uninstall
        # dtype="fp8": the FP8 layers of each root and the loss watch (injectable: a CPU test emulates the device)
        self.fp8 = (fp8 or Fp8Layers(config, self.recorder)) if config.dtype == "fp8" else None
        self.roots: weakref.WeakKeyDictionary[nn.Module, Root] = weakref.WeakKeyDictionary()
        self.scaling = Scaling(config, lambda summary: setattr(self.recorder, "loss_scale", summary))
        self.paths = RootPaths(self.roots, self.cache, self.recorder, self.trial_config, clock, config, self.scaling,
                               forget=self._forget_layout,
                               # injected candidates without a rate (a test's): no bound
                               fp32_rate=fp32_rate or getattr(self.candidates, "fp32_tflops", None), memory=memory)
        self.labels: dict[str, int] = {}
        self.breaks_before: dict[str, int] = {}
        self.casts = SharedCasts()  # the eager path's weight casts, kept across calls
        self.layout: LayoutTuning | None = None  # channels_last for eager convolutions, measured once paths are chosen
        self.tuning: ConvTuning | None = None  # cuDNN's benchmark mode, measured after the layout
        self._undo: list[Callable[[], None]] = []
        self._scaling_undo = self._logging_undo = self._released = False
        self._in_transform: set[str] = set()  # roots whose calls ran inside a torch.func transform (_ran)
        self.status = trial_status(config)  # the live line on a terminal while a trial runs (runtime.progress)

    # -- install / uninstall --------------------------------------------------------------------------------------
    def install(self) -> None:
        if self.fp8 is not None:
            self.fp8.require()  # before anything is changed: a machine without FP8 fails in one line
            self._undo.append(self.fp8.uninstall)
        self.allocator.turn_on(self.recorder.add_setting)  # first: before anything allocates device memory
        self._undo.extend((self.allocator.restore, self.status.stop))
        if self.config.fuse_optimizers:  # before loss scaling's step hook, which asks whether a step is fused
            fuser = OptimizerFuser(self._fused, lambda: self.scaling.on)
            fuser.install()
            self._undo.append(fuser.uninstall)
        self.install_scaling()
        step_hook = register_optimizer_step_pre_hook(lambda *_: self.casts.clear())  # a step makes casts stale
        self._undo.append(lambda: (step_hook.remove(), self.casts.clear()))
        if self.config.tune_layout:
            self.layout = LayoutTuning(self.trial_config, self.clock, self.cache, self.recorder.add_setting)
            self._undo.append(lambda: self._restore("layout"))
        if self.config.tune_cudnn:
            self.tuning = ConvTuning(self.trial_config, self.clock, self.cache, self.recorder.add_setting)
            self._undo.append(lambda: self._restore("tuning"))
        self.breaks_before = graph_breaks()
        session = self

        def patched_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # as written, without entering the session: a submodule of a root being run; a call Dynamo traces; a
            # call from inside the backward, i.e. activation checkpointing recomputing a forward, which restores the
            # forward's autocast state itself and must not be taken for the script's own autocast region
            if (getattr(call_state.local, "depth", 0) > 0 or torch.compiler.is_compiling()
                    or torch._C._current_autograd_node() is not None):
                return ORIG_CALL(module, *args, **kwargs)
            return session.call(module, args, kwargs)

        self._replace(nn.Module, "__call__", patched_call)
        self._replace(nn.RNNBase, "__call__", rnn._rnn_call)

    def install_scaling(self, config: AutoMPConfig | None = None) -> None:
        """Loss scaling on where `config` (default: the session's) asks for it; off at uninstall."""
        self.scaling.start(config)
        if not self._scaling_undo:
            self._undo.append(self.scaling.stop)
            self._scaling_undo = True

    def _replace(self, owner: type, name: str, value: Any) -> None:
        """owner.name = value, and its undo: the attribute owner had itself, or none (inherited again)."""
        had, old = name in vars(owner), vars(owner).get(name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    def _restore(self, tuning: str) -> None:
        getattr(self, tuning).restore()
        setattr(self, tuning, None)

    def _forget_layout(self, module: nn.Module) -> None:
        if self.layout is not None:
            self.layout.forget(module)

    def uninstall(self) -> dict[str, Any]:
        self.paths.retry_release(last=True)  # nothing replays automp's CUDA graphs any more
        while self._undo:
            self._undo.pop()()
        self.update_report()
        self.roots.clear()
        return self.recorder.as_dict()

    def update_report(self) -> None:
        if self.scaling.scaler is not None:
            self.recorder.loss_scale = self.scaling.scaler.summary()
        report_graph_breaks(self.recorder, self.roots.values(), self.breaks_before)
        self.recorder.compiles = {r.label: r.graphs for r in self.roots.values() if r.graphs}
        self.recorder.compile_times = {r.label: r.compile_log for r in self.roots.values() if r.compile_log}
        if not self.labels and not any(f["where"] == "modules" for f in self.recorder.fallbacks):
            self.recorder.add_fallback("modules", _NO_ROOTS, NO_ROOTS)
        self.paths.report_unsettled()
        if compiled_paths.UNWRAPPED_FAILED:  # the compiled and graphed paths each compile on their own
            self.recorder.add_setting({"setting": "one compile for the compiled and graphed paths", "value": "off",
                                       "reason": compiled_paths.UNWRAPPED_FAILED[0]})

    def compile(self, model: nn.Module, config: AutoMPConfig) -> nn.Module:
        """automp's compiled pass for one model, no trial (automp.compile), recorded in this session's report; its
        loss scaling, where `config` asks for it, is this session's to remove."""
        self.install_scaling(config)
        device = device_of(model)
        pconfig = PrecisionConfig(dtype=config.low_dtype(device), spec=_spec(config, device))
        return torch.compile(model, backend=make_backend(pconfig, self.recorder, inner=config.inner,
                                                         label=type(model).__name__, debug=config.debug))

    def _fused(self, optimizer: torch.optim.Optimizer, groups: int) -> None:
        self.recorder.optimizers.append({
            "optimizer": type(optimizer).__name__, "groups": groups,
            "change": f"fused=True on {groups} parameter group(s): torch's one-kernel implementation of the same "
                      f"update (the script left fused/foreach at their defaults)"})

    def settled(self) -> bool:
        """Every root runs its final path, and the convolutions' layout and cuDNN's benchmark mode are decided (where
        they will be tried)."""
        return self._layout_settled() and (self.tuning is None or not self.tuning.pending(self._tunable_roots()))

    def _paths_settled(self) -> bool:
        return all((r.path is not None and r.confirm is None) or r.aside is not None for r in self.roots.values())

    def _layout_settled(self) -> bool:
        """The paths, then the layout: cuDNN's flag is timed on the layout that stays."""
        return self._paths_settled() and (self.layout is None or not self.layout.pending(self._tunable_roots()))

    def _tunable_roots(self) -> Iterator[tuple[nn.Module, torch.device, bool]]:
        return ((m, r.device, r.path in EAGER_PATHS) for m, r in list(self.roots.items()) if r.aside is None)

    # -- the call of every module ---------------------------------------------------------------------------------
    def call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """A module called from the script (patched_call has already passed submodules and traced calls through)."""
        self.paths.retry_release()
        root = new = self.roots.get(module)
        if root is None:
            if not any(True for _ in module.parameters()):
                return ORIG_CALL(module, *args, **kwargs)
            root = self._new_root(module, args, kwargs)
        scripts_autocast = torch.is_autocast_enabled(root.device.type)
        if scripts_autocast:
            self.casts.check()  # the script's own region must not find a stale copy automp cached
        if root.aside is None and scripts_autocast:
            self.paths.step_aside(root, "the script runs it under its own torch.autocast: automp leaves precision "
                                        "(and loss scaling) to the script", SCRIPTS_AUTOCAST)
        if root.aside is not None:
            return self._run(module, root, Route.FP32, args, kwargs)  # as written, nested modules included
        if graph_pool.before_call(root, module, self.config.release_grads and _trying(root)) and not self._released:
            self._released = True
            self.recorder.add_setting({"setting": "gradients set to None as a trial's forward starts", "value": "on",
                                       "reason": "the script sets them to None after its forward (zero_grad "
                                                 "before backward): not kept alive beside its activations"})
        if self.fp8 is not None:
            self._fp8_guard(root)
        if new is None:
            self.paths.graphs_for_one_module()
        if not root.eager_only and input_grads.asks_input_grad(args, kwargs):
            self.paths.keep_eager(root)
        elif not root.eager_only and root.path is None and torch._C._functorch.peek_interpreter_stack() is not None:
            self.paths.keep_eager(root, IN_TRANSFORM, FUNCTORCH)  # a compiled candidate would time FP32 eager there
        if root.path is None:
            root.trial.tick(id(module), torch.is_grad_enabled())
            # graphs built by the early warm-up (not by a checked recording): their pool, before anything else runs
            if not (root.trial.pool_checked or root.trial.graphs_checked or root.trial.warming_early) \
                    and any(built(root, p) is not None for p in GRAPHED_PATHS):
                self.paths.check_early_pool(root)
            current = root.trial.current if root.trial.verdict is None else None
            # once per trial, before they record: the graphed paths of a root share one memory pool (cudagraph trees
            # keep one per device); their early warm-up records nothing, and comes before anything was measured
            if current in GRAPHED_PATHS and not root.trial.graphs_checked and not root.trial.warming_early:
                self.paths.check_graphs_fit(root)
            if root.trial.verdict is not None:
                self.paths.settle(root.trial)
        elif root.confirm is not None:
            root.confirm.tick(id(module), torch.is_grad_enabled())
            if root.confirm.verdict is not None:
                self.paths.confirmed(root.confirm)
        self.status.tick(root.label, root.trial if root.path is None else root.confirm)
        if root.path is None:
            return self.paths.trial_call(root, lambda path: self._run(module, root, path, args, kwargs), module)
        path = root.confirm.current if root.confirm else root.path
        eager, layout, tuning = path in EAGER_PATHS, self.layout, self.tuning
        if root.confirm is None:
            if layout is not None and not layout.idle:
                layout.call(module, root.device, root.key, args, kwargs, self._paths_settled, eager)
            if tuning is not None and not tuning.idle:
                tuning.call(module, root.device, root.key, args, kwargs, self._layout_settled, eager)
        if eager and layout is not None and layout.on:
            return layout.run(module, root.device, lambda: self._run(module, root, path, args, kwargs))
        graphed = path in GRAPHED_PATHS and forced(self.config) is None
        if (root.watch is None and not graphed) or root.confirm is not None or not torch.is_grad_enabled():
            return self._run(module, root, path, args, kwargs)
        first = built(root, path) is None  # its first compile is no recompile
        graphs, start = root.graphs, self.clock()
        out = self._run(module, root, path, args, kwargs)
        recompiled = not first and root.graphs > graphs
        if recompiled and graphed:
            self.paths.leave_graphs(root)
        elif not first and root.watch is not None and root.watch.observe(recompiled, self.clock() - start):
            self.paths.give_up_compiled(root, root.watch)
        return out

    def _run(self, module: nn.Module, root: Root, path: Route, args: tuple, kwargs: dict, count: bool = True) -> Any:
        """One call of a root on `path`, counted in the report by the path it really ran (`count`: a call of the
        script's, not automp's own re-run or probe)."""
        # saved and restored, not reset: a re-run (automp.runtime.guards.unread_outputs) may start inside another root's call
        state = call_state.local
        outer = getattr(state, "depth", 0), getattr(state, "path", None), getattr(state, "low", None)
        state.depth, state.path, state.low = 1, path, root.low
        ran = "as-written" if root.aside is not None else self._ran(root, path).value
        phase = "trial" if root.aside is None and _trying(root) else "chosen"
        try:
            if path is Route.FP32:
                return ORIG_CALL(module, *args, **kwargs)
            if path is Route.EAGER_LOW:  # counted in its trial's first warm-up (runtime.fp32_bound)
                forward = partial(self.casts.call, module, root, args, kwargs)
                return self._deliver(root, root.trial.counted(module, forward) if root.trial else forward(), None)
            compiled = built(root, path)
            if compiled is None:
                self._before_compile(root, module, kwargs)
                compiled = (self._compile(module, root) if path is Route.COMPILED else
                            compiled_paths.stock(module, root, path=path,
                                                 rewrite=compiled_paths.rewrites(self.config, self.recorder, root.label)))
                setattr(root, BUILT[path], compiled)
            try:
                with traceable_attention():
                    out = compiled(*args, **kwargs)
                return self._deliver(root, out, lambda: self._run(module, root, path, args, kwargs, count=False))
            except torch._dynamo.exc.TorchDynamoException as e:
                if (oom := oom_cause(e)) is not None and root.path is None:  # out of memory: the trial's to handle
                    raise oom from e
                # automp's own machinery failed while compiling, before any of the user's code ran (Dynamo only
                # traces it): run this module as written from now on and say why. Anything else is the user's
                # own error and propagates once, untouched.
                self.paths.step_aside(root, f"compilation failed, runs as written in FP32: {type(e).__name__}: "
                                            f"{(str(e).strip().splitlines() or [''])[0][:200]}", COMPILE_FAILED)
                ran = "as-written"
        finally:
            state.depth, state.path, state.low = outer
            if count:
                if ran == path.value and path in COMPILED_PATHS and root.graphs == 0:  # Dynamo ran it as written
                    ran = _eager_twin(path).value
                self.recorder.count_call(root.label, phase, ran)
        return ORIG_CALL(module, *args, **kwargs)

    def _ran(self, root: Root, path: Route) -> Route:
        """The path a call on `path` really runs. Inside a torch.func transform (grad, vmap, jacrev), torch.compile
        cannot trace a call made from eager code (Dynamo runs the frame as written, pytorch/pytorch#128711): a
        compiled path runs eagerly there, in FP32 for automp's own pass, under the autocast region around the call
        for the stock ones. The report says so once per module."""
        if path not in COMPILED_PATHS or torch._C._functorch.peek_interpreter_stack() is None:
            return path
        ran = _eager_twin(path)
        if root.label not in self._in_transform:
            self._in_transform.add(root.label)
            self.recorder.add_fallback(root.label, f"called inside a torch.func transform (grad, vmap, ...): "
                                                   f"torch.compile cannot trace a call made from eager code inside one "
                                                   f"(pytorch/pytorch#128711), so {path.value} ran no graph for it "
                                                   f"and the call ran {ran.value}", FUNCTORCH)
        return ran

    def _deliver(self, root: Root, out: Any, rerun: Callable[[], Any] | None) -> Any:
        """What the script gets: its FP32 dtypes (automp.runtime.outputs) and, for a ModelOutput, a watch over which
        fields it reads (automp.runtime.guards.unread_outputs). rerun is None on the eager path, where nothing is detached."""
        if not is_lazy_candidate(out):
            return restore_float32(out) if rerun is None else out  # compiled paths restored it inside the graph
        root.fields.observe(out)
        detached = root.fields.detach if rerun is not None else ()
        return restore_lazily(out, FieldWatch(out, root.fields, detached, rerun))

    # -- roots, trials, verdicts ----------------------------------------------------------------------------------
    def _new_root(self, module: nn.Module, args: tuple, kwargs: dict) -> Root:
        device = device_of(module)
        root = self.roots[module] = Root(self._label(module), device, self.config.low_dtype(device))
        root.lockstep = distributed() and lockstep(module)
        label, recorder = root.label, self.recorder  # not root: see compiled_paths.entry_point
        root.fields.on_reattach = lambda why: recorder.unread_outputs.setdefault(
            label, {"detached": []}).update(detached=[], reattached=why)
        floats = [p.dtype for p in module.parameters() if p.is_floating_point()]
        if floats and torch.float32 not in floats:
            root.aside = f"its parameters are already {floats[0]}: the model runs in the precision it was given"
            self.recorder.add_choice(root.label, as_written(HALF_MODEL), root.aside)
            return root
        # the report's header: this run's dtype and device, whichever path runs (not only once a graph compiles)
        self.recorder.dtype = dtype_name(root.low)
        self.recorder.device = _spec(self.config, device).name if device.type == "cuda" else "cpu"
        spec = self.config.spec or ("h100" if device.type == "cuda" else "cpu")
        extra = f"{self.config.inner}:{spec}" + ("" if self.config.cuda_graphs else ":no-graphs")
        # before the key: the FP8 layers' classes are part of it. Not for a root the script calls under its own
        # autocast: automp steps aside there (call), and the probe would run the script's own (maybe compiled) model
        if self.fp8 is not None and not torch.is_autocast_enabled(device.type):
            root.fp8_layers, root.fp8_saving_ms = self.fp8.prepare(
                module, root.label, device, lambda: self._run(module, root, Route.FP32, args, kwargs, count=False),
                shared=root.lockstep)
            extra += ":" + self.fp8.key(root.fp8_layers, self.config.fp8_recipe)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        root.key = module_key(module, args, str(root.low), f"{device.type}:{name}", extra=extra)
        verdict = starts.forced_verdict(self.config, root, self.recorder)
        if verdict is not None:
            self.paths.decide(root, verdict)
            return root
        self.paths.start(root, *starts.trial_start(self.config, root, self.cache, self.candidates, self.recorder))
        return root

    def _fp8_guard(self, root: Root) -> None:
        """Between steps: a root on FP8 has its loss watched; after a divergence every root on FP8 goes bf16. Under
        FSDP2, a root settled on FP8 has its FP8 layers' weights all-gathered in FP8 (Fp8Layers.gather)."""
        if root.path in FP8_PATHS:
            self.fp8.watch_loss(root.lockstep)
        if self.fp8.diverged is not None:
            self.fp8.leave(self.roots.values(), self.paths.move)
        self.fp8.gather(root.label, root.path in FP8_PATHS and root.confirm is None)

    def script_failed(self, error: BaseException) -> str | None:
        """The script ended with `error`. A double backward through a compiled graph (automp.runtime.guards.input_grads) is
        remembered for the modules that ran one, so the next run keeps them eager; the hint for the user, or None
        (the allocator's, for an error that setting may have caused)."""
        if not input_grads.is_double_backward(error):
            return self.allocator.hint(error)
        compiled = [r for r in self.roots.values() if r.compiled is not None or r.stock is not None]
        self.cache.put({r.key: Verdict(Route.EAGER_LOW, input_grads.REASON_CRASHED, {}, rule=DOUBLE_BACKWARD,
                                       eager_only=True)
                        for r in compiled if r.key})
        return input_grads.HINT.format(modules=", ".join(r.label for r in compiled) or "its modules")

    def _label(self, module: nn.Module) -> str:
        name = type(module).__name__
        n = self.labels[name] = self.labels.get(name, 0) + 1
        return name if n == 1 else f"{name}#{n}"

    def _before_compile(self, root: Root, module: nn.Module, kwargs: dict) -> None:
        """At the first compilation, not at install: transformers adds its log-once methods when the script imports
        it, after automp was enabled. The fields to detach are fixed here (automp.runtime.guards.unread_outputs)."""
        if root.fields.decide(guess_unread(module, kwargs)):
            self.recorder.unread_outputs[root.label] = {"detached": list(root.fields.detach),
                                                        **({"guessed": True} if root.fields.guessed else {})}
        if not self._logging_undo:
            self._undo.append(ignore_once_logging())
            self._logging_undo = True

    def _compile(self, module: nn.Module, root: Root) -> Callable[..., Any]:
        config = PrecisionConfig(dtype=root.low, spec=_spec(self.config, root.device))
        planned = config.spec.name
        self.recorder.device = planned if root.device.type == "cuda" else f"cpu (planned for {planned})"
        return compiled_paths.automp(module, root, make_backend(
            config, self.recorder, inner=self.config.inner, label=root.label, debug=self.config.debug,
            rewrite=compiled_paths.rewrites(self.config, self.recorder, root.label)))


def _trying(root: Root) -> bool:
    """Whether the root runs paths the script did not choose: its trial, or its verdict's re-measurement."""
    return root.path is None or root.confirm is not None


def _eager_twin(path: Route) -> Route:
    """What a call on a compiled path runs where Dynamo runs it as written: FP32 for automp's own pass, low precision
    eager for the stock paths, whose autocast region is around the compiled call."""
    return Route.FP32 if path is Route.COMPILED else Route.EAGER_LOW


def open_session(config: AutoMPConfig, recorder: Recorder) -> Session:
    """The session `automp.enable()` and `automp.compile()` open. A test replaces this factory to inject a trial's
    candidates, clock or cache into the session of a script that enables automp itself; users configure automp
    through AutoMPConfig, and have no reason to."""
    return Session(config, recorder)


def device_of(module: nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _spec(config: AutoMPConfig, device: torch.device) -> cost.DeviceSpec:
    return cost.spec_named(config.spec) if config.spec else cost.spec_for(device)
