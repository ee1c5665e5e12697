"""torch's Adam and AdamW, and SGD under loss scaling, switched to their fused CUDA implementation at their first step.

A script that writes `torch.optim.AdamW(model.parameters())` gets the foreach implementation: a dozen multi-tensor
kernels per step, each a pass over parameters and state. The fused one does the same arithmetic in one pass, which
matters most where the step waits on the host (a transformer such as GPT-2 124M is measurably faster with it;
BENCHMARKS.md, "Host-bound anchors"): a speed-up the user gets without touching code, like the precision change. Fused
optimizers also take the device-side found_inf of fp16 loss scaling, so a step with an overflow is skipped without a
host sync.

Only what torch itself would accept as `fused=True` is switched, and only where the user did not choose: both
`fused` and `foreach` left at their default (None), the exact torch classes (a subclass may override step), no
`differentiable`/`capturable`, every parameter a CUDA floating tensor, and no state yet (fused keeps its step
counters on the device; a CPU counter from an earlier step would not fit). The switch is reported.

The switch never reaches a checkpoint: `optimizer.state_dict()` reports the groups' fused/foreach as the script set
them, so a checkpoint saved under automp loads in the plain script, on any device, as one saved without automp would
(fused=True in a checkpoint would make a CPU resume fail at its first step). Loaded back into a switched optimizer,
the groups stay fused (their step counters moved to the device, as fused keeps them): a group that silently went back
to foreach would ignore the found_inf/grad_scale that loss scaling hands to an optimizer it knows as fused.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

FUSABLE = (torch.optim.Adam, torch.optim.AdamW)
# SGD only under loss scaling: its fused step measured no faster than foreach on ResNet-50 in bf16, but it takes
# found_inf, and foreach cannot: there an fp16 step reads the overflow flag on the host, and loss scaling then cost a
# sizeable share of ResNet-50's graphed fp16 step; with fused SGD automp-fp16 ran ahead of automp-bf16
# (BENCHMARKS.md, "fp16 against bf16").
FUSABLE_UNDER_SCALING = FUSABLE + (torch.optim.SGD,)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def why_not(optimizer: torch.optim.Optimizer, group: dict[str, Any], scaling: bool = False) -> str | None:
    """Why `group` of `optimizer` must keep its implementation; None when it can run fused. scaling: loss scaling
    hands this step an overflow flag, which SGD can only take fused."""
    if type(optimizer) not in (FUSABLE_UNDER_SCALING if scaling else FUSABLE):
        if type(optimizer) is torch.optim.SGD:
            return "SGD without loss scaling: its fused step is no faster than foreach"
        return f"{type(optimizer).__name__} is not torch's Adam, AdamW or SGD"
    if group.get("fused") is not None or group.get("foreach") is not None:
        return "the script chose fused/foreach itself"
    if group.get("differentiable") or group.get("capturable"):
        return "differentiable or capturable optimizer"
    params = group["params"]
    if not params or not all(p.is_cuda and p.dtype in _FLOATS for p in params):
        return "parameters not all CUDA floating-point tensors"
    if any(optimizer.state.get(p) for p in params):
        return "it has stepped before (state exists)"
    if any(p.grad is not None and p.grad.is_sparse for p in params):
        return "sparse gradients (torch's fused step does not take them)"
    return None


class OptimizerFuser:
    """The global step pre-hook; `on_switch(optimizer, n_groups)` is told about every optimizer it switched.
    `scaling()` says, at an optimizer's first step, whether loss scaling will hand it overflow flags."""

    def __init__(self, on_switch: Callable[[torch.optim.Optimizer, int], None],
                 scaling: Callable[[], bool] = lambda: False):
        self.on_switch, self.scaling = on_switch, scaling
        self.seen: weakref.WeakSet = weakref.WeakSet()
        self.handle = None

    def install(self) -> None:
        # Registered before loss scaling's own pre-hook, which asks whether the step honours found_inf.
        self.handle = register_optimizer_step_pre_hook(self._pre_step)

    def uninstall(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer in self.seen:  # one look per optimizer: every later step costs a set lookup
            return
        self.seen.add(optimizer)
        switched, scaling = [], self.scaling()
        for i, group in enumerate(optimizer.param_groups):
            if why_not(optimizer, group, scaling) is None:
                group["fused"], group["foreach"] = True, False
                switched.append(i)
        if switched:
            optimizer.register_state_dict_post_hook(_as_written(switched))
            optimizer.register_load_state_dict_post_hook(_fused_again(switched))
            optimizer._step_supports_amp_scaling = True  # as __init__(fused=True): GradScaler and loss scaling
            # then hand found_inf to the kernel
            self.on_switch(optimizer, len(switched))


def _as_written(groups: list[int]) -> Callable[[torch.optim.Optimizer, dict[str, Any]], dict[str, Any]]:
    """A state_dict post-hook: the switched groups' fused/foreach back to the defaults the script left (None)."""
    def hook(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        for i in groups:
            state["param_groups"][i]["fused"] = state["param_groups"][i]["foreach"] = None
        return state
    return hook


def _fused_again(groups: list[int]) -> Callable[[torch.optim.Optimizer], None]:
    """A load_state_dict post-hook: a checkpoint (written as the script would, see _as_written) loaded into a switched
    optimizer leaves it fused, with each step counter where the fused kernel reads it."""
    def hook(optimizer: torch.optim.Optimizer) -> None:
        for i in groups:
            group = optimizer.param_groups[i]
            group["fused"], group["foreach"] = True, False
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
    return hook
