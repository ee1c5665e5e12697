"""automp: automatic reduced precision for PyTorch.

`enable()` makes every top-level call of a module with parameters go through torch.compile with the automp
backend, so an unmodified training script gets the precision pass on its forward and backward graphs; nested
modules are part of their root's graph and are not compiled on their own. Loss scaling (fp16) hooks autograd.
"""
from __future__ import annotations

import atexit
import itertools
import os
import threading
import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from automp.graph.capture import low_dtype, make_backend
from automp.precision import cost
from automp.precision.paint import PrecisionConfig
from automp.precision.report import Recorder

__version__ = "0.1.0"
__all__ = ["enable", "disable", "compile", "report", "is_enabled", "__version__"]

_ORIG_CALL = nn.Module.__call__


@dataclass
class _State:
    dtype: str
    loss_scale: Any
    report_path: str | None
    inner: str
    recorder: Recorder
    spec: str | None = None
    scaler: Any = None
    saved_flags: dict[str, Any] | None = None
    breaks_before: dict[str, int] | None = None


_state: _State | None = None
_local = threading.local()
_compiled: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
_failed: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_entry_ids = itertools.count()


def _device_of(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _config_for(device: torch.device, dtype: str, spec: str | None = None) -> PrecisionConfig:
    """spec (or env AUTOMP_DEVICE_SPEC) overrides the device the cost model plans for."""
    spec = spec or os.environ.get("AUTOMP_DEVICE_SPEC")
    return PrecisionConfig(dtype=low_dtype(dtype, device),
                           spec=cost.spec_named(spec) if spec else cost.spec_for(device))


def _compile_module(module: nn.Module, state: _State):
    device = _device_of(module)
    config = _config_for(device, state.dtype, state.spec)
    state.recorder.device = config.spec.name if device.type == "cuda" else f"cpu (planned for {config.spec.name})"
    state.recorder.dtype = str(config.dtype).replace("torch.", "")
    backend = make_backend(config, state.recorder, inner=state.inner, label=type(module).__name__)
    return torch.compile(_entry_point(module), backend=backend)


def _entry_point(module: nn.Module) -> Callable[..., Any]:
    """A function that calls `module`, with a code object of its own: Dynamo keeps its compiled graphs (and counts
    recompiles against its limit) per code object, so a shared wrapper would make every module's compilation
    evict the others' and, past the limit, silently run them uncompiled in FP32."""
    ref = weakref.ref(module)

    def call(*args, **kwargs):
        return _ORIG_CALL(ref(), *args, **kwargs)

    code = call.__code__.replace(co_name=f"automp_{type(module).__name__}_{next(_entry_ids)}")
    return types.FunctionType(code, call.__globals__, code.co_name, call.__defaults__, call.__closure__)


def _patched_call(self: nn.Module, *args, **kwargs):
    """Compile root module calls only: inside a root's forward (depth > 0) or while Dynamo traces, call through."""
    state = _state
    if (state is None or getattr(_local, "depth", 0) > 0 or torch.compiler.is_compiling()
            or self in _failed or not any(True for _ in self.parameters())):
        return _ORIG_CALL(self, *args, **kwargs)
    compiled = _compiled.get(self)
    if compiled is None:
        compiled = _compiled[self] = _compile_module(self, state)
    _local.depth = 1
    try:
        return compiled(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported FP32 fallback; the user's own errors re-raise below
        _failed.add(self)
        state.recorder.add_fallback(type(self).__name__, f"compiled call failed, module runs eagerly in FP32: "
                                                         f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    finally:
        _local.depth = 0
    return _ORIG_CALL(self, *args, **kwargs)


def enable(dtype: str = "auto", loss_scale: Any = "dynamic", report: str | None = None,
           inner: str = "inductor", spec: str | None = None) -> None:
    """Turn automatic mixed precision on for every module called from now on.

    dtype: "auto" (bf16 where supported), "fp16" or "bf16". loss_scale: "dynamic", "off" or a constant; it only
    acts for fp16, bf16 has fp32's range. report: path of the JSON precision report, written at disable() or exit.
    inner: "inductor" (fast) or "eager" (no code generation: quick to start, for tests and debugging).
    spec: plan casts for another device's costs ("h100", "cpu", ...); default: the model's own device."""
    global _state
    if _state is not None:
        disable()
    low_dtype(dtype, None)  # validate early, with a clear message
    if spec:
        cost.spec_named(spec)
    _state = _State(dtype, loss_scale, report, inner, Recorder(), spec)
    _state.scaler = _install_scaling(dtype, loss_scale)
    _state.saved_flags = _set_capture_flags()
    _state.breaks_before = _graph_breaks()
    nn.Module.__call__ = _patched_call


def _graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


def _report_graph_breaks(state: _State) -> None:
    """Graph breaks seen while enabled: the construct at the break runs eagerly in FP32 (the code before and after it
    is compiled as separate graphs, each through the pass); the user should know where and why."""
    for reason, n in _graph_breaks().items():
        new = n - state.breaks_before.get(reason, 0)
        short = " ".join(line.strip() for line in reason.splitlines()[:2] if line.strip())[:300]
        if new > 0 and not any(fb["where"] == "graph break" and fb["reason"].startswith(short)
                               for fb in state.recorder.fallbacks):
            state.recorder.add_fallback("graph break", f"{short} (x{new}): runs eagerly in FP32 between compiled "
                                                       f"graphs")


def _set_capture_flags() -> dict[str, Any]:
    """Let Dynamo capture what it skips by default, so those parts get the pass instead of silently staying FP32:
    nn.LSTM/GRU (allow_rnn) and nn.TransformerEncoder's inference fast path (one opaque fused op)."""
    saved = {"allow_rnn": torch._dynamo.config.allow_rnn}
    torch._dynamo.config.allow_rnn = True
    mha = getattr(torch.backends, "mha", None)
    if mha is not None and hasattr(mha, "set_fastpath_enabled"):
        saved["fastpath"] = mha.get_fastpath_enabled()
        mha.set_fastpath_enabled(False)
    return saved


def _restore_capture_flags(saved: dict[str, Any]) -> None:
    torch._dynamo.config.allow_rnn = saved["allow_rnn"]
    if "fastpath" in saved:
        torch.backends.mha.set_fastpath_enabled(saved["fastpath"])


def _install_scaling(dtype: str, loss_scale: Any):
    """fp16 needs loss scaling to keep small gradients from flushing to zero; bf16 does not."""
    wants = dtype in ("fp16", "float16", "half") or (dtype == "auto" and torch.cuda.is_available()
                                                      and not torch.cuda.is_bf16_supported())
    if not wants or loss_scale in ("off", None, 0):
        return None
    from automp.scaling import autograd_hook
    from automp.scaling.loss_scale import LossScaler
    if autograd_hook.current() is not None:  # a second compile() shares the one scaler (it is global anyway)
        return autograd_hook.current()
    return autograd_hook.install(LossScaler.from_spec(loss_scale))


def disable() -> dict[str, Any] | None:
    """Turn automp off, write the report (if a path was given) and return it."""
    global _state
    state = _state
    if state is None:
        return None
    nn.Module.__call__ = _ORIG_CALL
    _restore_capture_flags(state.saved_flags)
    _report_graph_breaks(state)
    if state.scaler is not None:
        from automp.scaling import autograd_hook
        state.recorder.loss_scale = state.scaler.summary()
        autograd_hook.uninstall()
    _compiled.clear()
    _state = None
    if state.report_path:
        state.recorder.save(state.report_path)
    return state.recorder.as_dict()


def report() -> dict[str, Any] | None:
    """The report so far, while enabled."""
    if _state is None:
        return None
    if _state.scaler is not None:
        _state.recorder.loss_scale = _state.scaler.summary()
    _report_graph_breaks(_state)
    return _state.recorder.as_dict()


def is_enabled() -> bool:
    return _state is not None


def compile(model: nn.Module, dtype: str = "auto", loss_scale: Any = "dynamic", report: Recorder | None = None,
            inner: str = "inductor", spec: str | None = None) -> nn.Module:
    """One model in mixed precision, for those who prefer a line of code to `automp run`.

    Loss scaling, when fp16 asks for it, is installed globally (it hooks autograd)."""
    config = _config_for(_device_of(model), dtype, spec)
    backend = make_backend(config, report, inner=inner, label=type(model).__name__)
    _install_scaling(dtype, loss_scale)
    return torch.compile(model, backend=backend)


atexit.register(disable)
