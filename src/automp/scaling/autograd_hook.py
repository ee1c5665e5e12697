"""Loss scaling with no change to the user's script: hook gradient computation itself, not the optimizer.

While installed, `torch.autograd.backward` (and so `loss.backward()`) and `torch.autograd.grad` multiply the roots'
incoming gradient by the scale, and before returning divide the gradients they produced by it (one fused pass that
also finds inf/nan). Whatever runs after backward (clip_grad_norm_, the optimizer, logging) sees true-unit
gradients. Gradient accumulation: gradients already in .grad are brought to scaled units first (exact for a
power-of-two scale), so the one unscale pass leaves them as they were and unscales only the new part.

Nothing in a backward reads a value on the host: the scale is a device tensor, and the pass's overflow flag stays
on the device, OR-ed per leaf across the backward calls of an accumulation (skip.record). The optimizer step
decides (skip): a fused optimizer skips on the device through GradScaler's `found_inf` protocol (no sync at all);
any other reads the flag once per step and, after an overflow, is turned into a no-op (all its grads set to None,
so params and state, Adam's step counter included, stay untouched). The dynamic scale advances on the device,
once per optimizer step (per backward until some optimizer has stepped). Under torch.distributed the flag is
all-reduced on the device, so every rank skips the same steps; DDP's gradient all-reduce sees the scaled
gradients, which is fine (it is linear).

Known limits: post-accumulate-grad hooks and retain_grad() intermediates see scaled gradients (they run inside
the backward); LBFGS-style steps whose closure calls backward inside step() are not skipped on overflow; after a
step skipped on the device its grads keep their inf/nan until zero_grad() (as with GradScaler); flags are dropped
by the step or by the grad becoming None, so zero_grad(set_to_none=False) after an overflow without a step costs
one extra skipped step. Calls made while a scaled backward runs (reentrant checkpointing) and calls on tensor
subclasses (tracing, FakeTensor) pass through untouched.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from torch import Tensor

from automp.scaling import overflow, skip
from automp.scaling.loss_scale import LossScaler

STATE_KEY = "automp_loss_scale"  # rides along in every optimizer.state_dict() while installed

_scaler: LossScaler | None = None
_patched: dict[str, Any] = {}
_depth = 0  # > 0 while a scaled backward runs, on any thread: nested calls pass through
_live: list[Tensor] = []  # leaves the running scaled backward will unscale (nested backward calls add theirs)

_ORIG_BACKWARD: Callable[..., Any] = torch.autograd.backward
_ORIG_GRAD: Callable[..., Any] = torch.autograd.grad
_BACKWARD_SIG = inspect.signature(_ORIG_BACKWARD)
_ACCUMULATE = torch._C._functions.AccumulateGrad  # the autograd node that holds a leaf
_GRAD_SIG = inspect.signature(_ORIG_GRAD)


def current() -> LossScaler | None:
    """The installed scaler (also when its mode is "off"), or None."""
    return _scaler


def install(scaler: LossScaler) -> LossScaler:
    """Start scaling with `scaler`. Mode "off" patches nothing (zero overhead); installing again swaps scalers."""
    global _scaler
    if not isinstance(scaler, LossScaler):
        raise TypeError(f"install() needs an automp LossScaler, got {type(scaler).__name__}")
    uninstall()
    _scaler = scaler
    if not scaler.enabled:
        return scaler
    opt = torch.optim.Optimizer
    _patched.update(backward=torch.autograd.backward, grad=torch.autograd.grad, state_dict=opt.state_dict,
                    load_state_dict=opt.load_state_dict)
    torch.autograd.backward = _scaled_backward
    torch.autograd.grad = _scaled_grad
    opt.state_dict = _wrap_state_dict(_patched["state_dict"])
    opt.load_state_dict = _wrap_load_state_dict(_patched["load_state_dict"])
    skip.start(scaler)
    return scaler


def uninstall() -> LossScaler | None:
    """Restore torch exactly as it was; returns the scaler that was installed."""
    global _scaler
    scaler, _scaler = _scaler, None
    if _patched:
        torch.autograd.backward = _patched.pop("backward")
        torch.autograd.grad = _patched.pop("grad")
        torch.optim.Optimizer.state_dict = _patched.pop("state_dict")
        torch.optim.Optimizer.load_state_dict = _patched.pop("load_state_dict")
        skip.stop()
    return scaler


# ---- checkpoints: the scaler state travels inside the optimizer's state dict ----------------------------------

def _wrap_state_dict(orig: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(orig)
    def state_dict(self, *args: Any, **kwargs: Any) -> dict:
        sd = orig(self, *args, **kwargs)
        if _scaler is not None:
            sd[STATE_KEY] = _scaler.state_dict()
        return sd
    return state_dict


def _wrap_load_state_dict(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def load_state_dict(self, state_dict: dict, *args: Any, **kwargs: Any) -> Any:
        if STATE_KEY in state_dict:
            state_dict = dict(state_dict)
            saved = state_dict.pop(STATE_KEY)
            if _scaler is not None:
                _scaler.load_state_dict(saved)
        return orig(self, state_dict, *args, **kwargs)
    return load_state_dict


# ---- the scaled backward ----------------------------------------------------------------------------------------

def _inner(name: str) -> Callable[..., Any]:
    """What torch.autograd.<name> was when we installed (someone else's wrapper, if any, keeps working)."""
    return _patched.get(name) or (_ORIG_BACKWARD if name == "backward" else _ORIG_GRAD)


def _as_tuple(x: Any) -> tuple:
    if x is None:
        return ()
    if isinstance(x, Tensor):
        return (x,)
    if type(x) is dict:
        return tuple(x.values())
    return tuple(x)


def _passes_through(roots: tuple, extra: tuple) -> bool:
    """Unscaled when not ours to scale: nested in a scaled backward, traced, inside torch.func transforms, or on
    tensor subclasses."""
    scaler = _scaler
    if scaler is None or not scaler.enabled or _depth > 0 or torch.compiler.is_compiling() or _functorch_active():
        return True
    return not roots or any(type(t) is not Tensor for t in roots) or \
        any(not isinstance(t, Tensor) for t in extra)


def _functorch_active() -> bool:
    check = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(check and check())


def _scaled_root_grads(roots: tuple, grads: Any, scale: Tensor) -> list[Tensor | None] | None:
    """Root gradients times the scale (a device tensor: no sync); None where torch itself must raise (implicit grad
    of a non-scalar)."""
    given = list(_as_tuple(grads)) if grads is not None else [None] * len(roots)
    if len(given) != len(roots):
        return None
    out: list[Tensor | None] = []
    for t, g in zip(roots, given):
        if g is None:
            if t.requires_grad and t.numel() != 1:
                return None
            out.append(overflow.times(torch.ones_like(t, memory_format=torch.preserve_format), scale)
                       if t.requires_grad else None)
        else:
            out.append(overflow.times(g, scale))
    return out


def _leaves(roots: tuple) -> list[Tensor]:
    """Every leaf the backward will accumulate into: the AccumulateGrad nodes reachable from the roots. A host cost of
    every fp16 backward (on a fast GPU the device can be waiting for it), so AccumulateGrad nodes are read where they
    are found instead of being pushed and visited."""
    seen: set = set()
    found: dict[int, Tensor] = {}
    stack = []
    for t in roots:
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif t.requires_grad:
            found[id(t)] = t
    push, pop, mark = stack.append, stack.pop, seen.add
    while stack:
        for f, _ in pop().next_functions:
            if f is None or f in seen:
                continue
            mark(f)
            if type(f) is _ACCUMULATE:
                var = f.variable
                found[id(var)] = var
            else:
                push(f)
    return list(found.values())


def _grad_values(p: Tensor) -> Tensor:
    """The dense tensor to check and unscale for p.grad (the values of a coalesced sparse grad)."""
    g = p.grad
    if g.is_sparse:
        p.grad = g = g.coalesce()
        return g._values()
    return g


def _check_and_unscale(scaler: LossScaler, scale: Tensor, owners: list[Tensor], grads: list[Tensor],
                       create_graph: bool) -> list[Tensor]:
    """The one fused pass of a backward; hands its overflow flag, still on the device, to skip.record (no sync).
    Returns the unscaled gradients (the same tensors, unless create_graph asked for differentiable copies)."""
    inv = torch.reciprocal(scale)
    if create_graph:
        grads, found = overflow.unscaled_copies(grads, inv)
    else:
        found = overflow.unscale_and_check_(grads, inv)
    if scaler.config.sync_distributed:
        found = overflow.all_reduce_found(found)
    if found is not None:
        skip.record(found, owners)
    return grads


def _scaled_backward(*args: Any, **kwargs: Any) -> None:
    global _depth
    bound = _BACKWARD_SIG.bind(*args, **kwargs)
    a = bound.arguments
    roots = _as_tuple(a["tensors"])
    inputs = _as_tuple(a.get("inputs"))
    scaler = _scaler
    if _depth > 0 and scaler is not None and roots and all(type(t) is Tensor for t in roots):
        _adopt_nested(list(inputs) if inputs else _leaves(roots), _scale_for(scaler, roots),
                      bool(a.get("create_graph")))
    if _passes_through(roots, inputs) or a.get("grad_variables") is not None:
        return _inner("backward")(*args, **kwargs)
    scale = _scale_for(scaler, roots)
    root_grads = _scaled_root_grads(roots, a.get("grad_tensors"), scale)
    if root_grads is None:
        return _inner("backward")(*args, **kwargs)
    create_graph = bool(a.get("create_graph", False))
    live = list(inputs) if inputs else _leaves(roots)
    skip.forget_fresh(live)
    _rescale_existing(live, scale, create_graph)
    _live[:] = live
    _depth += 1
    done = False
    try:
        _inner("backward")(roots, root_grads, a.get("retain_graph"), create_graph, inputs=a.get("inputs"))
        owners = [p for p in _live if p.grad is not None]
        grads = [p.grad for p in owners]
        if any(g.is_sparse for g in grads):
            _refuse_sparse_double_backward(create_graph, grads)
            grads = [_grad_values(p) for p in owners]
        grads = _check_and_unscale(scaler, scale, owners, grads, create_graph)
        if create_graph:
            for p, g in zip(owners, grads):
                p.grad = g
        done = True
    finally:
        _depth -= 1
        adopted = list(_live)
        _live.clear()
        if not done:  # restore what was there; this failed backward's partial contributions stay scaled
            _rescale_existing(adopted, torch.reciprocal(scale), create_graph)


def _scale_for(scaler: LossScaler, roots: tuple) -> Tensor:
    """The scale on the roots' device; the first backward on an accelerator moves the scaler's state there."""
    device = roots[0].device
    scaler.place(device)
    return scaler.scale_tensor(device)


def _adopt_nested(targets: list[Tensor], scale: Tensor, create_graph: bool) -> None:
    """A backward run from inside the scaled one (reentrant checkpointing) flows scaled gradients into leaves the
    outer graph walk could not see: take them on, so the outer unscale pass covers them."""
    known = {id(p) for p in _live}
    new = [p for p in targets if id(p) not in known]
    skip.forget_fresh(new)
    _rescale_existing(new, scale, create_graph)
    _live.extend(new)


def _rescale_existing(params: list[Tensor], factor: Tensor, create_graph: bool) -> None:
    """Bring gradients accumulated by earlier backward calls into (or out of) scaled units.

    Gradient accumulation: the new contribution arrives scaled and is added to .grad by autograd itself (so DDP's
    reducer, which hooks that accumulation, averages the whole accumulated gradient as usual). Scaling the old part
    first makes the sum uniformly scaled, and the one unscale pass afterwards restores the old part exactly: the
    dynamic scale is a power of two, so multiplying and dividing by it is lossless in floating point."""
    if create_graph:
        for p in params:
            if p.grad is not None:
                p.grad = overflow.times(p.grad, factor)
        return
    grads = [p.grad for p in params if p.grad is not None]
    if grads:  # none after zero_grad(set_to_none=True), the usual case
        overflow.scale_([g._values() if g.is_sparse else g for g in grads], factor)


def _refuse_sparse_double_backward(create_graph: bool, grads: list[Tensor]) -> None:
    if create_graph and any(g.is_sparse for g in grads):
        raise NotImplementedError("automp loss scaling: create_graph=True with sparse gradients (e.g. "
                                  "nn.Embedding(sparse=True)) is not supported; use dense gradients or "
                                  "loss_scale='off'")


def _scaled_grad(*args: Any, **kwargs: Any) -> tuple[Tensor | None, ...]:
    global _depth
    bound = _GRAD_SIG.bind(*args, **kwargs)
    a = bound.arguments
    roots = _as_tuple(a["outputs"])
    inputs = _as_tuple(a["inputs"])
    scaler = _scaler
    if _passes_through(roots, inputs) or a.get("is_grads_batched", False):
        return _inner("grad")(*args, **kwargs)
    scale = _scale_for(scaler, roots)
    root_grads = _scaled_root_grads(roots, a.get("grad_outputs"), scale)
    if root_grads is None:
        return _inner("grad")(*args, **kwargs)
    call = dict(a)
    call["outputs"], call["grad_outputs"] = roots, root_grads
    create_graph = bool(a.get("create_graph", False))
    _depth += 1
    try:
        grads = list(_inner("grad")(**call))
    finally:
        _depth -= 1
    have = [i for i, g in enumerate(grads) if g is not None]
    _refuse_sparse_double_backward(create_graph, [grads[i] for i in have])
    if any(grads[i].is_sparse for i in have):
        for i in have:
            grads[i] = grads[i].coalesce() if grads[i].is_sparse else grads[i]
    dense = [grads[i]._values() if grads[i].is_sparse else grads[i] for i in have]
    out = _check_and_unscale(scaler, scale, [inputs[i] for i in have], dense, create_graph)
    if create_graph:
        for i, g in zip(have, out):
            grads[i] = g
    return tuple(grads)
