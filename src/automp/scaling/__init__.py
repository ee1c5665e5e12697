"""Loss scaling for fp16 training, hooked into autograd so user scripts need no change (see autograd_hook)."""
from __future__ import annotations

from typing import Any, Callable

from automp.config import AutoMPConfig
from automp.scaling.autograd_hook import current, install, uninstall
from automp.scaling.loss_scale import LossScaleConfig, LossScaler

__all__ = ["LossScaleConfig", "LossScaler", "Scaling", "install", "uninstall", "current"]


class Scaling:
    """Loss scaling for one automp session: the one place that turns it on and off over the run.

    On at install when the config asks for it (`start`); off while every module runs FP32 (`pause`, and back on
    for a later trial that may run fp16: `resume`); off for good when the script manages precision itself
    (`hand_over`); off at uninstall (`stop`). The scaler is held once, by the autograd hooks (they are
    process-wide); `record` is told its summary whenever scaling goes off, so the report keeps it."""

    def __init__(self, config: AutoMPConfig, record: Callable[[dict[str, Any]], None]) -> None:
        self.config, self.record = config, record
        self.on = False  # this session's scaler is the one installed
        self.paused = False  # off because everything runs FP32, not because the script asked

    @property
    def scaler(self) -> LossScaler | None:
        return current() if self.on else None

    def start(self, config: AutoMPConfig | None = None) -> None:
        """Install a scaler if `config` (default: the session's) wants one and none of this session's is on."""
        config = config or self.config
        if self.on or not config.wants_loss_scaling:
            return
        install(LossScaler.from_spec(config.loss_scale))
        self.on, self.paused = True, False

    def stop(self) -> None:
        scaler = self.scaler
        if scaler is not None:
            self.record(scaler.summary())
            uninstall()
        self.on = False

    def pause(self) -> None:
        if self.on:
            self.stop()
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.start()

    def hand_over(self, stop: bool) -> None:
        """A module left as written: scaling is never brought back on top of the script's own, and `stop` (the
        script runs its own autocast, and likely its own GradScaler) takes it off now."""
        self.paused = False
        if stop:
            self.stop()
