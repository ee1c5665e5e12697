"""The loss-scale state machine: how big a factor the loss is multiplied by before backward.

fp16 flushes magnitudes below ~6e-8 to zero, and small gradients live there. Multiplying the loss by S shifts every
gradient up by S (backward is linear), and dividing the finished gradients by S in FP32 restores them. Too large an
S overflows to inf instead, so the dynamic mode probes: it halves S whenever a step's gradients held inf/nan (that
step is skipped) and doubles it after `growth_interval` clean steps, staying in [min_scale, max_scale].

The state lives in 0-dim device tensors and advances with device ops (torch._amp_update_scale_, as GradScaler's
does), so training never reads it on the host: the Python views (`scale`, `steps`, summary(), state_dict()) sync
only when asked for. One "step" of this machine is one optimizer step, all backward passes of its gradient
accumulation together; before any optimizer has stepped (scripts that update parameters by hand) it is one backward
pass. autograd_hook and skip decide when update() runs.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import Tensor

MODES = ("dynamic", "constant", "off")


@dataclass
class LossScaleConfig:
    """mode: "dynamic" (probe for the largest safe scale), "constant" (always `init_scale`) or "off" (no scaling,
    backward is not even intercepted). min_scale may go below 1: a loss whose gradients overflow fp16 unscaled
    then still trains. sync_distributed: all-reduce the overflow flag across ranks so all skip the same steps."""
    mode: str = "dynamic"
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float = 2.0 ** -14
    max_scale: float = 2.0 ** 24
    sync_distributed: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"loss scale mode {self.mode!r} is not one of {MODES}")
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"loss scale init_scale must be a finite positive number, got {self.init_scale!r}")
        if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"loss scale needs growth_factor > 1 and 0 < backoff_factor < 1, got "
                             f"{self.growth_factor} and {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"loss scale growth_interval must be >= 1, got {self.growth_interval}")
        if not 0.0 < self.min_scale <= self.max_scale:
            raise ValueError(f"loss scale needs 0 < min_scale <= max_scale, got {self.min_scale}, {self.max_scale}")


class LossScaler:
    """State of one loss scale, in 0-dim tensors. They start on the CPU and move, once, to the first accelerator a
    scaled backward runs on (place()), so the flags that update() consumes never cross between host and device."""

    _TENSORS = ("_scale", "_growth_tracker", "_steps", "_overflow_steps")

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        init = float(self.config.init_scale) if self.config.mode != "off" else 1.0
        self._scale = torch.full((), init, dtype=torch.float32)  # float32 and int32: what _amp_update_scale_ takes
        self._growth_tracker = torch.zeros((), dtype=torch.int32)  # clean steps since the scale last changed
        self._steps = torch.zeros((), dtype=torch.int64)
        self._overflow_steps = torch.zeros((), dtype=torch.int64)

    @classmethod
    def from_spec(cls, spec: Any) -> "LossScaler":
        """What users and the CLI write: "dynamic", "off"/None/0, a number or numeric string (constant), or a
        LossScaleConfig."""
        if isinstance(spec, LossScaleConfig):
            return cls(spec)
        if spec is None or spec == "off" or spec == 0:
            return cls(LossScaleConfig(mode="off"))
        if spec == "dynamic":
            return cls(LossScaleConfig(mode="dynamic"))
        try:
            value = float(spec)
        except (TypeError, ValueError):
            raise ValueError(f"loss_scale must be 'dynamic', 'off' or a positive number, got {spec!r}") from None
        return cls(LossScaleConfig(mode="constant", init_scale=value))

    @property
    def enabled(self) -> bool:
        return self.config.mode != "off"

    def place(self, device: torch.device) -> None:
        """Follow training from the CPU onto an accelerator (once; never back, never between accelerators). Filled
        there from host values rather than copied: a copy from pageable host memory would synchronize."""
        if self._scale.device.type == "cpu" and device.type != "cpu":
            for name in self._TENSORS:
                t = getattr(self, name)
                setattr(self, name, torch.full((), t.item(), dtype=t.dtype, device=device))

    def scale_tensor(self, device: torch.device) -> Tensor:
        """The scale as a 0-dim float32 tensor on `device`; no host sync."""
        return self._scale.to(device, non_blocking=True)

    def update(self, found_inf: bool | Tensor, counted: Tensor | None = None) -> None:
        """Advance one step on the device: back off after an overflow, grow after `growth_interval` clean steps.

        found_inf: a bool, or a 1-element tensor (> 0: overflow) that is never read on the host. counted: a 0-dim
        0/1 tensor; where 0 the call changes nothing (a backward that only re-found an overflow its accumulation
        had already reported must not back off or count twice)."""
        dev = self._scale.device
        if isinstance(found_inf, Tensor):
            found = found_inf.to(dev, torch.float32, non_blocking=True).reshape(())
        else:
            found = torch.full((), float(bool(found_inf)), device=dev)
        weight = None if counted is None else (counted.to(dev, non_blocking=True).reshape(()) > 0)
        hit = (found > 0).to(torch.int64)
        if weight is None:
            self._steps += 1
            self._overflow_steps += hit
        else:
            self._steps += weight
            self._overflow_steps += hit * weight
        if self.config.mode != "dynamic":
            return
        c = self.config
        scale, tracker = self._scale, self._growth_tracker
        if weight is not None:  # update copies, then keep them only where counted
            scale, tracker = scale.clone(), tracker.clone()
        torch._amp_update_scale_(scale, tracker, found, c.growth_factor, c.backoff_factor, c.growth_interval)
        scale.clamp_(c.min_scale, c.max_scale)
        if weight is not None:
            self._scale.copy_(torch.where(weight, scale, self._scale))
            self._growth_tracker.copy_(torch.where(weight, tracker, self._growth_tracker))

    def _host(self) -> tuple[float, int, int, int]:
        """scale, growth_tracker, steps, overflow_steps read to the host in one transfer (the only sync here)."""
        values = torch.stack([getattr(self, name).double() for name in self._TENSORS]).tolist()
        return float(values[0]), int(values[1]), int(values[2]), int(values[3])

    @property
    def scale(self) -> float:
        """The current scale as a Python float (a host sync: for reports and tests, not the training loop)."""
        return self._host()[0]

    @property
    def growth_tracker(self) -> int:
        return self._host()[1]

    @property
    def steps(self) -> int:
        return self._host()[2]

    @property
    def overflow_steps(self) -> int:
        return self._host()[3]

    def summary(self) -> dict[str, Any]:
        """The precision report's "loss_scale" entry."""
        scale, _, steps, overflow_steps = self._host()
        return {"scale": scale, "overflow_steps": overflow_steps, "steps": steps}

    def state_dict(self) -> dict[str, Any]:
        scale, tracker, steps, overflow_steps = self._host()
        return {"scale": scale, "growth_tracker": tracker, "steps": steps, "overflow_steps": overflow_steps,
                "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the counters and scale; the config comes along so a resumed run behaves like the original."""
        missing = {"scale", "growth_tracker", "steps", "overflow_steps"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state_dict lacks {sorted(missing)}")
        if "config" in state:
            known = {f.name for f in fields(LossScaleConfig)}
            self.config = LossScaleConfig(**{k: v for k, v in state["config"].items() if k in known})
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))
        self._steps.fill_(int(state["steps"]))
        self._overflow_steps.fill_(int(state["overflow_steps"]))

    def __repr__(self) -> str:
        scale, _, steps, overflow_steps = self._host()
        return f"LossScaler(mode={self.config.mode}, scale={scale:g}, steps={steps}, overflow_steps={overflow_steps})"
