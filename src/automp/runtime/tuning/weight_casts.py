"""The eager path's weight casts, made once per optimizer step as in a hand-written autocast region.

torch.autocast caches the low-precision copy of each parameter it casts, and drops the cache when the outermost
region ends. A hand-written GAN loop runs `D(real)` and `D(fake.detach())` in one region, so D's weights are cast
once (and their gradients cast back once, in one ToCopyBackward). automp's eager path enters autocast per root-module
call, so each call ended the region, dropped the cache, and cast every weight again: the zoo's DCGAN launched
twice as many weight casts forward and backward, on a step that is launch-bound (the GPU idle for most of it), and
ran measurably behind the hand-written loop.

`SharedCasts.enter` keeps the cache across calls: it opens one extra autocast nesting level around automp's own
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

Calls inside a torch.func transform (`grad(loss_fn)(params, ...)` around `functional_call`) and modules whose
parameters have no storage of their own (tensor subclasses such as DTensor) keep nothing either, and run in a plain
region: the tensors such a module computes with are wrappers that live only for one transform, or have no data
pointer to check a cached copy against, so a copy kept past the call could be neither trusted nor released.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch._C._functorch import maybe_current_level
from torch.nn.parameter import is_lazy

from automp.runtime.compiled_paths import ORIG_CALL


class SharedCasts:
    """The hot path of automp's eager path (every root-module call): plain C calls rather than a torch.autocast object
    (its constructor validates the device and dtype, already chosen here, and its enter/exit look for an export
    tracer, which never sees automp's calls: a traced call passes through), and each module's parameters recorded
    once per cache lifetime rather than at every call."""

    def __init__(self) -> None:
        # (parameter, its version and storage address when first cast; `.to()` swaps `.data` with no version bump).
        # Held strongly, as the cached copies' autograd edges hold them anyway, until the cache is dropped.
        self._cast: list[tuple[torch.Tensor, int, int]] = []
        # The modules whose calls filled the cache. A cached copy's autograd edge keeps its parameter alive, so a model
        # the script drops would live on in the cache: a dead owner clears it.
        self._owners: dict[int, weakref.ref] = {}

    def check(self) -> None:
        """Drop the cache if a parameter cast through it changed since, or a module that filled it was freed."""
        for owner in self._owners.values():
            if owner() is None:
                self.clear()
                return
        for p, version, ptr in self._cast:
            if p._version != version or p.data_ptr() != ptr:
                self.clear()
                return

    def clear(self) -> None:
        if self._cast:
            torch.clear_autocast_cache()
            self._cast = []
        self._owners.clear()

    def enter(self, device_type: str, dtype: torch.dtype, owner: torch.nn.Module,
              params: Iterable[torch.Tensor] | None) -> tuple[bool, torch.dtype, bool, bool]:
        """torch.autocast(device_type, dtype) entered around a call of `owner`, one nesting level deeper, so that its
        exit (`exit`, given what this returns) leaves the cast cache to the next call. `params` None: a plain region
        that shares nothing (a call inside a torch.func transform)."""
        share = params is not None and torch.is_grad_enabled()
        if share:
            self.check()
            if params and id(owner) not in self._owners:  # none: a lazy module's first call (recorded at the next)
                # autocast caches only leaves that require grad; recorded before the call, so a call that raises
                # still leaves its casts checked
                try:
                    cast = [(p, p._version, p.data_ptr()) for p in params if p.requires_grad]
                except RuntimeError:  # a parameter without storage: its cached copy could not be checked
                    share = False
                else:
                    self._owners[id(owner)] = weakref.ref(owner)
                    self._cast += cast
        if share:
            torch.autocast_increment_nesting()
        else:  # a plain region, whose exit empties the cache (a torch.func call, storage-less parameters, or an
            self.clear()  # evaluation pass: before pytorch#165068 a copy cast there had no autograd edge, and a
            #               training call reusing it left the weights without gradient, #112583)
        state = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
                 torch.is_autocast_cache_enabled(), share)
        torch.set_autocast_enabled(device_type, True)
        torch.set_autocast_dtype(device_type, dtype)
        torch.autocast_increment_nesting()
        torch.set_autocast_cache_enabled(True)
        return state

    @staticmethod
    def exit(device_type: str, state: tuple[bool, torch.dtype, bool, bool]) -> None:
        enabled, dtype, cache, shared = state
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)
        torch.set_autocast_cache_enabled(cache)
        if shared:
            torch.autocast_decrement_nesting()

    def call(self, module: torch.nn.Module, root: Any, args: tuple, kwargs: dict) -> Any:
        """`module(*args, **kwargs)` as written, under autocast with `root.low`, its weight casts shared (the eager
        path of automp.runtime.paths' `Root`, whose parameter list is kept in `root.params`)."""
        params = root.params
        if maybe_current_level() is not None:  # inside torch.func: the module may compute with the transform's
            params = None  # wrappers (functional_call), which outlive neither the transform nor a cache check
        elif params is None:  # a lazy module's (nn.LazyLinear) parameters exist after its first call
            params = list(module.parameters())
            if any(is_lazy(p) for p in params):
                params = ()
            else:
                root.params = params
        state = self.enter(root.device.type, root.low, module, params)
        try:
            return ORIG_CALL(module, *args, **kwargs)
        finally:
            self.exit(root.device.type, state)
