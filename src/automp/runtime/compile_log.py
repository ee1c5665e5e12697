"""Where a compiled path's first calls spend their time: per path of a root module, the graphs compiled, the seconds
in Dynamo's backend (AOTAutograd's trace and the forward's compile, or their load from the caches), the seconds
compiling backwards (AOTAutograd compiles a backward at its first call, after the backend has returned), and the hits
in AOTAutograd's and Inductor's FX graph caches.

A first run's cost beyond the hand-written loop, which compiles once, is mostly these seconds; and whether the graphed
path found the compiled path's graphs in the caches (compiled_paths.compile_patches) shows in its hits. The report
carries them per module (`compile_times`).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable, Iterator

FIELDS = ("graphs", "backend_s", "backward_s", "aot_cache_hits", "fx_cache_hits")


class CompileLog:
    """The log of one root's one path, kept in root.compile_log[path] (the root held weakly: see
    compiled_paths.entry_point). `backend(fn)` wraps Dynamo's backend, `inner` is compile_fx's per-graph compile."""

    def __init__(self, root: Any, path: str) -> None:
        self.root, self.path, self._in_backend = weakref.ref(root), path, 0

    def entry(self) -> dict[str, float] | None:
        r = self.root()
        return None if r is None else r.compile_log.setdefault(self.path, dict.fromkeys(FIELDS, 0))

    @contextlib.contextmanager
    def _timing(self, seconds: str) -> Iterator[None]:
        from torch._dynamo.utils import counters
        aot, fx = counters["aot_autograd"]["autograd_cache_hit"], counters["inductor"]["fxgraph_cache_hit"]
        start = time.perf_counter()
        try:
            yield
        finally:
            e = self.entry()
            if e is not None:
                e[seconds] = round(e[seconds] + time.perf_counter() - start, 3)
                e["aot_cache_hits"] += counters["aot_autograd"]["autograd_cache_hit"] - aot
                e["fx_cache_hits"] += counters["inductor"]["fxgraph_cache_hit"] - fx

    def backend(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def logged(gm: Any, example_inputs: Any) -> Any:
            e = self.entry()
            if e is not None:
                e["graphs"] += 1
            self._in_backend += 1
            try:
                with self._timing("backend_s"):
                    return fn(gm, example_inputs)
            finally:
                self._in_backend -= 1
        return logged

    def inner(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        """compile_fx_inner, timed as a backward's compile where it runs outside the backend (AOTAutograd's lazy
        backward); inside it, the backend's own timing counts it."""
        from torch._inductor.compile_fx import compile_fx_inner
        if self._in_backend:
            return compile_fx_inner(gm, example_inputs, **kwargs)
        with self._timing("backward_s"):
            return compile_fx_inner(gm, example_inputs, **kwargs)
