"""automp: automatic reduced precision for PyTorch.

`enable()` opens a session (automp.runtime.session): every top-level call of a module with parameters runs on the
fastest of the paths automp can offer — its compiled forward+backward graph pass, low-precision eager, or the
script as written — measured in the first iterations (automp.runtime.trial). Loss scaling (fp16) hooks autograd.
`compile()` puts one model through the compiled pass in the same session; `disable()` undoes both.
"""
from __future__ import annotations

import atexit
import dataclasses
from typing import Any

import torch.nn as nn

from automp.config import VERSION as __version__
from automp.config import AutoMPConfig

__all__ = ["enable", "disable", "compile", "report", "is_enabled", "settled", "AutoMPConfig", "__version__"]

_session = None  # the open automp.runtime.session.Session, if any


def _config(config: AutoMPConfig | None, overrides: dict[str, Any]) -> AutoMPConfig:
    """`config` (default: the environment's, AutoMPConfig.from_env) with `overrides` of its fields; a bad field
    name or value raises here, before anything is installed."""
    if config is None:
        return AutoMPConfig.from_env(**overrides)
    if not isinstance(config, AutoMPConfig):
        raise TypeError(f"config must be an AutoMPConfig, got {type(config).__name__}")
    return dataclasses.replace(config, **overrides)


def enable(config: AutoMPConfig | None = None, **overrides: Any) -> None:
    """Turn automatic mixed precision on for every module called from now on: `config` (default: the
    environment's), with keyword `overrides` of its fields (see AutoMPConfig), e.g. `enable(dtype="bf16")`.

    Everything is checked before anything is installed: a bad argument raises and leaves automp as it was. Called
    while enabled (a script that enables automp itself under `automp run`), the new settings apply and the report
    keeps what was recorded and, unless a new path is given, where it goes."""
    global _session
    from automp.runtime import session as sessions
    from automp.runtime.report import Recorder
    config = _config(config, overrides)
    recorder = Recorder()
    if _session is not None:
        if config.report is None and _session.config.report is not None:
            config = dataclasses.replace(config, report=_session.config.report)
        recorder = _session.recorder
        _session.uninstall()
        _session = None
    session = sessions.open_session(config, recorder)
    session.install()
    _session = session


def compile(model: nn.Module, config: AutoMPConfig | None = None, **overrides: Any) -> nn.Module:
    """One model through automp's compiled pass, for those who prefer a line of code to `automp run` (no trial:
    asking for compile is asking for this path). `config` and `overrides` as for enable(); `report` is a path,
    written by disable(). Without an enabled session, compile opens one that installs only what the compiled
    model needs (loss scaling, where fp16 asks for it); either way disable() removes it."""
    global _session
    from automp.runtime import session as sessions
    from automp.runtime.report import Recorder
    config = _config(config, {**overrides, "path": "compile"})
    if _session is None:
        _session = sessions.open_session(config, Recorder())
    return _session.compile(model, config)


def disable() -> dict[str, Any] | None:
    """Turn automp off (every change it made undone), write the report (if a path was given) and return it."""
    global _session
    session, _session = _session, None
    if session is None:
        return None
    rep = session.uninstall()
    if session.config.report_path:
        session.recorder.save(session.config.report_path)
    return rep


def report() -> dict[str, Any] | None:
    """The report so far, while enabled."""
    if _session is None:
        return None
    _session.update_report()
    return _session.recorder.as_dict()


def recorder() -> Any:
    """The open session's report as it is being recorded (automp.runtime.report.Recorder), or None: `automp run`
    keeps it to write the command line's --report however the script ends."""
    return None if _session is None else _session.recorder


def is_enabled() -> bool:
    return _session is not None


def settled() -> bool:
    """True once every root module seen so far runs on its final path (its trial, if any, is over): benchmarks
    warm up until then."""
    return _session is None or _session.settled()


def script_failed(error: BaseException) -> str | None:
    """Tell the session the script ended with `error` (`automp run` does): what automp learns from it is kept for
    the next run, and a hint for the user comes back when automp's own choice caused it (else None)."""
    return None if _session is None else _session.script_failed(error)


atexit.register(disable)
