"""Magnitude pruning that stays pruned while the model trains: `prune(model, SparsityConfig(...))`.

How the zeros are kept. The masks live beside the model (not in it): the module tree, its parameters, its
state_dict and the graph automp or torch.compile captures are exactly those of the dense model, so nothing that
traces the forward (automp.enable's compiled path, torch.onnx.export) meets a mask. Two small hooks keep the
pruned weights at exactly zero instead:
- a gradient hook on each pruned weight zeroes the gradient of pruned entries, so gradient clipping, loss-scale
  overflow checks and optimizer moments never see them;
- one process-wide optimizer step post-hook re-zeroes the pruned entries of the parameters the stepping optimizer
  owns, which undoes what momentum from before pruning, or weight decay, would move. It covers any
  torch.optim.Optimizer, whether created before or after prune(); an optimizer of another kind needs
  `apply_masks(model)` (or SparsitySchedule.step()) after its step.
The zeros are in the weights themselves, so a saved state_dict or an ONNX export carries them; masks are not
saved (the state_dict stays loadable into a plain model). After loading a pruned checkpoint, prune() with the same
config finds the same masks again: the zeros are the smallest magnitudes. finalize(model) removes the hooks.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from automp.compress.sparse import masks as M
from automp.compress.sparse.report import LayerReport, SparsityReport

PATTERNS = ("2:4", "unstructured")
SCOPES = ("layer", "global")
Evaluate = Callable[[nn.Module], float]


@dataclass(frozen=True)
class SparsityConfig:
    """pattern: "2:4" (in every 4 consecutive input-dim weights of an nn.Linear, the 2 largest |w| stay: the pattern
    sparse tensor cores run) or "unstructured" (the smallest |w| anywhere).
    amount: fraction of weights to zero, in [0, 1); unstructured only (2:4 is always one half: leave it None).
    scope: "layer" (each layer loses `amount` of its weights) or "global" (one magnitude threshold over all matched
    layers; unstructured only).
    layers: fnmatch pattern(s) over qualified module names, e.g. "*.intermediate.dense" (`*` also crosses dots:
    "*.layer.*[0-9].output.dense" leaves out "*.attention.output.dense"); None: every module of `types`.
    types: module classes that may be pruned (their `.weight`); 2:4 takes nn.Linear only."""

    pattern: str = "2:4"
    amount: float | None = None
    scope: str = "layer"
    layers: str | Sequence[str] | None = None
    types: type | tuple[type, ...] = (nn.Linear,)

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown sparsity pattern {self.pattern!r}: expected '2:4' or 'unstructured'")
        if self.scope not in SCOPES:
            raise ValueError(f"unknown scope {self.scope!r}: expected 'layer' or 'global'")
        if self.pattern == "2:4":
            if self.amount is not None and self.amount != 0.5:
                raise ValueError(f"2:4 always zeroes half the weights (2 of every 4): leave amount unset, "
                                 f"got amount={self.amount!r}")
            if self.scope != "layer":
                raise ValueError("scope='global' applies to unstructured pruning; 2:4 is a per-group pattern")
        else:
            a = self.amount
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or not 0 <= a < 1:
                raise ValueError(f"unstructured pruning needs amount in [0, 1) (the fraction of weights to zero), "
                                 f"got {a!r}")
        layers = self.layers
        if isinstance(layers, str):
            layers = (layers,)
        if layers is not None:
            layers = tuple(layers)
            if not layers or not all(isinstance(g, str) and g for g in layers):
                raise TypeError(f"layers must be a glob string or a non-empty sequence of them, got {self.layers!r}")
        object.__setattr__(self, "layers", layers)
        types = self.types if isinstance(self.types, tuple) else (self.types,)
        if not types or not all(isinstance(t, type) and issubclass(t, nn.Module) for t in types):
            raise TypeError(f"types must be nn.Module classes, got {self.types!r}")
        object.__setattr__(self, "types", types)

    @property
    def target(self) -> float:
        return 0.5 if self.pattern == "2:4" else float(self.amount)


@dataclass
class _Layer:
    module: nn.Module
    zero: torch.Tensor  # bool, True where the weight is pruned
    pattern: str  # "2:4" | "unstructured" | "dense" (a schedule's layer not pruned yet)
    hook: Any = None

    def apply(self) -> None:
        w = self.module.weight
        if self.zero.device != w.device:  # the model moved (.to / .cuda) since the mask was made
            self.zero = self.zero.to(w.device)
        with torch.no_grad():
            w.masked_fill_(self.zero, 0)

    def grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        return grad.masked_fill(self.zero.to(grad.device), 0)


@dataclass
class _Pruning:
    config: SparsityConfig
    layers: dict[str, _Layer] = field(default_factory=dict)
    accuracy: dict[str, float] = field(default_factory=dict)


_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, _Pruning]" = weakref.WeakKeyDictionary()
_step_hook = None  # the one optimizer step post-hook: on while any model has masks, off at the next prune()/finalize()


def select_layers(model: nn.Module, config: SparsityConfig) -> dict[str, nn.Module]:
    """The modules `config` prunes, by qualified name; raises ValueError naming what did not fit."""
    typed = {n: m for n, m in model.named_modules()
             if isinstance(m, config.types) and isinstance(getattr(m, "weight", None), torch.Tensor)}
    picked = {n: m for n, m in typed.items()
              if config.layers is None or any(fnmatchcase(n, g) for g in config.layers)}
    kinds = "/".join(t.__name__ for t in config.types)
    if not picked:
        shown = ", ".join(repr(n or "<model>") for n in list(typed)[:8]) + (", ..." if len(typed) > 8 else "")
        raise ValueError(f"no layer matched layers={config.layers!r}: the model has {len(typed)} {kinds} "
                         f"module(s) with a weight" + (f" ({shown})" if typed else ""))
    for name, m in picked.items():
        label = repr(name or "<model>")
        if not m.weight.is_floating_point():
            raise TypeError(f"layer {label}: weight is {m.weight.dtype}; only floating-point weights are pruned")
        if config.pattern != "2:4":
            continue
        if not isinstance(m, nn.Linear):
            raise ValueError(f"layer {label} is {type(m).__name__}: 2:4 applies to nn.Linear only "
                             f"(narrow `layers` or `types`)")
        if m.in_features % M.GROUP:
            raise ValueError(f"layer {label} (Linear {m.in_features}->{m.out_features}, weight "
                             f"{list(m.weight.shape)}): 2:4 needs in_features divisible by {M.GROUP}, "
                             f"got {m.in_features}")
    return picked


def prune(model: nn.Module, config: SparsityConfig, evaluate: Evaluate | None = None) -> SparsityReport:
    """Zero weights by magnitude now and keep them zero through training (see the module docstring). Called again
    on a pruned model, the new masks add to the old ones. `evaluate(model) -> float` (optional) is recorded before
    and after pruning; finalize() records it once more after fine-tuning."""
    if not isinstance(config, SparsityConfig):
        raise TypeError(f"config must be a SparsityConfig, got {type(config).__name__}")
    layers = select_layers(model, config)
    state = _ACTIVE.get(model)
    _check_unclaimed(model, layers)
    before = measure(evaluate, model) if evaluate is not None else None
    old = {n: state.layers[n].zero for n in layers if state is not None and n in state.layers}
    new = compute_masks(layers, config, {n: ~z for n, z in old.items()})
    state = install(model, config, layers, new, {n: config.pattern for n in layers})
    if evaluate is not None:
        state.accuracy.setdefault("before", before)
        state.accuracy["after_prune"] = measure(evaluate, model)
    return sparsity_report(model)


def compute_masks(layers: dict[str, nn.Module], config: SparsityConfig, keep: dict[str, torch.Tensor],
                  amount: float | None = None) -> dict[str, torch.Tensor]:
    """Keep-masks for `layers` at `amount` (default: the config's), on top of the existing keep-masks."""
    amount = config.target if amount is None else amount
    if config.pattern == "2:4":
        return {n: M.two_four_mask(m.weight, keep.get(n)) for n, m in layers.items()}
    if config.scope == "global":
        return M.global_magnitude_masks({n: m.weight for n, m in layers.items()}, amount, keep)
    return {n: M.magnitude_mask(m.weight, amount, keep.get(n)) for n, m in layers.items()}


def install(model: nn.Module, config: SparsityConfig, layers: dict[str, nn.Module], keep: dict[str, torch.Tensor],
            patterns: dict[str, str]) -> _Pruning:
    """Record the masks of `model`, zero the weights now and make sure the hooks that keep them zero are in place."""
    state = _ACTIVE.get(model)
    if state is None:
        state = _ACTIVE[model] = _Pruning(config)
    state.config = config
    for name, m in layers.items():
        layer = state.layers.get(name)
        if layer is None:
            layer = state.layers[name] = _Layer(m, ~keep[name], patterns[name])
            layer.hook = m.weight.register_hook(layer.grad_hook) if m.weight.requires_grad else None
        else:
            layer.zero, layer.pattern = ~keep[name], patterns[name]
        layer.apply()
    _update_step_hook()
    return state


def apply_masks(model: nn.Module) -> None:
    """Zero the pruned weights again now: after a load_state_dict, or a step of an optimizer that is not a
    torch.optim.Optimizer (whose steps the automatic hook cannot see)."""
    for layer in _require(model, "apply_masks").layers.values():
        layer.apply()


def get_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """The current keep-masks (True = weight kept), by layer name."""
    return {n: ~layer.zero for n, layer in _require(model, "get_masks").layers.items()}


def is_pruned(model: nn.Module) -> bool:
    return model in _ACTIVE


def finalize(model: nn.Module, evaluate: Evaluate | None = None) -> SparsityReport:
    """End training with masks: zero the pruned weights a last time, remove every hook and forget the masks. The
    model is a plain model again whose weights hold the zeros (state_dict, ONNX export and to_semi_structured see
    them). `evaluate` is recorded as the accuracy after fine-tuning."""
    state = _require(model, "finalize")
    for layer in state.layers.values():
        layer.apply()
        if layer.hook is not None:
            layer.hook.remove()
            layer.hook = None
    if evaluate is not None:
        state.accuracy["after_finetune"] = measure(evaluate, model)
    rep = sparsity_report(model)
    del _ACTIVE[model]
    _update_step_hook()
    rep.notes.append("finalized: masks and hooks removed, zeros kept in the weights")
    return rep


def sparsity_report(model: nn.Module) -> SparsityReport:
    """Measured sparsity of every masked layer, and the accuracies recorded so far."""
    state = _require(model, "sparsity_report")
    cfg = state.config
    rows = []
    for name, layer in state.layers.items():
        w = layer.module.weight
        zeros = int((w.detach() == 0).sum())
        rows.append(LayerReport(name or "<model>", type(layer.module).__name__, list(w.shape), layer.pattern,
                                zeros / max(1, w.numel()), zeros, w.numel()))
    return SparsityReport(cfg.pattern, cfg.target, cfg.scope, rows, dict(state.accuracy))


def measure(evaluate: Evaluate, model: nn.Module) -> float:
    """The user's metric, with the model's train/eval mode restored afterwards."""
    was_training = model.training
    try:
        value = evaluate(model)
    finally:
        model.train(was_training)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"evaluate(model) must return a number, got {type(value).__name__}")
    return float(value)


def _require(model: nn.Module, what: str) -> _Pruning:
    state = _ACTIVE.get(model)
    if state is None:
        raise ValueError(f"{what}: this model has no sparsity masks (call prune() or create a SparsitySchedule "
                         f"first)")
    return state


def _check_unclaimed(model: nn.Module, layers: dict[str, nn.Module]) -> None:
    """A layer is masked through one root model only: two roots sharing it could not agree on its mask."""
    mine = set(map(id, layers.values()))
    for other, state in list(_ACTIVE.items()):
        if other is model:
            continue
        for name, layer in state.layers.items():
            if id(layer.module) in mine:
                raise ValueError(f"layer {name!r} is already pruned through another module "
                                 f"({type(other).__name__}): finalize that one first")


def _after_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Every pruned model freed without finalize(): nothing to do. The hook stays registered until the next prune() or
    # finalize() takes it off; removing it here, while torch iterates over the post-hooks, made that loop raise
    # "OrderedDict mutated during iteration" in the step of whatever optimizer ran next.
    if not _ACTIVE:
        return
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for state in list(_ACTIVE.values()):
        for layer in state.layers.values():
            if layer.pattern != "dense" and id(layer.module.weight) in owned:
                layer.apply()


def _update_step_hook() -> None:
    global _step_hook
    if _ACTIVE and _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook
        _step_hook = register_optimizer_step_post_hook(_after_optimizer_step)
    elif not _ACTIVE and _step_hook is not None:
        _step_hook.remove()
        _step_hook = None
