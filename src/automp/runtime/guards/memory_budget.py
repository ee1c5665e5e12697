"""The trial's memory budget: an eager candidate may hold no more device memory than the hand-written loop's path.

Why: eager paths save for the backward every activation that Inductor fuses away or recomputes. At Llama-3.2-1B
widths the low-precision eager step peaked at about three times stock Inductor's memory under autocast, and its
trial's peak was the eager candidate's, well above the reduce-overhead loop's (BENCHMARKS.md, "Trial memory"). A
script that fits under the strongest loop could then run out of memory in automp's trial, before automp had chosen
anything.

How: on CUDA the anchor's path (Route.COMPILED_AUTOCAST, what a careful user writes) is the trial's first candidate
(after the CUDA-graph path's warm-up run where automp.runtime.trial.TrialConfig.early_warmup asks for it). The peak
allocated memory of the process up to the end of its first iteration (forward, backward and optimizer step) is the
budget. It is read at the end of the forward, when the backward has run through the forward's outputs, and when the next
call begins, and the highest reading counts: a script (or a benchmark) that resets torch's peak statistics at each step
would otherwise leave only what is allocated between steps, far under the iteration's peak (GPT-2's budget fell under
the floor that way, and its eager candidate, never stopped, held far more than the anchor's peak). The first call of
each eager candidate then runs with a check at every module's entry and exit: what is allocated on the device (the
activations the backward will need, and the forward's live temporaries), and twice the largest tensor a module returned
so far, past the budget, raises OverBudget inside the forward, before anything reached the script. The twice: the
backward starts from the last activations with most of the saved ones still alive, and the gradient of the largest (a
language model's logits) and its cast come on top. Checked at module boundaries, not in a saved-tensor hook: a hook that
hands autograd the tensor itself makes a cycle between an op's saved output and its node, which only that node's
backward breaks; a forward stopped in the middle has no backward, and GPT-2's stopped forward kept every activation it
had saved for the rest of the run. The trial drops that candidate (rule trial-over-memory) and runs the call again on
the next one, as it does after an out-of-memory error (automp.runtime.paths.RootPaths.over_budget), with the module's
buffers as they were before the aborted call (a BatchNorm's running statistics are updated once).

Where the anchor's peak is under `floor` of the device's memory there is no budget: a few hundred megabytes more
cannot make a fitting script run out of memory, and a small, host-bound model may run fastest eager. The check is
an estimate of the eager step's peak, not a bound (what a module allocates and frees between two boundaries is not
in it); compiled candidates are not guarded (their memory is Inductor's, as the anchor's is).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

from automp.runtime.decisions import EAGER_PATHS, Route


class OverBudget(RuntimeError):
    """An eager candidate's estimated peak passed the trial's memory budget (raised inside its forward)."""

    def __init__(self, path: Route, used: int, limit: int) -> None:
        self.path, self.used, self.limit = path, used, limit
        super().__init__(f"{path.value} held {gib(used)} GiB by its estimate (allocated, the largest output twice "
                         f"more), over the trial's budget of {gib(limit)} GiB")


@dataclass
class DeviceMemory:
    """What the budget reads of one device: bytes allocated now, the peak so far, the device's total."""

    allocated: Callable[[], int]
    peak: Callable[[], int]
    total: int
    device: torch.device


def cuda_memory(device: torch.device) -> DeviceMemory | None:
    """torch.cuda's figures for a CUDA device; None elsewhere (no compiled candidates off CUDA, so no anchor)."""
    if device.type != "cuda":
        return None
    return DeviceMemory(lambda: torch.cuda.memory_allocated(device), lambda: torch.cuda.max_memory_allocated(device),
                        torch.cuda.get_device_properties(device).total_memory, device)


@dataclass
class MemoryBudget:
    """One trial's budget. `begin(path)` at every call of the trial's modules; `guard(path)` around the call."""

    memory: DeviceMemory
    slack: float = 0.0  # the eager candidate's estimate against the anchor's peak, as measured
    floor: float = 0.03
    limit: int | None = None  # bytes; None until the anchor's first iteration ended, or where there is none
    record: dict[str, Any] | None = None  # what the budget was set from (in a dropped candidate's verdict bounds)
    passed: set[Route] = field(default_factory=set)  # eager paths whose guarded first call stayed within it
    _last: Route | None = None
    _seen: int = 0  # the highest peak read during the anchor's first iteration
    _hooks: list[Any] = field(default_factory=list)  # the autograd hooks that read it

    def observe(self) -> None:
        """Reads the peak so far, during the anchor's first iteration."""
        self._seen = max(self._seen, self.memory.peak())

    def begin(self, path: Route) -> None:
        """A call on `path` begins; the call before it has ended, its backward and optimizer step included."""
        if self._last is Route.COMPILED_AUTOCAST and self.record is None:
            self.observe()
            self._unhook()
            peak, total = self._seen, self.memory.total
            self.record = {"anchor_peak_gib": gib(peak), "device_gib": gib(total)}
            if peak >= self.floor * total:
                self.limit = int(peak * (1 + self.slack))
                self.record["limit_gib"] = gib(self.limit)
        self._last = path

    def cancel(self) -> None:
        """The call that began did not finish (it raised): its peak is no iteration's."""
        self._last = None
        self._unhook()
        self._seen = 0

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def returned(self, path: Route, out: Any) -> None:
        """The anchor's first call returned `out`: the peak is read again when the backward has run through the
        autograd nodes of its outputs (for a compiled call, one node: its whole backward), before a reset of the
        peak statistics at the next step's start could lose it. Hooks on the autograd graph, after the compiled call
        returned, are out of Dynamo's sight (hooks on the parameters would be in its guards)."""
        if path is not Route.COMPILED_AUTOCAST or self.record is not None:
            return
        self.observe()
        for node in _grad_nodes(out):
            self._hooks.append(node.register_hook(lambda *_: self.observe()))

    @contextlib.contextmanager
    def guard(self, path: Route, module: torch.nn.Module | None = None) -> Iterator[None]:
        """The call of `module` on `path`, checked against the budget at every module's entry and exit (its first
        call, eager paths only). Over it, `module`'s buffers are put back as they were before the call: the call runs
        again on another path, and running statistics (and BatchNorm's count of batches) must be updated once."""
        if self.limit is None or path not in EAGER_PATHS or path in self.passed or not torch.is_grad_enabled():
            yield
            return
        limit, device, largest = self.limit, self.memory.device, [0]
        buffers = [] if module is None else [(b, b.detach().clone()) for b in module.buffers()]

        def check(out: Any = None) -> None:
            if out is not None:
                largest[0] = max(largest[0], _largest_bytes(out, device))
            used = self.memory.allocated() + 2 * largest[0]
            if used > limit:
                raise OverBudget(path, used, limit)

        entry = torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, args: check())
        exit_ = torch.nn.modules.module.register_module_forward_hook(lambda mod, args, out: check(out))
        try:
            yield
        except OverBudget:
            with torch.no_grad():
                for b, copy in buffers:
                    b.copy_(copy)
            raise
        finally:
            entry.remove()
            exit_.remove()
        self.passed.add(path)


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors a call returned; a ModelOutput's fields read as stored, not through the lazy cast of
    automp.runtime.outputs (a read there would count as the script's)."""
    leaves = list(dict.values(out)) if isinstance(out, dict) else pytree.tree_leaves(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _largest_bytes(out: Any, device: torch.device) -> int:
    """The largest storage among the tensors a module returned on `device`."""
    sizes = [0]
    for t in _tensors(out):
        if t.device == device:
            try:
                sizes.append(t.untyped_storage().nbytes())
            except (RuntimeError, NotImplementedError):  # a tensor without storage of its own: not counted
                pass
    return max(sizes)


def _grad_nodes(out: Any) -> set[Any]:
    """The autograd nodes of the tensors a call returned."""
    return {t.grad_fn for t in _tensors(out) if t.grad_fn is not None}


def gib(n: int) -> float:
    return round(n / 2**30, 3)
