"""The training/inference precision pipeline: lists -> cost -> paint -> storage -> casts, one function over an aten
graph."""
from __future__ import annotations

from collections import Counter
from typing import Protocol

import torch.fx as fx

from automp.precision.casts import eliminate_casts, insert_casts, is_cast, remember_output_dtypes
from automp.precision.paint import GraphInfo, Plan, PrecisionConfig, paint
from automp.precision.storage import decide_storage


class Recorder(Protocol):
    """Where the pass reports what it did (automp.runtime.report.Recorder is one): the pass only needs these two
    methods, so precision/ does not import the runtime above it."""

    def add_plan(self, name: str, plan: Plan, casts_by_part: dict[str, dict[str, int]]) -> None: ...

    def add_fallback(self, where: str, why: str) -> None: ...


def _casts_by_part(gm: fx.GraphModule) -> Counter:
    """Casts per part of the graph as it is now (the stages add and remove casts, so GraphInfo is recomputed)."""
    info = GraphInfo.of(gm.graph)
    return Counter(info.part(n) for n in gm.graph.nodes if is_cast(n))


def apply_precision(gm: fx.GraphModule, config: PrecisionConfig, recorder: Recorder | None = None,
                    name: str = "graph") -> fx.GraphModule:
    """Mixed precision as a GraphModule -> GraphModule pass over a forward, joint (forward+backward) or inference
    aten graph whose nodes carry fake values (meta['val']), as AOTAutograd and Inductor provide them."""
    remember_output_dtypes(gm)
    info = GraphInfo.of(gm.graph)
    plan: Plan = paint(gm, config, info)
    decide_storage(gm.graph, plan, config.dtype, info)
    before = _casts_by_part(gm)
    insert_casts(gm, plan, config.dtype, info)
    mid = _casts_by_part(gm)
    eliminate_casts(gm)
    gm.graph.eliminate_dead_code()
    after = _casts_by_part(gm)
    gm.graph.lint()
    gm.recompile()
    if recorder is not None:
        parts = set(before) | set(mid) | set(after) | {d.part for d in plan.decisions.values()}
        recorder.add_plan(name, plan, {p: {"inserted": max(mid[p] - before[p], 0),
                                           "eliminated": max(mid[p] - after[p], 0),
                                           "remaining": after[p]} for p in parts})
    return gm
