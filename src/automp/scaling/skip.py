"""Which optimizer steps an overflow poisons, decided on the device wherever the optimizer can skip there.

Every scaled backward leaves a device flag (> 0: its gradients held inf/nan; all-reduced across ranks before it gets
here), kept with the leaves it gave a gradient until they step (gradient accumulation: a leaf's flag is the OR of
those of all backward calls since its last optimizer step), so nothing is read on the host during backward. A global
optimizer step pre-hook then combines the flags of the optimizer's own parameters, still on the device, and:

- fused optimizers (`_step_supports_amp_scaling`: torch's Adam, AdamW and SGD with fused=True) get the flag as
  `optimizer.found_inf`, the attribute GradScaler sets for them: their kernel skips the update on the device (Adam
  also takes back its step-counter increment). `grad_scale` is left unset: our gradients are already unscaled, a
  grad_scale would divide them again. No host sync at all.
- every other optimizer costs one host read of the flag per step; after an overflow all its grads are set to None,
  which every torch optimizer skips (params and state, Adam's step counter included, stay untouched).

The same pre-hook advances the loss scale, once per optimizer step, with the flags of every backward call since the
last advance (a second optimizer stepping in the same iteration finds none and leaves it alone). Until the first
optimizer step after start() the script may have no optimizer at all (parameters updated by hand from
autograd.grad), so the scale advances per backward instead, and a backward that only re-finds an overflow its
accumulation already reported does not count again.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from automp.scaling import overflow
from automp.scaling.loss_scale import LossScaler

_scaler: LossScaler | None = None
_handles: list[RemovableHandle] = []
_records: list["_Record"] = []  # one per backward whose leaves have not all stepped yet
_unstepped: Tensor | None = None  # OR of the flags of backward calls since the scale last advanced (per step)
_per_step = False  # an optimizer has stepped since start(): the scale advances per optimizer step
_armed: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # found_inf set by us for the step in flight
_param_ids: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple, frozenset]]" = weakref.WeakKeyDictionary()
_skipped_on_host = 0
_skipped_on_device: Tensor | None = None
_PRUNE_AT = 64  # records kept before dropping those whose leaves were all freed (a script that never steps)


class _Record:
    """One backward's flag and the leaves it still applies to (by id; a weak reference each tells a reused id from
    the leaf that was flagged). Kept per backward, not per leaf: this bookkeeping runs on the host between the end of
    a backward and the optimizer's kernels, where a fast GPU waits for it (on GPT-2 in fp16, a dictionary entry per
    leaf made it a visible share of the step; kept per backward, it costs about half as much), so it is made of set
    operations rather than a Python loop over the parameters."""

    __slots__ = ("found", "pending", "refs")

    def __init__(self, found: Tensor, leaves: list[Tensor]):
        ids = list(map(id, leaves))
        self.found = found
        self.pending = set(ids)
        self.refs = dict(zip(ids, map(weakref.ref, leaves)))

    def flags(self, ids: set | frozenset) -> bool:
        """Whether this record's flag applies to one of `ids` (a leaf it flagged, still alive)."""
        common = self.pending & ids
        return any(self.refs[i]() is not None for i in common)

    def alive(self) -> bool:
        return any(ref() is not None for ref in self.refs.values())


def start(scaler: LossScaler) -> None:
    """Begin deciding steps for `scaler` (fresh counts and flags)."""
    global _scaler, _per_step, _skipped_on_host, _skipped_on_device
    stop()
    _scaler, _per_step, _skipped_on_host, _skipped_on_device = scaler, False, 0, None
    _handles.extend([register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step)])


def stop() -> None:
    global _scaler, _unstepped
    for handle in _handles:
        handle.remove()
    _handles.clear()
    _records.clear()
    _scaler, _unstepped = None, None


def skipped_steps() -> int:
    """Optimizer steps turned into no-ops since start() (reads the device-side count: a host sync)."""
    return _skipped_on_host + (int(_skipped_on_device.item()) if _skipped_on_device is not None else 0)


def forget_fresh(params: list[Tensor]) -> None:
    """A leaf whose grad is None starts a fresh accumulation: the flags of earlier backward calls no longer apply."""
    if not _records:
        return
    fresh = {id(p) for p in params if p.grad is None}
    if fresh:
        _drop(fresh)


def record(found: Tensor, owners: list[Tensor]) -> None:
    """Take one backward's flag: keep it for its leaves, and advance the scale now or at the next step."""
    global _unstepped
    leaves = [p for p in owners if p.is_leaf]
    if _per_step:
        _unstepped = found if _unstepped is None else torch.maximum(_unstepped, found.to(_unstepped.device))
    elif _scaler is not None:
        ids = set(map(id, leaves))
        reported = overflow.any_found(_distinct(r.found for r in _records if r.flags(ids)))
        _scaler.update(found, None if reported is None else 1.0 - reported)
    if leaves:
        if len(_records) >= _PRUNE_AT:
            _records[:] = [r for r in _records if r.alive()]
        _records.append(_Record(found, leaves))


def _distinct(flags: Any) -> list[Tensor]:
    return list({id(f): f for f in flags}.values())


def _drop(ids: set | frozenset) -> None:
    """Those leaves' flags are used up (stepped) or stale (fresh accumulation): forget them; drop emptied records."""
    for r in _records:
        r.pending -= ids
    _records[:] = [r for r in _records if r.pending]


def _ids_of(optimizer: torch.optim.Optimizer) -> frozenset:
    """The ids of the optimizer's parameters, recomputed only when its groups change."""
    shape = tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)
    cached = _param_ids.get(optimizer)
    if cached is None or cached[0] != shape:
        cached = (shape, frozenset(id(p) for g in optimizer.param_groups for p in g["params"]))
        _param_ids[optimizer] = cached
    return cached[1]


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: advance the scale, then let the step run, skip it on the device, or (one host read)
    turn it into a no-op."""
    global _per_step, _skipped_on_host, _unstepped
    _disarm(optimizer)  # a found_inf left by a step that raised must not decide this one
    _per_step = True
    if _unstepped is not None and _scaler is not None:
        _scaler.update(_unstepped)
    _unstepped = None
    if not _records:
        return None
    ids = _ids_of(optimizer)
    hits = [r for r in _records if r.flags(ids)]
    _drop(ids)  # used up by this step (and any id a freed leaf left to one of these parameters)
    if not hits:
        return None
    found = overflow.any_found(_distinct(r.found for r in hits))
    how = decide(optimizer, found)
    if how == DEVICE:
        _armed.add(optimizer)
        _count_on_device(found)
    elif how == SKIPPED:
        _skipped_on_host += 1
    return None


DEVICE, SKIPPED, KEPT = "device", "skipped", "kept"  # what `decide` did


def decide(optimizer: torch.optim.Optimizer, found: Tensor) -> str:
    """Make this optimizer step a no-op where `found` (a 0-dim float flag, exactly 0.0 or 1.0) is set: the one way
    automp skips a step, for loss scaling and for the FP8 loss guard alike. DEVICE: the optimizer honours found_inf, so
    the flag is handed to its kernel and nothing is read (the caller removes `optimizer.found_inf` after the step);
    otherwise one host read, and SKIPPED (every grad set to None, which every torch optimizer skips) or KEPT."""
    if _skips_on_device(optimizer):
        optimizer.found_inf = found  # type: ignore[attr-defined]
        return DEVICE
    if _read(found):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        return SKIPPED
    return KEPT


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _disarm(optimizer)


def _disarm(optimizer: torch.optim.Optimizer) -> None:
    if optimizer in _armed:
        _armed.discard(optimizer)
        vars(optimizer).pop("found_inf", None)


def _read(found: Tensor) -> bool:
    """The one host sync of an optimizer step that cannot skip on the device."""
    return bool(found.item())


def _count_on_device(found: Tensor) -> None:
    """found is exactly 0.0 or 1.0 (overflow.any_found): one add per step, counted in float32 (exact to 2**24)."""
    global _skipped_on_device
    if _skipped_on_device is None:
        _skipped_on_device = found.clone()
    else:
        _skipped_on_device += found.to(_skipped_on_device.device, non_blocking=True)


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the step honours `optimizer.found_inf` by itself, so the flag needs no host read."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if hasattr(optimizer, "found_inf"):  # a GradScaler drives this step: decide on the host, which composes with it
        return False
    if _takes_grad_scaler(type(optimizer)):  # the older protocol: such a step reads GradScaler, not found_inf
        return False
    return not _first_fused_momentum_step(optimizer)


@functools.lru_cache(maxsize=None)
def _takes_grad_scaler(cls: type) -> bool:
    return "grad_scaler" in inspect.signature(cls.step).parameters


def _first_fused_momentum_step(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused SGD allocates momentum buffers with empty_like on its first step and relies on that step's
    kernel to fill them; skipped on the device, it leaves them uninitialized (garbage from the next step on). So
    the step that creates them is decided on the host."""
    if not isinstance(optimizer, torch.optim.SGD):
        return False
    return any(group.get("momentum", 0) != 0 and p.grad is not None
               and "momentum_buffer" not in optimizer.state.get(p, {})
               for group in optimizer.param_groups for p in group["params"])
