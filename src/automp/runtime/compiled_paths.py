"""How a root module's compiled paths are built: automp's graph pass (Route.COMPILED) and stock Inductor under
torch.autocast (Route.COMPILED_AUTOCAST), replayed as CUDA graphs or not (Route.GRAPHED). The session (session.py)
decides which one a module runs; what is built here must leave the module collectable (entry_point says why) and give
each module a code object of its own.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from automp.frames import own_code
from automp.precision.fp8.layers import active as fp8_active
from automp.runtime import graph_pool
from automp.runtime.compile_log import CompileLog
from automp.runtime.decisions import FP8_PATHS, GRAPHED_PATHS, Route
from automp.runtime.outputs import out_of_pool, restore_outside_graph
from automp.runtime.guards.unread_outputs import detach_unread

ORIG_CALL = nn.Module.__call__  # taken at import, before a session patches it
_entry_ids = itertools.count()


def automp(module: nn.Module, root: Any, backend: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile with automp's backend (graph/capture.make_backend)."""
    return bound(torch.compile(entry_point(module, root), backend=counted(root, backend)), module)


# Inductor's CUDA graphs (cudagraph trees), as torch.compile(mode="reduce-overhead") sets them. Not with
# triton.cudagraph_skip_dynamic_graphs: it split the Llama-style model's graphs into dozens of partitions around ops
# it took for dynamic, one of which was recorded again at every step, making the step several times slower than
# without it. A graph whose shapes do vary is left by the session instead (Session._leave_graphs).
GRAPH_PATCHES = {"triton.cudagraphs": True}


def compile_patches(graphs: bool, device_type: str) -> dict[str, Any]:
    """Inductor's config for a stock path's graphs. A trial compiles the same graphs twice, once replayed as CUDA
    graphs and once not, and Inductor's and AOTAutograd's caches key on `triton.cudagraphs`: two full compiles, most
    of what a first run costs beyond a hand-written loop, which compiles once. On CUDA both paths compile with CUDA
    graphs on, and the plain one's graphs are left unwrapped after the compile or a cache load, so the second compile
    is a cache hit: by a policy that wraps none where torch has `cudagraph_policy` (2.13: not in the cache key), by
    `unwrapped` before that. Off CUDA, or where neither is possible, the plain path compiles without CUDA graphs, as
    `torch.compile` does."""
    if graphs:
        return dict(GRAPH_PATCHES)
    if device_type != "cuda":
        return {}
    policy = _unwrapped_policy()
    if policy is not None:
        return {**GRAPH_PATCHES, "cudagraph_policy": policy}
    return dict(GRAPH_PATCHES) if _emulates(graphs, device_type) else {}


# Why `unwrapped` was given up in this process (the error of the compile that failed under it); empty while in use.
UNWRAPPED_FAILED: list[str] = []


def _emulates(graphs: bool, device_type: str) -> bool:
    """Whether the plain path's compile leaves its graphs unwrapped by `unwrapped` (torch 2.11-2.12 on CUDA)."""
    return (not graphs and device_type == "cuda" and _unwrapped_policy() is None and _post_compile_flag()
            and not UNWRAPPED_FAILED)


def inductor_compile(gm: Any, example_inputs: Any, graphs: bool, device_type: str,
                     inner: Callable[..., Any] | None = None) -> Any:
    """Inductor's compile of a stock path's graph (compile_patches, unwrapped; `inner`: compile_fx's per-graph
    compile, default its own). Where the compile under `unwrapped` fails, it is given up for the rest of the process
    and the graph compiles as torch.compile compiles it: a torch whose post_compile is not as `unwrapped` expects must
    cost a second compile, not the module's compiled path."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    kw = {"inner_compile": inner or compile_fx_inner, "config_patches": compile_patches(graphs, device_type)}
    if _emulates(graphs, device_type):
        try:
            with unwrapped(graphs, device_type):
                return compile_fx(gm, example_inputs, **{**kw, "inner_compile": _unwrapped_inner(kw["inner_compile"])})
        except Exception as e:  # noqa: BLE001 - see the docstring; a genuine compile error fails again below
            UNWRAPPED_FAILED.append(f"{type(e).__name__}: {str(e).strip()[:200]}")
    return compile_fx(gm, example_inputs, **kw)


@contextlib.contextmanager
def unwrapped(graphs: bool, device_type: str) -> Iterator[None]:
    """Around the plain path's compile on a torch without `cudagraph_policy`: every graph compiled, or loaded from the
    caches, inside is left unwrapped. CompiledFxGraph.post_compile, which wraps a graph in CUDA graphs when its
    `cudagraphs` flag is on, is given a flag of its own turned off, what 2.13's policy does at the same place. The
    compile's own flag, one box shared by its forward and backward, stays on: a graph compiled with it off would be
    cached without what wrapping it needs (2.11 asserts `cudagraph_info` when the graphed path loads such a backward
    from AOTAutograd's cache, and compiles both again). The class is patched for the compile only, and put back after
    it; a backward compiled later, at its first call, is compiled inside the same patch (`_unwrapped_inner`)."""
    if not _emulates(graphs, device_type):
        yield
        return
    with _post_compile_unwrapped():
        yield


@contextlib.contextmanager
def _post_compile_unwrapped() -> Iterator[None]:
    from torch._inductor.output_code import CompiledFxGraph
    from torch._inductor.utils import BoxedBool
    original = CompiledFxGraph.__dict__["post_compile"]

    def post_compile(self: Any, example_inputs: Any, constants: Any, graph_kwargs: Any) -> Any:
        return original(self, example_inputs, constants, {**graph_kwargs, "cudagraphs": BoxedBool(False)})
    CompiledFxGraph.post_compile = post_compile
    try:
        yield
    finally:
        CompiledFxGraph.post_compile = original


def _unwrapped_inner(inner: Callable[..., Any]) -> Callable[..., Any]:
    """compile_fx's per-graph compile for the plain path, inside `unwrapped`: AOTAutograd compiles a backward at its
    first call, after the backend (and its patch) has returned."""
    def compile_graph(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        with _post_compile_unwrapped():  # whatever UNWRAPPED_FAILED says by then: its forward was left unwrapped
            return inner(gm, example_inputs, **kwargs)
    return compile_graph


@functools.cache
def _post_compile_flag() -> bool:
    """Whether this torch's CompiledFxGraph.post_compile takes the compile's `cudagraphs` box in graph_kwargs (torch
    2.6-2.13), so that `unwrapped` can hand it a box of its own, off; if not, the plain path compiles on its own."""
    import inspect
    try:
        from torch._inductor.output_code import CompiledFxGraph
        from torch._inductor.utils import BoxedBool
    except ImportError:
        return False
    method = CompiledFxGraph.__dict__.get("post_compile")
    if method is None or not isinstance(BoxedBool, type):
        return False
    try:  # the box must be the one post_compile reads before it wraps anything
        reads_box = 'graph_kwargs["cudagraphs"]' in inspect.getsource(method)
    except (OSError, TypeError):
        return False
    return reads_box and list(inspect.signature(method).parameters) == ["self", "example_inputs", "constants",
                                                                         "graph_kwargs"]


@functools.cache
def _unwrapped_policy() -> Any:
    """A CUDAGraphPolicy that wraps no graph, or None where torch has no policies (torch before 2.13)."""
    import torch._inductor.config as inductor_config
    try:
        from torch._inductor.cudagraph_utils import CUDAGraphPolicy
    except ImportError:
        return None
    if not hasattr(inductor_config, "cudagraph_policy") or not hasattr(CUDAGraphPolicy, "should_wrap"):
        return None

    class Unwrapped(CUDAGraphPolicy):
        def should_wrap(self, compiled_graph: Any) -> bool:
            return False
    return Unwrapped()


# CUDA graphs keep a memory pool of their own: the Llama-style step peaked noticeably higher with them than the same
# graphs without them. A trial offers them only while the script's peak so far leaves room.
GRAPH_MEMORY_SHARE = 0.5


def graphs_fit(peak_bytes: int, total_bytes: int) -> str | None:
    """Why CUDA graphs are not tried for a script that has reserved up to `peak_bytes` of a device's `total_bytes`,
    or None when they fit: near its memory limit, a pool of their own could run out of memory where the script as
    written did not."""
    if peak_bytes <= GRAPH_MEMORY_SHARE * total_bytes:
        return None
    return (f"{Route.GRAPHED.value} not tried: the script has reserved up to {peak_bytes / 2**30:.1f} of the device's "
            f"{total_bytes / 2**30:.1f} GiB, and CUDA graphs keep a memory pool of their own")


# After the graphs' early warm-up (automp.runtime.trial.TrialConfig.early_warmup) their pool stays reserved until they
# record, and the next candidate's step needs about the warm-up's peak again beside it: both must fit in this share.
EARLY_POOL_SHARE = 0.9


def early_pool_fits(device: torch.device) -> str | None:
    """Why the pool the graphs' early warm-up left reserved leaves no room for another candidate's step on `device`
    (the process's peak reserved so far, the warm-up's, once more beside the pool), or None where it does."""
    if device.type != "cuda":
        return None
    peak, total = device_memory(device)
    index = graph_pool.device_index(device)
    pool = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
               if s.get("device") == index and tuple(s.get("segment_pool_id", (0, 0))) != (0, 0))
    if peak + pool <= EARLY_POOL_SHARE * total:
        return None
    return (f"{Route.GRAPHED.value} not tried: its warm-up peaked at {peak / 2**30:.1f} GiB reserved and its pool "
            f"keeps {pool / 2**30:.1f} of the device's {total / 2**30:.1f} GiB: another candidate's step would not "
            f"fit beside it")


def release_cached(device: torch.device) -> None:
    """Gives back the device memory torch's caching allocator keeps for tensors that are gone, around CUDA graphs in a
    trial: their pool cannot reuse it, so before their recording it would sit beside the pool (the other candidates'
    activations, as large as the pool), and once they win those activations do not come back."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(peak bytes reserved so far, total bytes) of a CUDA device; None elsewhere (no CUDA graphs there)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(device), torch.cuda.get_device_properties(device).total_memory


def stock(module: nn.Module, root: Any, path: Route = Route.COMPILED_AUTOCAST,
          rewrite: Callable[[Any, Any], Any] | None = None) -> Callable[..., Any]:
    """`path` (one of AUTOCAST_PATHS): torch.autocast + stock torch.compile, what a careful user writes by hand: the
    autocast region around the compiled call, as a user's `with autocast(): model(x)` is. Entered inside the compiled
    function instead, the region is part of the traced graph and compiles to different kernels: the BERT-base MLM
    step ran GEMMs in FP32 that the hand-written loop runs in bf16, its GEMM kernels taking several times as long
    (kernel profiles); around the call it matches the hand-written loop kernel for kernel. The outputs go back to
    FP32 inside the compiled function (Inductor fuses the cast), as on every other path: the script sees its own
    dtypes; a ModelOutput's fields only when read (automp.runtime.outputs).

    Route.GRAPHED: the same graphs replayed as CUDA graphs. A transformer step of 110M parameters launches a few
    hundred kernels, and on a fast GPU the step takes longer than its kernels: the rest is host work, and how
    much depends on the host (the same step varied widely between hosts of one kind). Replayed, the step runs at about
    its kernels' time, without that spread (BENCHMARKS.md, "Host-bound anchors"). What the call returns is copied
    out of the graph's memory (outputs.out_of_pool), and so are gradients the next replay would free
    (graph_pool.GradRescue, the root's: shared by its paths); the returned function's `pool` gives the graphs' memory
    back once the session leaves them (graph_pool.PoolRelease).

    Route.FP8_COMPILED, Route.FP8_GRAPHED: the same with the module's FP8 layers switched on around the call
    (automp.precision.fp8.active): its graphs are compiled, and guarded, with FP8 GEMMs in those layers.

    rewrite: `rewrite(gm, example_inputs) -> gm`, applied to each graph Dynamo captures before Inductor compiles it
    (the session's graph rewrites: `rewrites`)."""
    entry, device, low, fields = entry_point(module, root), root.device.type, root.low, root.fields
    graphs, log = path in GRAPHED_PATHS, CompileLog(root, path.value)
    switch = fp8_active if path in FP8_PATHS else contextlib.nullcontext  # FP8 layers are off outside fp8.active()

    def restored(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return restore_outside_graph(entry(mod, *args, **kwargs))
    restored = own_code(restored, f"{entry.__name__}_autocast")  # the frame Dynamo compiles: see entry_point

    def inductor(gm: Any, example_inputs: Any) -> Any:
        if rewrite is not None:
            gm = rewrite(gm, example_inputs)
        with keyed_by_autocast():
            return inductor_compile(gm, example_inputs, graphs, device, inner=log.inner)

    compiled = bound(torch.compile(restored, backend=counted(root, log.backend(inductor))), module)
    if not graphs:
        def autocast_call(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast(device, dtype=low), switch():
                return compiled(*args, **kwargs)
        return autocast_call

    rescue, pool = graph_pool.rescue_of(root, module), graph_pool.PoolRelease(graph_pool.device_index(root.device))

    def graphed_call(*args: Any, **kwargs: Any) -> Any:
        rescue.before_replay()
        with torch.autocast(device, dtype=low), switch():
            out = compiled(*args, **kwargs)
        pool.seen()
        return out_of_pool(out, fields.detach)

    graphed_call.pool = pool  # type: ignore[attr-defined]  # for the session, once it leaves the path
    return graphed_call


def rewrites(config: Any, recorder: Any, label: str) -> Callable[[Any, Any], Any] | None:
    """The graph rewrites of a root's compiled paths, those the configuration asks for (config.causal_attention:
    automp.precision.causal_mask; config.fuse_siblings: automp.precision.siblings; config.fuse_linear_ce:
    automp.precision.linear_ce), each site reported once. Holds the root's label, not the root: see entry_point."""
    if not (config.causal_attention or config.fuse_siblings or config.fuse_linear_ce):
        return None
    from automp.precision.causal_mask import CAUSAL_ATTENTION, causal_attention
    from automp.precision.linear_ce import FUSED_LINEAR_CE, fuse_linear_cross_entropy
    from automp.precision.siblings import FUSED_SIBLINGS, fuse_sibling_linears

    def rewrite(gm: Any, example_inputs: Any) -> Any:
        if config.causal_attention:
            gm, masks = causal_attention(gm)
            for mask in masks:
                recorder.add_rewrite(label, CAUSAL_ATTENTION, mask=mask.mask, calls=mask.calls, shape=list(mask.shape))
        if config.fuse_siblings:
            gm, groups = fuse_sibling_linears(gm, example_inputs)
            for group in groups:
                recorder.add_rewrite(label, FUSED_SIBLINGS, weights=list(group.weights), widths=list(group.widths))
        if config.fuse_linear_ce:
            gm, sites = fuse_linear_cross_entropy(gm)
            for site in sites:
                recorder.add_rewrite(label, FUSED_LINEAR_CE, weight=site.weight, vocab=site.vocab)
        return gm
    return rewrite


def autocast_tag() -> str:
    """The ambient autocast state, as the compile caches must tell it apart: `device:dtype` for each device where it
    is enabled."""
    return ",".join(f"{d}:{torch.get_autocast_dtype(d)}" for d in torch._C._autocast_supported_devices()
                    if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def keyed_by_autocast() -> Iterator[None]:
    """Adds the ambient autocast dtype to the compile caches' key (torch.compiler.config.cache_key_tag) while stock
    Inductor compiles a graph traced under it. The stock path enters autocast around the compiled call, so the dtype
    is not in the Dynamo graph, and torch before 2.13 keys AOTAutograd's cache on whether autocast is on, not on its
    dtype (pytorch/pytorch#181564): the ResNet-50 step of automp-fp16 ran bf16 convolutions and GEMMs compiled by an
    earlier bf16 run of the same process (kernel profile), and the cache is on disk, so an fp16 run after a bf16 run
    of the same script would get them too. The user's own tag is kept."""
    tag = autocast_tag()
    if not tag:
        yield
        return
    own = torch.compiler.config.cache_key_tag
    with torch.compiler.config.patch(cache_key_tag=f"{own}|automp-autocast={tag}" if own else f"automp-autocast={tag}"):
        yield


def counted(root: Any, backend: Callable[..., Any]) -> Callable[..., Any]:
    """`backend`, adding one to root.graphs for each graph it compiles (recompiles included); root is held weakly:
    see entry_point."""
    ref = weakref.ref(root)

    def backend_counting(gm: Any, example_inputs: Any) -> Any:
        r = ref()
        if r is not None:
            r.graphs += 1
        return backend(gm, example_inputs)

    return backend_counting


def bound(compiled: Callable[..., Any], module: nn.Module) -> Callable[..., Any]:
    """`compiled` (of an entry_point) with `module` as its first argument, held weakly (see entry_point)."""
    ref = weakref.ref(module)

    def call(*args: Any, **kwargs: Any) -> Any:
        return compiled(ref(), *args, **kwargs)
    return call


def entry_point(module: nn.Module, root: Any) -> Callable[..., Any]:
    """A function that calls `module`, with a code object of its own: Dynamo keeps its compiled graphs (and counts
    recompiles against its limit) per code object, so a shared wrapper would make every module's compilation
    evict the others' and, past the limit, silently run them uncompiled in FP32. Output fields the script does not
    read are detached inside it (automp.runtime.guards.unread_outputs).

    Nothing Dynamo keeps may hold the module or its _Root strongly: Dynamo keeps compiled functions and backends in
    process-wide caches (past automp.disable(), and past torch._dynamo.reset() in torch 2.11), and a _Root holds the
    parameters (for the eager path's casts). When the closures here held the _Root, a model that had run a trial
    would outlive the script's last reference to it with its parameters and gradients (the zoo's LSTM stayed resident
    through the next model's run).

    The module is the function's first argument, as `self` is to the module's own compiled call (torch.compile(model)):
    Dynamo sees it as the hand-written loop's compile does. `bound` supplies the argument, held weakly."""
    fields = root.fields

    def call(mod, *args, **kwargs):
        return detach_unread(ORIG_CALL(mod, *args, **kwargs), fields)

    return own_code(call, f"automp_{type(module).__name__}_{next(_entry_ids)}")
