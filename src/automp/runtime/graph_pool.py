"""CUDA graphs' private memory pool (Inductor's cudagraph trees), where automp must do more than torch.compile does.

A replay writes its outputs into memory the pool owns, and when the next generation starts (a compiled forward after a
backward) the tree frees whatever the last one left alive and makes any access to it an error. Two consequences for a
path the user did not ask for:

1. Gradients. A backward replayed into the pool hands each parameter whose .grad is None a gradient that lives in the
   pool (AccumulateGrad steals it). A script that keeps gradients across the next forward (accumulation over micro-
   batches, zero_grad(set_to_none=False)) then fails in its next backward with "accessing gradient tensor output of
   CUDAGraphs that has been overwritten", where the same script without automp ran. `GradRescue` copies such
   gradients out of the pool just before a replay would free them (with it, four loop shapes trained bit-identically to
   the same graphs without CUDA graphs). The tutorial loop (forward, zero_grad, backward, step) also reaches a forward
   with gradients alive, and sets them to None right after: there the copies are wasted time and memory, so once copies
   were replaced by a new backward's gradients LEARN times in a row, the loop is taken to be that one and copying stops.
   (A loop that zeroes at its top and accumulates drops its copies at each step too, but reaches the next forward with
   no gradient: that is no evidence, and copying goes on. Counting it as a drop would stop the copies of such a loop
   after two steps and silently change its result.)
   What is learned also serves the trial's paths without graphs (`release`): once a loop is known to set the last
   step's gradients to None after its forward, they are set to None as the forward starts. Under
   compile(mode="reduce-overhead") the hand-written loop's replay reuses their memory; on a compiled or eager
   candidate, and in the graph trees' warm-up run, they stayed alive through the forward, one FP32 gradient of every
   parameter above that loop's peak. Only while the trial runs: a loop that changed its order later would lose them.
2. Memory. A pool stays reserved while any function that replays into it is alive, and Dynamo keeps compiled
   functions for the life of the process: CUDA graphs recorded for a trial they lost would keep their pool (the
   zoo's ConvNeXt then held about twice the hand-written loop's reserved memory on the path that won).
   `PoolRelease` gives the pool back (torch's reset of the trees) once nothing in it is alive, when automp's were the
   only CUDA graphs of the process: released, that ConvNeXt reserves about what the hand-written loop does.
   Graphs a script compiled itself are never touched: the pool is kept, and the report says so.

Both reach into torch._inductor.cudagraph_trees (torch 2.11-2.13). Where its internals are not as expected, the
rescue copies every gradient (the safe side) and the pool is kept.
"""
from __future__ import annotations

import enum
import weakref
from typing import Any, Callable, Iterable

import torch

SEEN_CALLS = 8  # the forward and backward graphs exist after a trial's warm-up: counted for this many calls
RELEASE_TRIES = 100  # module calls a release waits for the pool's tensors to die, then it is kept
LEARN = 2  # copies dropped unread this many forwards in a row: the loop sets gradients to None after its forward


def _containers() -> dict | None:
    """This thread's cudagraph trees, one per device index (torch keeps them thread-local); None when unknown."""
    try:
        from torch._inductor import cudagraph_trees as trees
        return dict(trees.get_obj(trees.local, "tree_manager_containers"))
    except (ImportError, AttributeError, RuntimeError):
        return None


_UNKNOWN = object()


def _container(device_index: int):
    containers = _containers()
    return _UNKNOWN if containers is None else containers.get(device_index)


def live_storages(device_index: int) -> set[int] | None:
    """Data pointers of the pool tensors the next generation of `device_index`'s tree frees; None when unknown."""
    container = _container(device_index)
    if container is _UNKNOWN:
        return None
    if container is None:
        return set()
    manager = getattr(container, "tree_manager", None)
    node = getattr(manager, "current_node", None) if manager is not None else None
    if node is None:
        return set()
    try:
        return {ref.data_ptr() for ref in node.path_live_weakrefs()}
    except (AttributeError, RuntimeError):
        return None


def graph_functions(device_index: int) -> int | None:
    """How many compiled functions replay into `device_index`'s tree now; None when unknown."""
    container = _container(device_index)
    if container is _UNKNOWN:
        return None
    if container is None:
        return 0
    return getattr(container, "live_cudagraphify_fns", None)


class GradRescue:
    """One module's gradients and CUDA graphs' pool: before each replay of its graphs, its parameters' gradients that
    live in the pool are copied out of it (see the module docstring). One per module, shared by all its paths: every
    call of the module, graphed or not, shows whether the gradients alive at its forward outlive it, so a loop that
    drops them is known before its first replay (a trial runs the compiled paths first), and no candidate graphed
    after another starts copying again: each copy is a second set of gradients at the peak of the step."""

    def __init__(self, device_index: int, params: Iterable[torch.Tensor]):
        self.device_index = device_index
        self.params = [weakref.ref(p) for p in params if p.requires_grad]  # weakly: see compiled_paths.entry_point
        self.copying = True
        self.dropped = 0  # forwards in a row whose previous gradients were all dropped unread
        self.seen: list[weakref.ref] = []  # the gradients alive at the previous forward

    def _with_grad(self) -> list[torch.Tensor]:
        return [p for p in (ref() for ref in self.params) if p is not None and p.grad is not None]

    def _learn(self, with_grad: list[torch.Tensor]) -> bool:
        """Whether copying goes on, from what became of the gradients alive at the previous forward."""
        if self.seen:
            if any(ref() is not None for ref in self.seen):
                self.dropped = 0
            elif with_grad:  # they were dropped, and a backward made new ones: set to None before it
                self.dropped += 1
            # dropped with no gradient since (zero_grad at the top of a loop that accumulates): no evidence either way
            self.seen = []
            if self.dropped >= LEARN:
                self.copying = False
        return self.copying

    def _remember(self, with_grad: list[torch.Tensor]) -> None:
        self.seen = [weakref.ref(p.grad) for p in with_grad if p.grad.layout is torch.strided]

    def observe(self) -> None:
        """Once per call of the module by the script, before it runs on any path: learns from what became of the
        gradients alive at the previous call, and remembers those alive now."""
        if self.copying:
            with_grad = self._with_grad()
            if self._learn(with_grad):
                self._remember(with_grad)

    def release(self) -> int:
        """Sets to None, at a call of the module, the gradients a loop was learned to set to None after its forward
        (copying off); returns the bytes it released. Before that, none: a loop that accumulates keeps them."""
        if self.copying:
            return 0
        with_grad = self._with_grad()
        freed = sum(p.grad.numel() * p.grad.element_size() for p in with_grad)  # a DTensor's or sparse one's too
        for p in with_grad:
            p.grad = None
        return freed

    def _copy_out(self, with_grad: list[torch.Tensor]) -> int:
        """Replaces each of these gradients that lives in the pool by a copy of its own; returns how many."""
        live, copied = live_storages(self.device_index), 0
        for p in with_grad:
            if p.grad.layout is not torch.strided:  # a sparse gradient has no storage, and the pool holds none
                continue
            if live is None or p.grad.untyped_storage().data_ptr() in live:
                p.grad = p.grad.clone()
                copied += 1
        return copied

    def evacuate(self) -> int:
        """Copies every gradient that lives in the pool out of it, whatever the loop was learned to do: the pool is
        about to be given back (graphs dropped after their warm-up) and no replay will copy them. Returns how many."""
        return self._copy_out(self._with_grad())

    def before_replay(self) -> int:
        """Copies out what the replay would free (after `observe` for the same call); returns how many it copied."""
        if not self.copying:
            return 0
        with_grad = self._with_grad()
        copied = self._copy_out(with_grad)
        if copied:
            self._remember(with_grad)  # the copies are what the loop keeps or drops now
        return copied


def rescue_of(root: Any, module: torch.nn.Module) -> GradRescue:
    """The root's GradRescue, made at its first need (its first training call on CUDA, or its first graphed path)."""
    if root.rescue is None:
        root.rescue = GradRescue(device_index(root.device), module.parameters())
    return root.rescue


def before_call(root: Any, module: torch.nn.Module, release: bool = False) -> int:
    """A call of a root module by the script, on whatever path it will run: its GradRescue learns from it, and with
    `release` sets the gradients the loop drops after this forward to None now; returns the bytes released."""
    if not (torch.is_grad_enabled() and (root.rescue is not None or root.device.type == "cuda" or release)):
        return 0
    rescue = rescue_of(root, module)
    rescue.observe()
    return rescue.release() if release else 0


def device_index(device: torch.device) -> int:
    """A CUDA device's index, the current device's where it names none."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


class Release(enum.Enum):
    """What became of a pool automp left: RELEASED, KEPT (not its own, or torch's internals unknown: for good) or
    PENDING (tensors in it still alive: ask again later)."""
    RELEASED = "released"
    KEPT = "kept"
    PENDING = "pending"


class PoolRelease:
    """Gives back the pool of CUDA graphs automp recorded and no longer replays. `seen` follows automp's graphed
    calls (how many graph functions the tree had, so one the script compiled itself is noticed); `attempt` releases
    when it is safe and says whether the matter is closed (released, or never possible)."""

    def __init__(self, device_index: int):
        self.device_index = device_index
        before = graph_functions(device_index)
        self.foreign = before is None or before > 0  # the script's own CUDA graphs (or unknown): never release
        self.ours = 0
        self.calls = 0

    def seen(self) -> None:
        self.calls += 1
        if self.calls > SEEN_CALLS:
            return
        n = graph_functions(self.device_index)
        self.ours = max(self.ours, n or 0)
        if n is None:
            self.foreign = True

    def attempt(self) -> Release:
        n, containers = graph_functions(self.device_index), _containers()
        if self.foreign or n is None or n > self.ours or containers is None:
            return Release.KEPT
        # torch resets the trees of every device at once: another device's graphs must not be the script's own
        if any(getattr(c, "live_cudagraphify_fns", 1) for i, c in containers.items() if i != self.device_index):
            return Release.KEPT
        live = live_storages(self.device_index)
        if live is None:
            return Release.KEPT
        if live:
            return Release.PENDING
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees
        reset_cudagraph_trees()
        torch.cuda.empty_cache()
        return Release.RELEASED


class Releasing:
    """A pool on its way back, asked again at each module call until it is closed (RELEASE_TRIES at most), then
    reported through `report` (the recorder's add_setting)."""

    def __init__(self, pool: PoolRelease, report: Callable[[dict], None]):
        self.pool, self.report, self.tries = pool, report, 0

    def retry(self, last: bool = False) -> Releasing | None:
        """Itself while the pool's tensors are alive, None once closed and reported. last: no later call (disable)."""
        outcome = self.pool.attempt()
        self.tries += 1
        if outcome is Release.PENDING and not last and self.tries < RELEASE_TRIES:
            return self
        why = {Release.RELEASED: "given back: automp no longer replays CUDA graphs",
               Release.KEPT: "kept: CUDA graphs the script compiled itself share it, or torch's cudagraph trees are "
                             "not as automp knows them",
               Release.PENDING: "kept: tensors in it are still alive (gradients kept across steps?)"}[outcome]
        value = Release.KEPT if outcome is Release.PENDING else outcome
        self.report({"setting": "CUDA graphs memory pool", "value": value.value, "reason": why})
        return None
