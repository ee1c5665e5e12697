"""The eager path's weight casts, made once per optimizer step as in a hand-written autocast region.

torch.autocast caches the low-precision copy of each parameter it casts, and drops the cache when the outermost
region ends. A hand-written GAN loop runs `D(real)` and `D(fake.detach())` in one region, so D's weights are cast
once (and their gradients cast back once, in one ToCopyBackward). automp's eager path enters autocast per root-module
call, so each call ended the region, dropped the cache, and cast every weight again: on an H100 the zoo's DCGAN
launched twice as many weight casts forward and backward, on a step that is launch-bound (GPU busy 4.4 ms of a
13 ms step), and ran 5-7% behind the hand-written loop.

`SharedCasts.region` keeps the cache across calls: it opens one extra autocast nesting level around automp's own
region, so that region's exit does not clear the cache. A cached copy is only valid while its parameter is unchanged,
so before each call the parameters cast so far are checked against their version counters (an optimizer step or any
in-place update bumps them) and the cache is dropped when one moved. Writes through `param.data` bump no version
counter; like a hand-written region, a `.data` write between two calls with no optimizer step in between is not seen.
The cache is also checked when a module runs under the script's own autocast (which would otherwise find automp's
copies in the same thread-local cache), dropped before any optimizer step (the step changes the weights anyway, and
the copies, which the backward no longer needs, would sit in memory while the step allocates its state), dropped
when a module that filled it has been freed (the copies' autograd edges would keep its parameters alive), and
dropped when automp is disabled. Calls without grad (an evaluation pass) keep nothing: torch before
pytorch/pytorch#165068 cached copies cast there without their autograd edge, and the next training call would have
reused them and left the weights without gradient (#112583).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterable, Iterator

import torch


class SharedCasts:
    def __init__(self) -> None:
        # id -> (parameter, its version and storage address when last used; `.to()` swaps `.data` with no version bump)
        self._cast: dict[int, tuple[weakref.ref, int, int]] = {}
        # The modules whose calls filled the cache. A cached copy's autograd edge keeps its parameter alive, so a model
        # the script drops would live on in the cache: a dead owner clears it.
        self._owners: dict[int, weakref.ref] = {}

    def check(self) -> None:
        """Drop the cache if a parameter cast through it changed since, or a module that filled it was freed."""
        if any(owner() is None for owner in self._owners.values()):
            self.clear()
            return
        for ref, version, ptr in self._cast.values():
            p = ref()
            if p is None or p._version != version or p.data_ptr() != ptr:
                self.clear()
                return

    def clear(self) -> None:
        if self._cast:
            torch.clear_autocast_cache()
            self._cast.clear()
        self._owners.clear()

    @contextlib.contextmanager
    def region(self, device_type: str, dtype: torch.dtype, owner: torch.nn.Module,
               params: Iterable[torch.Tensor]) -> Iterator[None]:
        """torch.autocast(device_type, dtype) around a call of `owner`, whose exit leaves the cast cache to the next
        call."""
        if not torch.is_grad_enabled():  # an evaluation pass: a plain region, whose exit empties the cache. Before
            self.clear()                 # pytorch#165068 a copy cast here had no autograd edge, and a training call
            with torch.autocast(device_type, dtype=dtype):  # reusing it left the weights without gradient (#112583)
                yield
            return
        self.check()
        self._owners[id(owner)] = weakref.ref(owner)
        for p in params:
            if p.requires_grad:  # autocast caches only leaves that require grad; recorded first, so a call that
                self._cast[id(p)] = (weakref.ref(p), p._version, p.data_ptr())  # raises still leaves its casts checked
        torch.autocast_increment_nesting()
        try:
            with torch.autocast(device_type, dtype=dtype):
                yield
        finally:
            torch.autocast_decrement_nesting()
