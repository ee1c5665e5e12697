"""Run the graph passes in order and record what each one did.

Order matters: constants are folded first so the later pattern passes see initializers instead of Constant/Shape
chains; BN folding runs before fusion so the Conv it leaves behind can take a bias and activation; reordering
exposes no new folds, and a final constant fold + dce sweep up whatever the rewrites orphaned.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import onnx

from automp.deploy.passes.dce import dce
from automp.deploy.passes.fold_bn import fold_bn
from automp.deploy.passes.fold_constants import fold_constants
from automp.deploy.passes.fuse import FuseConfig, fuse
from automp.deploy.passes.graph import op_counts
from automp.deploy.passes.reorder import reorder

Pass = Callable[[onnx.ModelProto], onnx.ModelProto]


@dataclass
class PassRecord:
    name: str
    nodes_before: int
    nodes_after: int
    ms: float
    ops_removed: dict[str, int] = field(default_factory=dict)
    ops_added: dict[str, int] = field(default_factory=dict)


def default_passes(fuse_config: FuseConfig | None = None) -> list[tuple[str, Pass]]:
    cfg = fuse_config or FuseConfig()
    return [("fold_constants", fold_constants), ("dce", dce), ("fold_bn", fold_bn),
            ("fuse", lambda m: fuse(m, cfg)), ("reorder", reorder), ("fold_constants", fold_constants),
            ("dce", dce)]


def run_pipeline(model: onnx.ModelProto, passes: list[tuple[str, Pass]] | None = None
                 ) -> tuple[onnx.ModelProto, list[PassRecord]]:
    records = []
    for name, fn in passes if passes is not None else default_passes():
        before = op_counts(model)
        t0 = time.perf_counter()
        model = fn(model)
        ms = (time.perf_counter() - t0) * 1e3
        after = op_counts(model)
        records.append(PassRecord(
            name, sum(before.values()), sum(after.values()), ms,
            ops_removed={k: before[k] - after.get(k, 0) for k in before if before[k] > after.get(k, 0)},
            ops_added={k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}))
    return model, records
