"""`automp bench integrations`: GPT-2 trained by the plain loop under `automp run`, by transformers' Trainer with
AutoMPCallback and by Lightning with the AutoMP plugin, and by the same Trainer and Lightning scripts under `automp
run`, each in processes of its own taking turns in alternating order; rows per process, a summary against the
loop's median and each integration's against its own script's, and a failing process kept as a row that says why."""
import importlib.util
import json
import math
import sys

import pytest

from automp.bench.suites import integrations as suite

HAVE_FRAMEWORKS = all(importlib.util.find_spec(m) is not None for m in ("transformers", "lightning", "accelerate"))


def test_processes_take_turns_in_alternating_order():
    assert suite.order(["loop", "trainer", "lightning"], 3) == [
        (0, "loop"), (0, "trainer"), (0, "lightning"), (1, "lightning"), (1, "trainer"), (1, "loop"),
        (2, "loop"), (2, "trainer"), (2, "lightning")]


def test_the_summary_is_each_modes_median_against_the_loops():
    rows = [{"mode": "loop", "step_ms": 10.0, "first_run_s": 5.0}, {"mode": "loop", "step_ms": 12.0, "first_run_s": 7.0},
            {"mode": "loop", "step_ms": 11.0, "first_run_s": 6.0}, {"mode": "trainer", "step_ms": 22.0},
            {"mode": "trainer", "error": "exit status 1"}, {"mode": "trainer-run", "step_ms": 20.0},
            {"mode": "lightning", "step_ms": 30.0}]
    by = {s["mode"]: s for s in suite.summary(rows)}
    assert by["loop"]["step_ms"] == 11.0 and by["loop"]["spread"] == [10.0, 12.0] and by["loop"]["vs_loop"] == 1.0
    assert by["loop"]["first_run_s"] == 6.0 and by["loop"]["runs"] == 3
    assert by["trainer"]["vs_loop"] == 0.5 and by["trainer"]["runs"] == 1  # the failed process is not a figure
    assert by["trainer"]["vs_run"] == round(20 / 22, 3) and by["trainer-run"]["vs_run"] is None
    assert by["lightning"]["vs_run"] is None  # its script under `automp run` has no figure


def test_bad_arguments_are_one_line(tmp_path, capsys):
    assert suite.main(["--modes", "loop,keras", "--out", str(tmp_path / "x")]) == 2
    assert "--modes" in capsys.readouterr().err
    assert suite.main(["--repeats", "0", "--out", str(tmp_path / "x")]) == 2


def test_each_finished_process_is_written_before_the_next_starts(tmp_path, monkeypatch):
    """A run cut off by a time limit keeps the processes that finished."""
    done = []

    def run_one(mode, repeat, opts):
        if done:
            raise KeyboardInterrupt  # the limit, during the second process
        done.append(mode)
        return {"mode": mode, "repeat": repeat, "step_ms": 20.0, "first_run_s": 50.0, "loss": 3.0}
    monkeypatch.setattr(suite, "run_one", run_one)
    with pytest.raises(KeyboardInterrupt):
        suite.main(["--modes", "trainer,trainer-run", "--repeats", "1", "--out", str(tmp_path / "cut")])
    rows = json.loads((tmp_path / "cut.json").read_text())
    assert [r["mode"] for r in rows] == ["trainer"] and rows[0]["commit"]
    assert "| trainer | 1 |" in (tmp_path / "cut.md").read_text()


@pytest.mark.skipif(not HAVE_FRAMEWORKS, reason="transformers, lightning and accelerate (the test extra)")
def test_a_quick_run_times_every_mode_and_keeps_a_failing_process_as_a_row(tmp_path, monkeypatch):
    real = suite.command

    def command(mode, opts, workdir, out):  # the second Lightning process fails: its row says why, the rest run
        if mode == "lightning" and seen.count("lightning") == 1:
            return [sys.executable, "-c", "import sys; sys.exit('no GPU left')"]
        return real(mode, opts, workdir, out)
    seen = []
    monkeypatch.setattr(suite, "command", lambda mode, *a: seen.append(mode) or command(mode, *a))
    monkeypatch.setattr(suite, "gpu_slug", lambda name: "cpu")  # a GPU host runs this on its CPU too: no matter
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # its processes as well (on a GPU: compiles past the time limit)
    out = tmp_path / "integ"
    assert suite.main(["--quick", "--repeats", "2", "--steps", "6", "--first", "2", "--out", str(out)]) == 0
    rows = json.loads((tmp_path / "integ.json").read_text())
    assert [(r["repeat"], r["mode"]) for r in rows] == suite.order(list(suite.worker.MODES), 2)
    failed = [r for r in rows if r.get("error")]
    assert len(failed) == 1 and failed[0]["mode"] == "lightning" and "no GPU left" in failed[0]["error"]
    for r in rows:
        assert r["commit"] and r["date"] and r["device"]
        if not r.get("error"):
            assert r["steps"] == 6 and r["step_ms"] > 0 and math.isfinite(r["loss"]) and r["first_run_s"] > 0
            assert r["paths"] and set(r["paths"]) == {"GPT2LMHeadModel"}  # automp's report, read back per mode
            with open(tmp_path / r["report"], encoding="utf-8") as f:  # and kept beside the results
                assert [c["path"] for c in json.load(f)["choices"]] == list(r["paths"].values())
    md = (tmp_path / "integ.md").read_text()
    assert "| loop | 2 |" in md and "| trainer | 2 |" in md and "| lightning | 1 |" in md and "no GPU left" in md
    assert "| trainer-run | 2 |" in md and "| lightning-run | 2 |" in md and "| loop-late | 2 |" in md
    losses = {m: [r["loss"] for r in rows if r["mode"] == m and not r.get("error")] for m in suite.TWIN.values()}
    for mode, twin in suite.TWIN.items():  # the integration trains as its script does under `automp run`
        for a, b in zip([r["loss"] for r in rows if r["mode"] == mode and not r.get("error")], losses[twin]):
            assert abs(a - b) <= 1e-3 * abs(b), (mode, a, b)


@pytest.mark.parametrize("warm", [False, True])
def test_processes_share_one_inductor_cache_only_when_asked(tmp_path, monkeypatch, warm):
    """--warm-inductor: every process reads and fills the run's one Inductor cache; by default each has its own."""
    def command(mode, opts, workdir, out):
        row = ("{'step_ms': 1.0, 'first_run_s': 1.0, 'loss': 1.0, 'steps': 3, "
               "'dir': os.environ['TORCHINDUCTOR_CACHE_DIR']}")
        return [sys.executable, "-c", f"import json, os; json.dump({row}, open({out!r}, 'w'))"]
    monkeypatch.setattr(suite, "command", command)
    args = ["--modes", "loop,trainer", "--repeats", "2", "--out", str(tmp_path / "w")] + (["--warm-inductor"] * warm)
    assert suite.main(args) == 0
    rows = json.loads((tmp_path / "w.json").read_text())
    assert len(rows) == 4 and all(r["inductor_cache"] == ("shared" if warm else "cold") for r in rows)
    assert len({r["dir"] for r in rows}) == (1 if warm else 4)
