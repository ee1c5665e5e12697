"""`automp bench fp8_parity`: a stream that can be learned but not memorized, windowed losses at checkpoints, rows of
separate processes merged into one file with their gaps to the bf16 anchor, and usage errors before anything runs."""
import importlib.util
import json
import math

import pytest
import torch

from automp.bench.suites import fp8_parity as par
from tests import gloo

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def test_stream_is_the_same_for_every_reader_and_each_token_has_k_successors():
    a = par.TokenStream(1000, 3, 64, "cpu", steps=10)
    b = par.TokenStream(1000, 3, 64, "cpu", steps=10)
    assert len(a) == 10
    assert torch.equal(a[4]["input_ids"], b[4]["input_ids"])  # another process sees the same batch
    assert not torch.equal(a[4]["input_ids"], a[5]["input_ids"])  # a fresh batch every step
    ids = a[7]["input_ids"]
    assert ids.min() >= 0 and ids.max() < 1000 and torch.equal(ids, a[7]["labels"])
    step = (ids[:, 1:] - ids[:, :-1] - par.STRIDE) % 1000  # what was drawn after each token
    assert step.min() >= 0 and step.max() < par.K
    assert len(torch.unique(step)) == par.K  # every successor occurs: the floor is ln(K), not lower


def test_an_active_vocabulary_keeps_the_stream_to_its_first_ids():
    stream = par.TokenStream(1000, 2, 300, "cpu", steps=4, active=64)
    ids = stream[1]["input_ids"]
    assert ids.max() < 64 and len(torch.unique(ids)) > 32  # the active ids, and many of them
    step = (ids[:, 1:] - ids[:, :-1] - par.STRIDE) % 64
    assert step.max() < par.K
    assert par.TokenStream(1000, 2, 8, "cpu", steps=1, active=5000).vocab == 1000  # never past the model's


def test_successors_sets_how_many_ids_can_follow_each_and_rows_of_another_k_are_not_compared():
    ids = par.TokenStream(1000, 2, 400, "cpu", steps=2, successors=2)[0]["input_ids"]
    assert len(torch.unique((ids[:, 1:] - ids[:, :-1] - par.STRIDE) % 1000)) == 2
    rows = [{"model": "m", "mode": par.ANCHOR, "loss_at": {"500": 5.0}, "active_vocab": 64, "successors": 4},
            {"model": "m", "mode": "automp-fp8", "loss_at": {"500": 5.5}, "active_vocab": 64, "successors": 4},
            {"model": "m", "mode": "automp-fp8", "loss_at": {"500": 4.0}, "active_vocab": 64}]  # drew 16
    par.gaps(rows)
    assert rows[1]["gap_vs_bf16"] == {"500": pytest.approx(0.1)} and rows[2]["gap_vs_bf16"] == {}


def test_gaps_are_relative_to_the_anchor_at_shared_checkpoints():
    rows = [{"model": "m", "mode": "automp-fp8", "loss_at": {"500": 5.05, "2000": 3.0}, "active_vocab": 64},
            {"model": "m", "mode": par.ANCHOR, "loss_at": {"500": 5.0}, "active_vocab": 64},
            {"model": "m", "mode": "automp-fp8", "loss_at": {"500": 9.0}, "active_vocab": 0}]  # another stream
    par.gaps(rows)
    assert rows[0]["gap_vs_bf16"] == {"500": pytest.approx(0.01)}
    assert rows[1]["gap_vs_bf16"] == {"500": 0.0}
    assert rows[2]["gap_vs_bf16"] == {}  # no anchor on its stream


def test_rows_at_another_learning_rate_are_not_compared():
    """Two runs at different learning rates are different experiments: no gap across them; a row without `lr` ran at
    the default."""
    rows = [{"model": "m", "mode": par.ANCHOR, "loss_at": {"500": 5.0}, "active_vocab": 64},
            {"model": "m", "mode": "automp-fp8", "loss_at": {"500": 5.5}, "active_vocab": 64, "lr": par.LR},
            {"model": "m", "mode": "automp-fp8", "loss_at": {"500": 4.0}, "active_vocab": 64, "lr": 3e-4}]
    par.gaps(rows)
    assert rows[1]["gap_vs_bf16"] == {"500": pytest.approx(0.1)} and rows[2]["gap_vs_bf16"] == {}


def test_usage_errors_name_the_problem(tmp_path, capsys):
    assert par.main(["--models", "vit-l16", "--out", str(tmp_path / "x")]) == 2
    assert "--models" in capsys.readouterr().err
    assert par.main(["--steps", "10", "--at", "5,20", "--out", str(tmp_path / "x")]) == 2
    assert "--at 20 is past --steps 10" in capsys.readouterr().err
    assert par.main(["--at", "five", "--out", str(tmp_path / "x")]) == 2
    assert par.main(["--lr", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--lr must be at least" in capsys.readouterr().err
    assert par.main(["--successors", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--successors" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_two_runs_build_one_file_with_gaps(tmp_path, monkeypatch):
    gloo.cpu_host(monkeypatch)  # the suite picks CUDA where it exists: an FP8 GPU would run the mode asserted to fail
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "parity"
    common = ["--quick", "--models", "gpt2", "--steps", "6", "--at", "3,6", "--window", "3", "--active-vocab", "64",
              "--lr", "3e-4", "--out", str(out)]
    seen_lr = []

    def spy(build):
        return lambda work, device: seen_lr.append(work.lr) or build(work, device)
    monkeypatch.setattr(par, "LOOPS", {mode: spy(build) for mode, build in par.LOOPS.items()})
    assert par.main([*common, "--modes", "automp-bf16"]) == 0
    monkeypatch.setattr(par, "ANCHOR", "automp-bf16")  # the anchor's compile is too slow for a CPU test
    assert par.main([*common, "--modes", "automp-fp8"]) == 0  # no FP8 on a CPU: enable raises, the row says so
    rows = {r["mode"]: r for r in json.loads(out.with_suffix(".json").read_text())}
    assert set(rows) == {"automp-bf16", "automp-fp8"}
    bf16 = rows["automp-bf16"]
    assert set(bf16["loss_at"]) == {"3", "6"} and all(math.isfinite(v) and v > 0 for v in bf16["loss_at"].values())
    assert bf16["gap_vs_bf16"] == {"3": 0.0, "6": 0.0} and len(bf16["curve"]) == 2
    assert bf16["lr"] == 3e-4 and seen_lr == [3e-4]  # --lr reached the workload the loop builds its AdamW from
    assert "error" in rows["automp-fp8"] and rows["automp-fp8"]["loss_at"] == {}
    assert "automp-fp8" in out.with_suffix(".md").read_text()


def test_between_seeds_gives_each_modes_spread_and_its_difference_beside_the_anchors():
    rows = [{"model": "m", "mode": par.ANCHOR, "seed": s, "loss_at": {"500": v}} for s, v in ((0, 5.0), (1, 5.2))]
    rows += [{"model": "m", "mode": "automp-bf16", "seed": s, "loss_at": {"500": v}} for s, v in ((0, 5.3), (1, 5.5))]
    rows += [{"model": "m", "mode": "automp-fp8", "seed": 0, "loss_at": {"500": 9.0}}]  # one seed: no spread
    table = {t["mode"]: t for t in par.between_seeds(rows)}
    assert set(table) == {par.ANCHOR, "automp-bf16"}
    ours = table["automp-bf16"]
    assert ours["seeds"] == 2 and ours["mean"] == pytest.approx(5.4) and ours["spread"] == pytest.approx(0.2)
    assert ours["diff_vs_anchor"] == pytest.approx(0.3) and ours["anchor_spread"] == pytest.approx(0.2)
    par.gaps(rows)  # gaps pair each seed with the anchor's run of the same seed
    assert rows[2]["gap_vs_bf16"] == {"500": pytest.approx(0.06)} and rows[3]["gap_vs_bf16"] == {
        "500": pytest.approx(0.3 / 5.2, abs=1e-5)}  # gaps are rounded to 5 places
    full = [dict(r, window=50, steps=500, seconds=1.0) for r in rows]  # what a run's rows also hold
    assert "## Between seeds" in par.markdown(full, "cpu")


def test_a_bad_seed_list_is_a_usage_error(tmp_path, capsys):
    assert par.main(["--seeds", "one", "--out", str(tmp_path / "x")]) == 2
    assert "--seeds must be at least 0" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_each_seed_is_a_run_of_its_own_weights_and_stream(tmp_path, monkeypatch):
    gloo.cpu_host(monkeypatch)
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "parity"
    assert par.main(["--quick", "--models", "gpt2", "--steps", "4", "--at", "4", "--window", "2", "--active-vocab",
                     "64", "--modes", "automp-bf16", "--seeds", "0,1", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert sorted(r["seed"] for r in rows) == [0, 1]
    a, b = (r["loss_at"]["4"] for r in sorted(rows, key=lambda r: r["seed"]))
    assert a != b  # other initial weights and other batches
    assert "## Between seeds" in out.with_suffix(".md").read_text()
