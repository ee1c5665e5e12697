"""automp: automatic reduced precision for PyTorch.

`enable()` opens a session (session.py): every top-level call of a module with parameters runs on the fastest of
the paths automp can offer — its compiled forward+backward graph pass, low-precision eager, or the script as
written — measured in the first iterations (choose.py). Loss scaling (fp16) hooks autograd.
"""
from __future__ import annotations

import atexit
from typing import Any

import torch
import torch.nn as nn

from automp.config import AutoMPConfig
from automp.precision.capture import make_backend
from automp.precision import cost
from automp.precision.paint import PrecisionConfig
from automp.runtime.report import Recorder

__version__ = "0.3.5"
__all__ = ["enable", "disable", "compile", "report", "is_enabled", "settled", "AutoMPConfig", "__version__"]

_session = None  # the open automp.runtime.session.Session, if any


def enable(dtype: str = "auto", loss_scale: Any = "dynamic", report: str | None = None, inner: str = "inductor",
           spec: str | None = None, path: str = "auto", cache_dir: str | None = None,
           fuse_optimizers: bool = True, tune_cudnn: bool = True, tune_layout: bool = True,
           cuda_graphs: bool = True) -> None:
    """Turn automatic mixed precision on for every module called from now on (arguments: see AutoMPConfig).

    Every argument is checked before anything is installed: a bad one raises and leaves automp as it was. Called
    while enabled (a script that enables automp itself under `automp run`), the new settings apply and the report
    keeps what was recorded and where it goes."""
    global _session
    from automp.runtime.session import Session, reconfigured
    config = AutoMPConfig(dtype, loss_scale, report, inner, spec, path, cache_dir, fuse_optimizers, tune_cudnn,
                          tune_layout, cuda_graphs)
    recorder = None
    if _session is not None:
        config = reconfigured(_session, config)
        recorder = _session.recorder
        _session.uninstall()
        _session = None
    session = Session(config, recorder or Recorder())
    session.install()
    _session = session


def disable() -> dict[str, Any] | None:
    """Turn automp off, write the report (if a path was given) and return it."""
    global _session
    session, _session = _session, None
    if session is None:
        return None
    rep = session.uninstall()
    if session.config.report:
        session.recorder.save(session.config.report)
    return rep


def report() -> dict[str, Any] | None:
    """The report so far, while enabled."""
    if _session is None:
        return None
    _session.update_report()
    return _session.recorder.as_dict()


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


def compile(model: nn.Module, dtype: str = "auto", loss_scale: Any = "dynamic", report: Recorder | None = None,
            inner: str = "inductor", spec: str | None = None) -> nn.Module:
    """One model through automp's compiled pass, for those who prefer a line of code to `automp run` (no trial:
    asking for compile is asking for this path). Loss scaling, when fp16 asks for it, hooks autograd globally."""
    from automp.precision.capture import low_dtype
    from automp.scaling import install_for
    from automp.runtime.session import _device_of
    config = AutoMPConfig(dtype, loss_scale, None, inner, spec, "compile")
    device = _device_of(model)
    pconfig = PrecisionConfig(dtype=low_dtype(dtype, device),
                              spec=cost.spec_named(spec) if spec else cost.spec_for(device))
    backend = make_backend(pconfig, report, inner=inner, label=type(model).__name__)
    from automp.scaling import autograd_hook
    if autograd_hook.current() is None:  # a second compile() shares the one scaler (it is global anyway)
        install_for(config)
    return torch.compile(model, backend=backend)


atexit.register(disable)
