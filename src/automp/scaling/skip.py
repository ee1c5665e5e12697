"""Which optimizer steps an overflow poisons, decided on the device wherever the optimizer can skip there.

Every scaled backward leaves a device flag (> 0: its gradients held inf/nan; all-reduced across ranks before it gets
here). Each leaf it gave a gradient keeps the flags of all backward calls since its last optimizer step OR-ed into
one device tensor (gradient accumulation), so nothing is read on the host during backward. A global optimizer step
pre-hook then combines the flags of the optimizer's own parameters, still on the device, and:

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
_flags: dict[int, tuple["weakref.ref[Tensor]", Tensor]] = {}  # leaf -> OR of its flags since its last step
_unstepped: Tensor | None = None  # OR of the flags of backward calls since the scale last advanced (per step)
_per_step = False  # an optimizer has stepped since start(): the scale advances per optimizer step
_armed: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # found_inf set by us for the step in flight
_skipped_on_host = 0
_skipped_on_device: Tensor | None = None


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
    _flags.clear()
    _scaler, _unstepped = None, None


def skipped_steps() -> int:
    """Optimizer steps turned into no-ops since start() (reads the device-side count: a host sync)."""
    return _skipped_on_host + (int(_skipped_on_device.item()) if _skipped_on_device is not None else 0)


def forget_fresh(params: list[Tensor]) -> None:
    """A leaf whose grad is None starts a fresh accumulation: the flags of earlier backward calls no longer apply."""
    for p in params:
        if p.grad is None:
            _flags.pop(id(p), None)


def record(found: Tensor, owners: list[Tensor]) -> None:
    """Take one backward's flag: OR it into its leaves' flags, and advance the scale now or at the next step."""
    global _unstepped
    priors = _merge(found, [p for p in owners if p.is_leaf])
    if _per_step:
        _unstepped = found if _unstepped is None else torch.maximum(_unstepped, found.to(_unstepped.device))
    elif _scaler is not None:
        reported = overflow.any_found(priors)
        _scaler.update(found, None if reported is None else 1.0 - reported)


def _flag_of(p: Tensor) -> Tensor | None:
    entry = _flags.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


def _merge(found: Tensor, leaves: list[Tensor]) -> list[Tensor]:
    """OR found into each leaf's flag with one device op per distinct earlier flag (usually none or one: the leaves
    of one accumulation share theirs). Returns those earlier flags."""
    by_prior: dict[int, tuple[Tensor | None, list[Tensor]]] = {}
    for p in leaves:
        prior = _flag_of(p)
        by_prior.setdefault(id(prior), (prior, []))[1].append(p)
    priors = []
    for prior, params in by_prior.values():
        merged = found
        if prior is not None:
            priors.append(prior)
            merged = torch.maximum(prior, found.to(prior.device, non_blocking=True))
        for p in params:
            _flags[id(p)] = (weakref.ref(p), merged)
    return priors


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: advance the scale, then let the step run, skip it on the device, or (one host read)
    turn it into a no-op."""
    global _per_step, _skipped_on_host, _unstepped
    _disarm(optimizer)  # a found_inf left by a step that raised must not decide this one
    _per_step = True
    if _unstepped is not None and _scaler is not None:
        _scaler.update(_unstepped)
    _unstepped = None
    params = [p for group in optimizer.param_groups for p in group["params"]]
    flags = {}
    for p in params:
        flag = _flag_of(p)
        _flags.pop(id(p), None)
        if flag is not None:
            flags[id(flag)] = flag
    found = overflow.any_found(list(flags.values()))
    if found is None:
        return None
    if _skips_on_device(optimizer):
        optimizer.found_inf = found  # type: ignore[attr-defined]
        _armed.add(optimizer)
        _count_on_device(found)
    elif _read(found):
        for p in params:
            p.grad = None
        _skipped_on_host += 1
    return None


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
    global _skipped_on_device
    hit = found.to(torch.int64)
    if _skipped_on_device is None:
        _skipped_on_device = hit
    else:
        _skipped_on_device += hit.to(_skipped_on_device.device, non_blocking=True)


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
