"""What every integration does around a framework's training: automp on where training starts, off where it ends,
the report next to the framework's own output, and the summary line `automp run` prints."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import automp
from automp.config import AutoMPConfig

REPORT_NAME = "automp-report.json"


def config_of(config: AutoMPConfig | None, overrides: dict[str, Any]) -> AutoMPConfig:
    """`config` with `overrides`, checked now (a bad field fails where the user wrote it). Without a config the
    trial's status line is off unless asked for: the frameworks draw their own progress bars beside it."""
    if config is None:
        overrides = {"quiet": True, **overrides}
    return automp._config(config, overrides)


def start(config: AutoMPConfig, folder: str, owner: str) -> None:
    """automp on, its report in `folder` unless the config names a path; refused inside `automp run` or a script's
    own enable(), whose session would be replaced. `folder` is made now if it is missing: a framework may create its
    output folder only when it first saves (Lightning without a logger never does), and the report is written at the
    end of training, where a missing folder would fail the run after all its steps."""
    if automp.is_enabled():
        raise RuntimeError(f"{owner}: automp is already enabled (`automp run`, or enable() in the script); use one of "
                           f"them, not both")
    if config.report is None:
        os.makedirs(folder, exist_ok=True)
        config = dataclasses.replace(config, report=os.path.join(folder, REPORT_NAME))
    automp.enable(config)


def finish(config: AutoMPConfig) -> tuple[dict[str, Any] | None, str]:
    """automp off (every patch undone, the report written): the report and its summary line."""
    from automp.launcher import summary
    report = automp.disable()
    return report, summary(report or {}, config)
