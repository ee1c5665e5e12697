"""`automp bench zoo --interleave`: blocks alternate between the anchor and automp, a linear drift cancels, and the
ratio lands in automp-bf16's row (or an error note, never a lost row)."""
import pytest
import torch

from automp.bench.suites import zoo, zoo_interleave


@pytest.fixture
def no_inductor(monkeypatch):
    """The anchor's torch.compile as identity and automp's graphs without Inductor: the logic, not compile time."""
    monkeypatch.setattr(torch, "compile", lambda module, **kw: module)
    monkeypatch.setenv("AUTOMP_INNER", "eager")


def test_blocks_alternate_and_a_drifting_host_cancels(no_inductor, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path))
    calls = []

    def drifting_timer(step, steps, device):
        """anchor blocks cost 10 ms, automp's 8 ms, and the host slows by 1 ms per block."""
        step()  # the real loop runs (and must keep working under the session)
        side = "anchor" if step.__self__.dtype is not None else "automp"  # the anchor's loop autocasts itself
        calls.append((side, steps))
        return (10.0 if side == "anchor" else 8.0) + len(calls)

    got = zoo_interleave.interleaved("mlp", True, "cpu", steps=3, warmup=1, max_warmup=60, rounds=6,
                                     timer=drifting_timer)
    sides = [s for s, _ in calls]
    assert sides[:2] == ["anchor", "automp"] and [n for _, n in calls[:2]] == [1, 1]  # the untimed first calls
    assert sides[2:] == ["anchor", "automp", "automp", "anchor"] * 3
    assert all(n == 3 for _, n in calls[2:])
    assert len(got["blocks"]["anchor"]) == len(got["blocks"]["automp"]) == 6
    assert got["anchor_ms"] - got["automp_ms"] == pytest.approx(2.0)  # exactly the cost difference: drift gone
    assert got["ratio"] == pytest.approx(got["anchor_ms"] / got["automp_ms"], abs=1e-3)
    assert got["settled"] and set(got["paths"].values()) <= {"fp32-eager", "low-precision-eager", "as-written"}


def _fake_mode(name, mode, quick, device, steps, warmup, max_warmup, timeout=0):
    return {"model": name, "mode": mode, "step_ms": 10.0, "peak_gib": 1.0, "loss": 0.5, "compile_s": 0.0}


def test_the_ratio_lands_in_automp_bf16s_row(monkeypatch):
    monkeypatch.setattr(zoo, "run_mode", _fake_mode)
    anchors = []

    def fake(name, *a, anchor_mode=zoo.ANCHOR, **k):
        anchors.append(anchor_mode)
        return {"anchor_ms": 12.0, "automp_ms": 10.0, "ratio": 1.2, "blocks": {}, "paths": {}, "settled": True}

    monkeypatch.setattr(zoo_interleave, "interleaved", fake)
    modes = ["autocast-bf16-compile", "automp-bf16", "automp-fp16"]
    rows = {r["mode"]: r for r in zoo.run_model("mlp", modes, True, "cpu", 1, 1, 1, interleave=True)}
    assert rows["automp-bf16"]["ratio_interleaved"] == 1.2
    assert rows["automp-bf16"]["step_ms_interleaved"] == 10.0 and rows["automp-bf16"]["anchor_ms_interleaved"] == 12.0
    assert "ratio_interleaved" not in rows["automp-fp16"] and "ratio_interleaved" not in rows["autocast-bf16-compile"]
    # a small script is held to the eager loop (the bar for them), a large model to autocast + compile
    assert anchors == ["autocast-bf16-eager"] and rows["automp-bf16"]["anchor_interleaved"] == "autocast-bf16-eager"
    assert "interleaved with autocast-bf16-eager: 1.20x" in zoo.markdown(list(rows.values()))
    zoo.run_model("gpt2", ["automp-bf16"], True, "cpu", 1, 1, 1, interleave=True)
    assert anchors[-1] == zoo.ANCHOR or zoo.missing_libraries("gpt2")
    plain = {r["mode"]: r for r in zoo.run_model("mlp", modes, True, "cpu", 1, 1, 1)}
    assert "ratio_interleaved" not in plain["automp-bf16"]  # only when asked for


def test_a_failing_interleaved_run_keeps_the_rows(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("out of memory with both models resident")

    monkeypatch.setattr(zoo, "run_mode", _fake_mode)
    monkeypatch.setattr(zoo_interleave, "interleaved", broken)
    rows = {r["mode"]: r for r in zoo.run_model("mlp", ["autocast-bf16-compile", "automp-bf16"], True, "cpu", 1, 1,
                                                 1, interleave=True)}
    assert rows["automp-bf16"]["step_ms"] == 10.0 and rows["automp-bf16"]["ratio_vs_anchor"] == 1.0
    assert "out of memory" in rows["automp-bf16"]["interleave_error"]


def test_an_anchor_automp_would_take_over_is_refused():
    # inside the session, an FP32 anchor's modules would run automp's paths: the ratio would compare automp to itself
    with pytest.raises(ValueError, match="autocast-bf16 anchor"):
        zoo_interleave.interleaved("mlp", True, "cpu", 1, 1, 1, anchor_mode="fp32-eager")


def test_the_anchors_blocks_run_with_the_scripts_cudnn_flag(no_inductor, tmp_path, monkeypatch):
    """cudnn.benchmark is process-wide: automp's choice of it (automp.runtime.tuning.conv_tuning) must not reach the
    anchor's blocks, and automp's blocks keep it."""
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    seen = []

    def timer(step, steps, device):
        step()
        if not seen:  # automp has chosen the flag by the time blocks are timed
            torch.backends.cudnn.benchmark = True
        seen.append(("anchor" if step.__self__.dtype is not None else "automp", torch.backends.cudnn.benchmark))
        return 1.0

    zoo_interleave.interleaved("mlp", True, "cpu", steps=1, warmup=1, max_warmup=20, rounds=2, timer=timer)
    timed = seen[2:]
    assert {flag for side, flag in timed if side == "anchor"} == {False}
    assert {flag for side, flag in timed if side == "automp"} == {True}


def test_the_row_carries_the_spread_of_the_blocks(monkeypatch):
    """A ratio is reported with its spread: each round's anchor block over the automp block beside it."""
    monkeypatch.setattr(zoo_interleave, "interleaved", lambda *a, **k: {
        "anchor_ms": 11.0, "automp_ms": 10.0, "ratio": 1.1, "paths": {}, "settled": True,
        "blocks": {"anchor": [10.0, 12.0, 11.0], "automp": [10.0, 10.0, 10.0]}})
    row = {"model": "mlp", "mode": "automp-bf16", "step_ms": 10.0, "peak_gib": None, "loss": 0.5}
    zoo_interleave.add_to_row(row, "mlp", True, "cpu", 1, 1, 1, 0)
    assert row["ratio_interleaved_spread"] == [1.0, 1.2]
    assert "(blocks 1.00-1.20x)" in zoo.markdown([row])
