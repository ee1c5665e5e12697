"""Trace a model's joint (or inference) aten graph through the automp backend and keep what the pass produced."""
from __future__ import annotations

import torch
import torch.fx as fx

from automp.precision import capture
from automp.precision import cost
from automp.precision.paint import PrecisionConfig
from automp.runtime.report import Recorder


def traced(model, *inputs, dtype=torch.bfloat16, spec=cost.SPECS["h100"], backward=True):
    """Run model(*inputs) (and .backward of a scalar of it) through the eager automp backend.

    Returns (outputs, recorder, graphs) where graphs are the GraphModules after the precision pass."""
    graphs: list[fx.GraphModule] = []
    orig = capture.apply_precision

    def keep(gm, *a, **k):
        out = orig(gm, *a, **k)
        graphs.append(gm)
        return out

    capture.apply_precision = keep
    try:
        torch._dynamo.reset()
        rec = Recorder()
        compiled = torch.compile(model, backend=capture.make_backend(PrecisionConfig(dtype=dtype, spec=spec), rec,
                                                                     inner="eager"))
        out = compiled(*inputs)
        if backward:
            (out if out.dim() == 0 else out.float().square().mean()).backward()
    finally:
        capture.apply_precision = orig
    return out, rec, graphs


def nodes_by_op(rec: Recorder, op: str, kind: str | None = None) -> list[dict]:
    return [n for g in rec.graphs if kind in (None, g["kind"]) for n in g["nodes"] if n["op"] == op]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
