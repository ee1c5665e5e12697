"""Programmatic dependent launch (Hopper and later), opt-in: `with dependent_launches(): ...`.

A decode step at batch 1 is hundreds of short kernels, and a 4096-wide GEMV reads its 8-12 MB in about as long as
its launch, first loads and tail take. A kernel launched with CUDA's programmatic stream serialization may start
while the kernel before it drains; it then waits (griddepcontrol.wait) for that kernel's completion and memory before
it touches anything the earlier work wrote or may still read. A CUDA graph captured inside the context keeps these
launches as programmatic edges, so every replay overlaps them.

The kernels that take part (the quantized GEMV, the rows and planes kernels, their split sums, the decode
attention's two kernels) wait first thing in every program, before any load or store, so no output is written and
no activation read before the previous grid is done; since each one waits before it completes, completion stays
ordered along the stream. They then let their own dependents launch at once. Only their launches change: everything else (Inductor's kernels, cuBLAS) launches as
before and, launched normally, waits for all earlier work. Inductor's own option (`triton.enable_pdl`) is not
turned on with it: its kernels skip the wait where they read nothing the kernel just before wrote, so one of them
could complete before that kernel does, and a kernel of ours after it would then see an unfinished grid's output.

Off by default: what it gains is measured by `automp llm bench`'s `-pdl` cases, not assumed. Off the GPU, under the
Triton interpreter, or before sm_90 the context changes nothing.
"""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from automp.kernels.gemm import INTERPRET

_ON = contextvars.ContextVar("automp_dependent_launches", default=False)


@contextlib.contextmanager
def dependent_launches(on: bool = True) -> Iterator[None]:
    """Kernels launched inside (and CUDA graphs captured inside) use programmatic dependent launch where it applies."""
    token = _ON.set(on)
    try:
        yield
    finally:
        _ON.reset(token)


def active(device: torch.device) -> bool:
    """Whether a kernel launched now on `device` takes part: asked for, compiled for a GPU of sm_90 or later."""
    return (_ON.get() and not INTERPRET and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def launch_options(on: bool) -> dict:
    """The launch keyword that turns it on for one Triton launch (none when off, so every Triton takes the call)."""
    return {"launch_pdl": True} if on else {}


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """First thing in a taking-part program: wait for the previous grid, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
