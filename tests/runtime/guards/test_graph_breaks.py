"""The report's graph-break entries: new reasons only, once each, worded by the path that compiled."""
from types import SimpleNamespace

import pytest

import automp.runtime.guards.graph_breaks as gb
from automp.runtime.decisions import Route
from automp.runtime.report import Recorder


@pytest.mark.parametrize("paths, how", [((Route.COMPILED,), "in FP32"),
                                        ((Route.COMPILED_AUTOCAST,), "under torch.autocast"),
                                        ((Route.COMPILED, Route.COMPILED_AUTOCAST), "in FP32 (automp-compiled")])
def test_new_breaks_are_reported_once_with_the_paths_wording(monkeypatch, paths, how):
    monkeypatch.setattr(gb, "graph_breaks", lambda: {"copy.deepcopy\nmore": 5, "old reason": 2,
                                                     "Attempted to wrap RNN, GRU, or LSTM": 1})
    roots = [SimpleNamespace(path=p, graphs=1) for p in paths] + [SimpleNamespace(path=Route.FP32, graphs=0)]
    rec = Recorder()
    gb.report_graph_breaks(rec, roots, {"copy.deepcopy\nmore": 2, "old reason": 2})
    gb.report_graph_breaks(rec, roots, {"copy.deepcopy\nmore": 2, "old reason": 2})  # again: no duplicate entries
    by_where = {fb["where"]: fb["reason"] for fb in rec.fallbacks}
    assert len(rec.fallbacks) == 2 and set(by_where) == {"graph break", "rnn"}
    assert by_where["graph break"].startswith("copy.deepcopy more (x3): runs eagerly " + how)
    assert "by design" in by_where["rnn"]
