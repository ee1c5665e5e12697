"""automp inside Lightning: one precision plugin instead of `precision="bf16-mixed"`.

    trainer = lightning.pytorch.Trainer(plugins=[automp.integrations.lightning.AutoMP(dtype="fp8")])
    trainer.fit(model)   # the report lands in trainer.log_dir; the summary line goes to Lightning's log

    fabric = lightning.fabric.Fabric(plugins=[automp.integrations.lightning.AutoMPFabric(dtype="fp8")])
    model, optimizer = fabric.setup(model, optimizer)   # automp from here to teardown() or the process's end

Why a precision plugin: Lightning users choose precision there, and the plugin owns the hooks that bracket the
training steps. Lightning's own precision stays "32-true" underneath (the plugin is one, so Lightning itself refuses
`precision=...` beside it in one line). automp is enabled when the first training step begins, so the sanity check's
validation steps before it run as written, and disabled at the plugin's teardown, at the end of `fit`, which writes
the report and undoes every patch. Under automatic optimization the step begins in `optimizer_step`: Lightning runs
the forward and backward in a closure that the optimizer's step calls, after torch has run the step's pre-hooks, so
a session enabled inside the closure would miss the first step's pre-hooks (automp switches Adam and AdamW to their
fused step there, at the first step only: one step later the optimizer has state and stays as it is). A
LightningModule's `training_step` calls its networks itself: each network called from it is one of automp's root
modules, timed and chosen as in a plain loop.

Fabric has no end of training to hook: AutoMPFabric enables automp when `fabric.setup` hands it the model, and
disables it (writing the report, default `automp-report.json` in the working directory, and printing the summary
line) at its `teardown()`, which Fabric's strategy teardown calls, or else when the process ends.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import weakref
from typing import Any, Iterator

import torch.nn as nn
from lightning.fabric.plugins import Precision as FabricPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from automp.config import AutoMPConfig
from automp.integrations.bracket import REPORT_NAME, config_of, finish, start

__all__ = ["AutoMP", "AutoMPFabric", "REPORT_NAME"]


class _Session:
    """What both plugins keep: the config (checked where the plugin is made), the last report, and whether automp is
    on; `_end()` turns it off and logs the summary line on rank 0."""

    def _open(self, config: AutoMPConfig | None, overrides: dict[str, Any]) -> None:
        self.config = config_of(config, overrides)
        self.report: dict[str, Any] | None = None  # the last run's report, once it has ended
        self._on = False

    def _end(self) -> None:
        if self._on:
            self._on = False
            self.report, line = finish(self.config)
            rank_zero_info(line)


class AutoMP(_Session, Precision):
    """automp for the training steps of one `fit`. `config` and keyword `overrides` as for automp.enable (e.g.
    `AutoMP(dtype="fp8")`); the report goes to `config.report`, else the Trainer's log_dir. The trial's status
    line is off (`quiet`) unless asked for: Lightning draws its own progress bar."""

    precision = "32-true"  # what Lightning runs underneath, and shows

    def __init__(self, config: AutoMPConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        self._open(config, overrides)
        self._trainer: Any = None  # weakly: the plugin must not keep a finished Trainer alive

    def convert_module(self, module: nn.Module) -> nn.Module:
        trainer = getattr(module, "_trainer", None)  # set once the Trainer holds the LightningModule
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        return module

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        if not self._on:  # automatic optimization: before the step's pre-hooks and the closure's forward
            self._enable()
        return super().optimizer_step(optimizer, model, closure, **kwargs)

    @contextlib.contextmanager
    def train_step_context(self) -> Iterator[None]:
        if not self._on:  # manual optimization: the training step calls the optimizer itself
            self._enable()
        yield

    def _enable(self) -> None:
        trainer = self._trainer() if self._trainer is not None else None
        folder = (getattr(trainer, "log_dir", None) or getattr(trainer, "default_root_dir", None)) if trainer else None
        start(self.config, folder or os.getcwd(), "automp.integrations.lightning.AutoMP")
        self._on = True

    def teardown(self) -> None:
        self._end()
        super().teardown()


class AutoMPFabric(_Session, FabricPrecision):
    """automp under Lightning Fabric, from `fabric.setup(model)` to `teardown()` or the end of the process. `config`
    and keyword `overrides` as for automp.enable; the report goes to `config.report`, else `automp-report.json` in
    the working directory."""

    precision = "32-true"  # what Fabric runs underneath

    def __init__(self, config: AutoMPConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        self._open(config, overrides)

    def convert_module(self, module: nn.Module) -> nn.Module:
        if not self._on:
            start(self.config, os.getcwd(), "automp.integrations.lightning.AutoMPFabric")
            self._on = True
            atexit.register(self.teardown)  # before automp's own exit handler runs (atexit is last in, first out)
        return module

    def teardown(self) -> None:
        if self._on:
            atexit.unregister(self.teardown)
        self._end()
        super().teardown()
