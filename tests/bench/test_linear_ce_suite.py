"""`automp bench linear_ce --quick`: every mode timed in one run, its rows carrying ratio, spread and provenance, the
same loss in every mode; bad arguments exit 2 before anything runs."""
import json

from automp.bench.suites import linear_ce


def test_quick_run_writes_every_mode_with_the_same_loss(tmp_path):
    assert linear_ce.main(["--quick", "--out", str(tmp_path / "lce")]) == 0
    rows = json.loads((tmp_path / "lce.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == list(linear_ce.MODES)
    for r in rows:
        assert {"ms", "spread_ms", "ratio_vs_stock", "peak_gib", "commit", "device", "date"} <= r.keys()
        assert r["spread_ms"][0] <= r["ms"] <= r["spread_ms"][1] and r["ratio_vs_stock"] > 0
        assert abs(r["loss"] - rows[0]["loss"]) / rows[0]["loss"] < 1e-2  # bf16 GEMMs, FP32 softmax on every side
    assert "| blocks-no-logits |" in (tmp_path / "lce.md").read_text()


def test_bad_arguments_exit_2_before_running(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(linear_ce, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert linear_ce.main(["--quick", "--rounds", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
