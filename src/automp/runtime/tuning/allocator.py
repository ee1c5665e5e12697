"""Expandable segments for torch's CUDA caching allocator, turned on while automp is enabled.

The default allocator reserves device memory in segments and gives a segment back only when none of it is in use.
A training step's activations die in a different order than they were allocated, so the free space ends up split
across segments that stay reserved. CUDA graphs keep a second pool beside the default one, and neither pool can use
the other's free space. On convolutional and transformer training steps alike (ResNet-50, T5-small) the steady-state
reserved memory came out clearly lower with expandable segments than without, with CUDA graphs or without
(BENCHMARKS.md, "Memory and the allocator").

With expandable segments each pool is one range of virtual addresses. The allocator maps physical pages into it as
the pool grows and unmaps them when it shrinks, so the reserved size follows the allocated size.

The setting is process-wide, so automp.disable() sets it back. It is left alone when the environment configured the
allocator itself (PYTORCH_CUDA_ALLOC_CONF and its aliases) or when there is no CUDA. The report says which applied.

One known cost: CUDA tensors shared between processes (torch.multiprocessing) travel differently from expandable
segments. torch passes file descriptors, through pidfd_getfd, which some containers forbid (pytorch/pytorch#165685),
and the legacy cudaIpcGetMemHandle refuses such memory (vllm-project/vllm#42609). A script that fails that way gets
a hint (`hint`) naming the switch that turns the setting off.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch

ENVIRONMENT = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
ON, OFF = "expandable_segments:True", "expandable_segments:False"
# lower case; not "expandable" alone: a shape error reads 'size "[3]" is not expandable to size "[2]"'
IPC_SIGNS = ("pidfd_getfd", "cudaipcgetmemhandle", "expandable_segment", "expandable segment")
SETTING = "CUDA allocator"


def _setter() -> Callable[[str], None]:
    # torch 2.13's accelerator-generic binding, else torch.cuda.memory's (deprecated in 2.13)
    return getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings


def _current() -> str:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return getter() if getter is not None else ""


def why_not(environ: Mapping[str, str]) -> str | None:
    """Why a CUDA process's allocator stays as it is, or None when automp may turn expandable segments on."""
    for name in ENVIRONMENT:
        if environ.get(name):
            return f"left as {name}={environ[name]!r} sets it"
    if _current() not in ("", OFF):  # OFF: the default, as automp's restore leaves it too
        return "left as the script set it"
    return None


class ExpandableSegments:
    """Turns expandable segments on (`turn_on`) and back off (`restore`), each at most once."""

    def __init__(self) -> None:
        self.applied = False

    def turn_on(self, report: Callable[[dict[str, Any]], None], environ: Mapping[str, str] | None = None,
                cuda: bool | None = None) -> None:
        if not (torch.cuda.is_available() if cuda is None else cuda):
            return  # nothing to set or report on a CPU run
        why = why_not(os.environ if environ is None else environ)
        if why is None:
            try:
                _setter()(ON)
            except RuntimeError as e:  # e.g. a backend that has no such setting
                why = f"could not be set: {e}"
            else:
                self.applied = True
        report({"setting": SETTING, "value": "expandable segments" if self.applied else "as configured",
                "reason": ("set by automp while it is enabled: reserved memory follows what is allocated, in the "
                           "default pool and in CUDA graphs' (off: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)")
                if self.applied else why})

    def restore(self) -> None:
        if self.applied:
            _setter()(OFF)
            self.applied = False

    def hint(self, error: BaseException) -> str | None:
        """What to do about `error` when it may come from the setting automp made, else None."""
        text = f"{type(error).__name__}: {error}".lower()
        if not self.applied or not any(sign in text for sign in IPC_SIGNS):
            return None
        return ("automp: automp had turned on the CUDA allocator's expandable segments, and this error looks like a "
                "CUDA tensor shared between processes, which they can break. Run again with "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False: automp then leaves the allocator as torch sets it.")
