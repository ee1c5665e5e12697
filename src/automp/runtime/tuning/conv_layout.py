"""channels_last activations for the convolutional modules that run eagerly, switched on only where it measured faster.

cuDNN's fastest convolutions, above all depthwise and grouped ones in bf16/fp16, read and write NHWC. PyTorch runs a
convolution in channels_last when its input (or weight) is, and the layout then carries through norms, activations and
the next convolutions. A script that never asked for it gets NCHW everywhere. Converting each convolution's input made a
depthwise-heavy network (EfficientNet-B0) much faster eagerly, in autocast and in FP32, a torchvision Faster R-CNN
somewhat faster, left ResNet-50 and ConvNeXt-T about where they were, and made a small DCGAN a little slower (the hooks'
host time on a launch-bound loop). Compiled paths are left to Inductor, which picks the layout inside its graphs itself
(converting there changed nothing beyond noise). So, like cuDNN's benchmark flag (automp.runtime.tuning.conv_tuning), it
is a measured choice: once every root has its path, a script whose eager-path roots hold 2-d convolutions on CUDA runs a
short trial of both layouts and keeps channels_last only when it leads by more than the anchor margin. The outcome is
cached with the verdicts.

Nothing the script holds changes: its parameters keep their layout (so optimizer state, DDP's buckets, checkpoints
and `param.view` are as before; each convolution converts its weight on the fly, cheap beside the activations), and a
4-d tensor a root returns in channels_last goes back to the default layout, so the script's own `.view` on a result
works as it did. The conversion is a forward pre-hook on each convolution; after a root's first call only the hooks
that converted something stay (the network's entry convolutions), so the rest cost nothing. Should a call raise under
channels_last (a model's own `.view` on an activation), automp goes back to the default layout for good, runs the
call again, and says so: the modules that ran before the error saw that batch twice (their batch-norm statistics).
"""
from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from automp.runtime.tuning.conv_tuning import SettingTuning

CL = torch.channels_last
_CONVS = (nn.Conv2d, nn.ConvTranspose2d)


class Layout(enum.Enum):
    DEFAULT = "contiguous"  # the script's layout: first, so a trial keeps it unless the other clearly leads
    CHANNELS_LAST = "channels-last"


def _is_cl(t: torch.Tensor) -> bool:
    """In channels_last and not also in the default layout (a [N, C, 1, 1] tensor is both)."""
    return t.dim() == 4 and t.is_contiguous(memory_format=CL) and not t.is_contiguous()


def _to_default(out: Any) -> Any:
    """The root's result as the script had it: a 4-d tensor, or one in a tuple, list or dict, in the default layout."""
    if isinstance(out, torch.Tensor):
        return out.contiguous() if _is_cl(out) else out
    if type(out) in (tuple, list):
        return type(out)(_to_default(v) for v in out)
    if type(out) is dict:
        return {k: _to_default(v) for k, v in out.items()}
    return out


@dataclass
class _Hooks:
    handles: dict[nn.Module, RemovableHandle] = field(default_factory=dict)
    converted: set[nn.Module] = field(default_factory=set)  # convolutions whose input was converted
    pruned: bool = False


class LayoutTuning(SettingTuning):
    """The session's one layout decision for its eager-path convolutional roots."""

    SETTING, KIND, SUFFIX = "activation layout of eager convolutions", Layout, "layout"
    WARMUP = {Layout.CHANNELS_LAST: 2, Layout.DEFAULT: 1}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.on = False
        self._eager_roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._hooks: weakref.WeakKeyDictionary[nn.Module, _Hooks] = weakref.WeakKeyDictionary()

    def applies(self, module: nn.Module, device: torch.device, eager: bool) -> bool:
        if eager and self._has_convs(module, device):
            self._eager_roots.add(module)
            return True
        return False

    def left_alone(self) -> str | None:
        for root in list(self._eager_roots):
            for m in root.modules():
                if isinstance(m, _CONVS) and not is_lazy(m.weight) and _is_cl(m.weight):
                    return f"{type(m).__name__} weights are channels_last already"
        return None

    def scripts_value(self) -> Any:
        return Layout.CHANNELS_LAST.value

    def put(self, value: enum.Enum) -> None:
        self.on = value is Layout.CHANNELS_LAST
        if not self.on and self.trial is None:  # decided: no hook left; while the trial runs they only wait
            self.remove_hooks()

    def describe(self, value: enum.Enum) -> str:
        return ("channels_last: each eager convolutional root's activations run NHWC" if value is Layout.CHANNELS_LAST
                else "the script's layout (NCHW)")

    def restore(self) -> None:
        self.on = False
        self.remove_hooks()

    def remove_hooks(self) -> None:
        for hooks in list(self._hooks.values()):
            for handle in hooks.handles.values():
                handle.remove()
        self._hooks = weakref.WeakKeyDictionary()

    def forget(self, module: nn.Module) -> None:
        """`module` no longer runs an eager path of automp's (it stepped aside): its convolutions as written."""
        self._eager_roots.discard(module)
        hooks = self._hooks.pop(module, None)
        for handle in (hooks.handles.values() if hooks else ()):
            handle.remove()

    # -- a call under channels_last -------------------------------------------------------------------------------
    def run(self, module: nn.Module, device: torch.device, call: Callable[[], Any]) -> Any:
        """`call` (root `module`'s eager path) with its convolutions fed channels_last, and its result given back in
        the default layout. A call that raises is run again in the default layout, which stays from then on."""
        if not self.applies(module, device, True):  # a root first called after the decision is found here too
            return call()
        hooks = self._hooks.get(module)
        if hooks is None:
            hooks = self._hooks[module] = self._install(module)
        try:
            out = call()
        except Exception as e:  # noqa: BLE001 - re-run as written below; the script's own errors raise from there
            self.end(Layout.DEFAULT, f"a call raised under channels_last ({type(e).__name__}: "
                                     f"{(str(e).strip().splitlines() or [''])[0][:160]}), so it was run again in "
                                     f"the script's layout, which stays; the modules that ran before the error saw "
                                     f"that batch twice (batch-norm statistics)")
            return call()
        if not hooks.pruned:  # after the first call only the convolutions that converted an input keep a hook
            for conv in [c for c in hooks.handles if c not in hooks.converted]:
                hooks.handles.pop(conv).remove()
            hooks.pruned = True
        return _to_default(out)

    def _install(self, module: nn.Module) -> _Hooks:
        hooks = _Hooks()

        def to_cl(conv: nn.Module, args: tuple) -> tuple | None:
            if not self.on:  # the trial's turn of the default layout
                return None
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.dim() == 4 and not x.is_contiguous(memory_format=CL):
                hooks.converted.add(conv)
                return (x.contiguous(memory_format=CL),) + args[1:]
            return None

        for m in module.modules():
            if isinstance(m, _CONVS):
                hooks.handles[m] = m.register_forward_pre_hook(to_cl)
        return hooks
