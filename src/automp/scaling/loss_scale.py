"""The loss-scale state machine: how big a factor the loss is multiplied by before backward.

fp16 flushes magnitudes below ~6e-8 to zero, and small gradients live there. Multiplying the loss by S shifts every
gradient up by S (backward is linear), and dividing the finished gradients by S in FP32 restores them. Too large an
S overflows to inf instead, so the dynamic mode probes: it halves S whenever a backward produced inf/nan (that
step is skipped) and doubles it after `growth_interval` clean backward passes, staying in [min_scale, max_scale].

One "step" of this machine is one scaled backward pass (gradient accumulation over k micro-batches is k steps): the
scale is applied per backward, so that is where its effect is measured and where it is adjusted.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

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
    """State of one loss scale. Python floats, not device tensors: the hook syncs once per backward anyway (to
    decide whether the step is skipped), so keeping the scale on the host costs no extra sync and lets the
    optimizer pre-hook decide without touching the device."""

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config or LossScaleConfig()
        self.scale = float(self.config.init_scale) if self.config.mode != "off" else 1.0
        self.growth_tracker = 0  # clean steps since the scale last changed
        self.steps = 0
        self.overflow_steps = 0

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

    def update(self, found_inf: bool) -> None:
        """Advance the state machine after one scaled backward pass."""
        self.steps += 1
        if found_inf:
            self.overflow_steps += 1
        if self.config.mode != "dynamic":
            return
        c = self.config
        if found_inf:
            self.scale = max(self.scale * c.backoff_factor, c.min_scale)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= c.growth_interval:
            self.scale = min(self.scale * c.growth_factor, c.max_scale)
            self.growth_tracker = 0

    def summary(self) -> dict[str, Any]:
        """The precision report's "loss_scale" entry."""
        return {"scale": float(self.scale), "overflow_steps": int(self.overflow_steps), "steps": int(self.steps)}

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "steps": self.steps,
                "overflow_steps": self.overflow_steps, "config": asdict(self.config)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the counters and scale; the config comes along so a resumed run behaves like the original."""
        missing = {"scale", "growth_tracker", "steps", "overflow_steps"} - set(state)
        if missing:
            raise ValueError(f"loss scaler state_dict lacks {sorted(missing)}")
        if "config" in state:
            known = {f.name for f in fields(LossScaleConfig)}
            self.config = LossScaleConfig(**{k: v for k, v in state["config"].items() if k in known})
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.steps = int(state["steps"])
        self.overflow_steps = int(state["overflow_steps"])

    def __repr__(self) -> str:
        return f"LossScaler(mode={self.config.mode}, scale={self.scale:g}, steps={self.steps}, " \
               f"overflow_steps={self.overflow_steps})"
