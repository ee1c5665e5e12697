"""One pass over all fresh gradients: find inf/nan and divide by the loss scale, on the device, without syncing.

The scale comes in as a device tensor and the flag goes out as one, so nothing here reads a value on the host (the
flag is read, if at all, once per optimizer step: see skip). Under torch.distributed the flag is all-reduced with
MAX, still on the device, so every rank takes the same skip decision even when only one rank's micro-batch
overflowed (DDP's no_sync).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor

from automp.world import distributed


@functools.lru_cache(maxsize=1)
def _cuda_kernel() -> Callable[[list[Tensor], Tensor], Tensor] | None:
    """automp's fused Triton kernel (the `automp::unscale_and_check_` op), used where torch has no fused op of its
    own. torch's multi-tensor-apply kernel needs no host-side chunk table, so where it exists it is preferred: the
    table, rebuilt for fresh gradient buffers, cost a large share of a GPT-2 124M step."""
    if hasattr(torch, "_amp_foreach_non_finite_check_and_unscale_"):
        return None
    try:
        from automp.kernels import unscale_and_check_
    except (ImportError, AttributeError):
        return None
    return unscale_and_check_


def _foreach_unscale_and_check_(group: list[Tensor], found: Tensor, inv: Tensor) -> None:
    """Portable fallback for builds without torch's fused amp op for this device/dtype."""
    torch._foreach_mul_(group, inv.reshape(()))
    peak = torch.stack([n.float() for n in torch._foreach_norm(group, float("inf"))]).sum()
    found.add_((~torch.isfinite(peak)).float().reshape(1))


def _torch_unscale_and_check_(group: list[Tensor], found: Tensor, inv: Tensor) -> None:
    op = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if op is not None:
        try:
            op(group, found, inv)
            return
        except (RuntimeError, NotImplementedError):  # dtype/device without a fused kernel in this build
            pass
    _foreach_unscale_and_check_(group, found, inv)


def _groups(tensors: list[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    if not tensors:
        return {}
    first = tensors[0]
    if first.is_cuda:  # device index as an int, cheaper than a device object: this runs per gradient per step
        index, dtype = first.get_device(), first.dtype
        if all(t.is_cuda and t.get_device() == index and t.dtype == dtype for t in tensors):
            return {(first.device, dtype): list(tensors)}
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def _on(factor: float | Tensor, device: torch.device) -> Tensor:
    """factor as a 1-element float32 tensor on device (a Python number costs no sync either way)."""
    if isinstance(factor, Tensor):
        return factor.to(device, torch.float32, non_blocking=True).reshape(1)
    return torch.full((1,), factor, dtype=torch.float32, device=device)


def unscale_and_check_(tensors: list[Tensor], inv_scale: float | Tensor) -> Tensor | None:
    """Multiply every tensor by inv_scale (a number or a 1-element tensor) in place; return a 1-element fp32 flag
    (> 0: some value was inf/nan) on the first tensor's device, or None for an empty list. Dense tensors only
    (sparse grads: pass their values)."""
    founds: list[Tensor] = []
    for (device, _), group in _groups(tensors).items():
        inv = _on(inv_scale, device)
        kernel = _cuda_kernel() if device.type == "cuda" else None
        if kernel is not None:
            founds.append(kernel(group, inv).reshape(1).float())
            continue
        found = torch.zeros(1, dtype=torch.float32, device=device)
        _torch_unscale_and_check_(group, found, inv)
        founds.append(found)
    return _combine(founds)


def unscaled_copies(tensors: list[Tensor], inv_scale: float | Tensor) -> tuple[list[Tensor], Tensor | None]:
    """Out-of-place variant for create_graph=True: the unscale must itself be differentiable, so the double
    backward sees true-unit gradients."""
    out = [times(t, inv_scale) for t in tensors]
    founds = []
    for (device, _), group in _groups(out).items():
        peak = torch.stack([g.detach().abs().amax().float() for g in group]).sum()
        founds.append((~torch.isfinite(peak)).float().reshape(1))
    return out, _combine(founds)


def times(t: Tensor, factor: float | Tensor) -> Tensor:
    """t * factor (a number or a 1-element tensor) in t's dtype, computed at least in float32: a float32 factor
    cast to fp16 first would turn 2^16 into inf, and 0 * inf into nan."""
    wide = torch.promote_types(t.dtype, torch.float32)
    return (t.to(wide) * _on(factor, t.device).to(wide).reshape(())).to(t.dtype)


def scale_(tensors: list[Tensor], factor: Tensor) -> None:
    """Multiply every tensor in place by factor (a 0-dim float32 device tensor), in float32 math. Not
    torch._foreach_mul_: on CUDA it casts a tensor factor to the list's dtype first (fp16: 2^16 -> inf, 0 -> nan;
    seen on torch 2.11). torch's amp unscale op multiplies by its device scalar in float32; its flag is not needed
    here (the unscale pass that follows checks the whole accumulated gradient)."""
    for (device, _), group in _groups(tensors).items():
        _torch_unscale_and_check_(group, torch.zeros(1, dtype=torch.float32, device=device), _on(factor, device))


def any_found(flags: list[Tensor]) -> Tensor | None:
    """One 0-dim float32 flag from several (each > 0 where an overflow was found): exactly 1.0 or 0.0, as
    fused optimizers expect of `found_inf` (Adam subtracts it from its step counter), on the first flag's device."""
    if not flags:
        return None
    if len(flags) == 1:  # the usual step: one flag, 2 kernels rather than 4 on the host path after the backward
        return (flags[0].reshape(()) > 0).to(torch.float32)
    device = flags[0].device
    peak = torch.stack([f.to(device, non_blocking=True).reshape(()) for f in flags]).amax()
    return (peak > 0).to(torch.float32)


def _combine(founds: list[Tensor]) -> Tensor | None:
    if not founds:
        return None
    total = founds[0]
    for f in founds[1:]:
        total = total + f.to(total.device)
    return total


def all_reduce_found(found: Tensor | None) -> Tensor | None:
    """MAX over ranks when a process group is up; a no-op otherwise. Every rank runs the same backward calls (as
    DDP already requires), so every rank reaches this collective the same number of times: no hang. A rank whose
    backward produced no gradient still joins, with a zero flag."""
    import torch.distributed as dist
    if not distributed():
        return found
    if found is None:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        found = torch.zeros(1, dtype=torch.float32, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found
