"""What the report says about Dynamo's graph breaks while automp was enabled.

At a break the construct runs eagerly and the code before and after it compiles as separate graphs; the user should
know where and why. How it runs depends on the path of the modules that compiled: on automp's compiled path in FP32
(each graph goes through the pass), on the autocast-compiled path under the autocast region around the call, as in a
hand-written loop. The break at an nn.LSTM/GRU is automp's own: it keeps the RNN one fused op (rnn._rnn_call).
"""
from __future__ import annotations

from typing import Any, Iterable

from automp.runtime.decisions import AUTOCAST_PATHS, COMPILED_PATHS, GRAPH_BREAK, RNN_FUSED, Route
from automp.runtime.report import Recorder

_RNN_BREAK = ("_rnn_call", "allow_rnn", "RNN, GRU, or LSTM")


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph-break counts by reason, process-wide (compared before and after a session)."""
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


def report_graph_breaks(rec: Recorder, roots: Iterable[Any], before: dict[str, int]) -> None:
    """Add a fallback entry for each break reason new since `before` (once per reason); `roots` are the session's
    root records (their .path and .graphs say which compiled path ran)."""
    paths = {Route.COMPILED_AUTOCAST if r.path in AUTOCAST_PATHS else r.path for r in roots
             if r.graphs and r.path in COMPILED_PATHS}
    how = ("in FP32" if Route.COMPILED_AUTOCAST not in paths else "under torch.autocast" if len(paths) == 1 else
           "in FP32 (automp-compiled modules) or under torch.autocast (autocast-compiled modules)")
    for reason, n in graph_breaks().items():
        new = n - before.get(reason, 0)
        short = " ".join(line.strip() for line in reason.splitlines()[:2] if line.strip())[:300]
        if new <= 0 or any(fb["reason"].startswith(short) for fb in rec.fallbacks):
            continue
        if any(k in reason for k in _RNN_BREAK):
            rec.add_fallback("rnn", f"{short} (x{new}): by design, the RNN runs as one fused op in low precision",
                             RNN_FUSED)
        else:
            rec.add_fallback("graph break", f"{short} (x{new}): runs eagerly {how} between compiled graphs",
                             GRAPH_BREAK)
