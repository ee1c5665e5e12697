"""`automp bench fp8`: rows with every key, skipped rows instead of lost ones, the block schedule, and losses read
after the same number of optimizer steps in every mode."""
import importlib.util
import json
import os

import pytest
import torch

import automp
from automp.bench import fp8_workloads as wl
from automp.bench.suites import fp8
from tests import gloo

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# --max-warmup: above the longest a CPU trial of the two eager paths can take to settle (46 iterations with its
# steady-state re-measurement: tests/bench/test_dist_suite.py), so that `settled` does not depend on the host's noise
QUICK = ["--quick", "--steps", "1", "--warmup", "1", "--first-steps", "1", "--max-warmup", "60", "--mode-timeout", "0"]


def _rows(prefix):
    with open(f"{prefix}.json") as f:
        return {(r["model"], r["mode"]): r for r in json.load(f)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AUTOMP_INNER", "eager")  # automp's compiled path without Inductor: the suite, not compile time


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_quick_run_writes_every_key_and_skips_fp8_where_it_cannot_run(tmp_path, cache, monkeypatch):
    gloo.cpu_host(monkeypatch)  # the CPU run, also on a GPU host: the suite picks CUDA where it exists (and FP8 runs)
    out = tmp_path / "fp8-cpu"
    assert fp8.main(["--models", "gpt2,llama-d2048", "--modes", "automp-bf16,automp-fp8", "--out", str(out),
                     *QUICK]) == 0
    rows = _rows(out)
    assert set(rows) == {(m, mode) for m in ("gpt2", "llama-d2048") for mode in ("automp-bf16", "automp-fp8")}
    for model in ("gpt2", "llama-d2048"):
        row = rows[(model, "automp-bf16")]
        assert set(fp8.ROW_KEYS) <= set(row) and "skipped" not in row
        assert row["step_ms"] > 0 and row["spread"][0] <= row["step_ms"] <= row["spread"][1]
        assert row["loss"] is not None and row["first_run_s"] > 0 and row["blocks"] == "alternating"
        assert row["peak_gib"] is None and row["ratio_vs_bf16"] is None  # CPU; no anchor in this run
        assert isinstance(row["automp_paths"], dict) and row["automp_paths"]
        assert row["settled"], row["warmup_paths"]
        ran = row["warmup_paths"]  # each warm-up step's path(s), from the session's own call counts
        assert ran and all(ran) and set(row["automp_paths"].values()) <= set(ran[-1].split("+"))
        assert row["warmup_peaks_gib"] is None  # a CPU has no allocator peaks
        assert rows[(model, "automp-fp8")]["skipped"]  # no FP8 here: enable raises, the row says why
    md = (tmp_path / "fp8-cpu.md").read_text()
    assert "## gpt2" in md and "## llama-d2048" in md and "| automp-bf16 |" in md and "skipped:" in md
    assert (tmp_path / "fp8-cpu.png").read_bytes()[:4] == b"\x89PNG"
    assert not automp.is_enabled()


def test_bad_names_are_a_usage_error(tmp_path, capsys):
    for args in (["--models", "gpt3"], ["--modes", "automp-int4"], ["--steps", "0"], ["--mode-timeout", "-1"],
                 ["--models", "gpt2,"]):
        assert fp8.main([*args, "--out", str(tmp_path / "x"), "--quick"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("automp bench fp8: ") and "\n" not in err and "CUDA GPU" not in err, err
    assert not list(tmp_path.iterdir())  # nothing written
    (tmp_path / "r.json").mkdir()
    assert fp8.main(["--out", str(tmp_path / "r"), "--quick"]) == 2
    assert capsys.readouterr().err.strip() == f"automp bench fp8: --out {tmp_path / 'r.json'} is a directory"


def _counting_loop(calls):
    """A fake loop whose loss is the number of optimizer steps taken so far."""
    def build(work, device):
        n = [0]

        def step():
            n[0] += 1
            calls.append(n[0])
            return torch.tensor(float(n[0]))
        return step
    return build


def _tiny(quick, device, layers):
    return wl.Workload(torch.nn.Linear(4, 4).to(device), None, None)


@pytest.fixture
def fake_models(monkeypatch):
    monkeypatch.setitem(wl.MODELS, "gpt2", (_tiny, "torch"))
    monkeypatch.setitem(wl.MODELS, "llama-d2048", (_tiny, "torch"))
    monkeypatch.setattr(fp8, "missing", lambda lib: False)  # the fake loops need no torchao


def test_a_failing_mode_is_a_skipped_row_and_the_rest_run(tmp_path, cache, fake_models, monkeypatch):
    def broken(work, device):
        raise RuntimeError("compile failed\nsecond line")

    monkeypatch.setitem(wl.LOOPS, "bf16-reduce-overhead", broken)
    monkeypatch.setitem(wl.LOOPS, "torchao-tensorwise", _counting_loop([]))
    out = tmp_path / "r"
    assert fp8.main(["--models", "gpt2,llama-d2048", "--modes", "bf16-reduce-overhead,torchao-tensorwise",
                     "--out", str(out), *QUICK]) == 0
    rows = _rows(out)
    for model in ("gpt2", "llama-d2048"):
        assert rows[(model, "bf16-reduce-overhead")]["skipped"] == "RuntimeError: compile failed second line"
        assert rows[(model, "bf16-reduce-overhead")]["step_ms"] is None
        assert rows[(model, "torchao-tensorwise")]["step_ms"] > 0 and "skipped" not in rows[(model,
                                                                                            "torchao-tensorwise")]


def test_every_mode_reads_its_loss_after_the_same_number_of_steps(tmp_path, cache, fake_models, monkeypatch):
    """automp warms up until settled (longer than the others); the loss still compares step for step."""
    for mode in ("bf16-reduce-overhead", "torchao-rowwise", "automp-bf16"):
        monkeypatch.setitem(wl.LOOPS, mode, _counting_loop([]))
    for blocks, limit in (("alternating", fp8.RESIDENT_MAX_PARAMS), ("sequential", 0)):
        settles = iter([False] * 7 + [True] * 1000)
        monkeypatch.setattr(automp, "settled", lambda: next(settles))
        monkeypatch.setattr(fp8, "RESIDENT_MAX_PARAMS", limit)
        out = tmp_path / blocks
        assert fp8.main(["--models", "gpt2", "--modes", "bf16-reduce-overhead,torchao-rowwise,automp-bf16",
                         "--out", str(out), "--steps", "2", "--warmup", "3", "--first-steps", "2",
                         "--mode-timeout", "0", "--quick"]) == 0
        rows = _rows(out)
        common = 3 + fp8.ROUNDS * 2
        assert {r["loss"] for r in rows.values()} == {float(common)}
        assert {r["blocks"] for r in rows.values()} == {blocks}
        assert all(r["ratio_vs_bf16"] is not None for r in rows.values())
        assert rows[("gpt2", "bf16-reduce-overhead")]["ratio_vs_bf16"] == 1.0


def test_repeats_pass_over_the_modes_again_in_reverse_and_report_their_median(tmp_path, cache, fake_models,
                                                                               monkeypatch):
    """--repeats N: N passes, every other one in reverse order, each row tagged with its pass and its ratio taken to
    the anchor of the same pass; the markdown adds the median and spread over the passes."""
    built = []

    def loop(mode):
        def build(work, device):
            built.append(mode)
            return _counting_loop([])(work, device)
        return build
    for mode in ("bf16-reduce-overhead", "torchao-rowwise"):
        monkeypatch.setitem(wl.LOOPS, mode, loop(mode))
    monkeypatch.setattr(fp8, "RESIDENT_MAX_PARAMS", 0)  # sequential: the build order is the modes' order
    out = tmp_path / "rep"
    assert fp8.main(["--models", "gpt2", "--modes", "bf16-reduce-overhead,torchao-rowwise", "--repeats", "3",
                     "--out", str(out), "--steps", "2", "--warmup", "1", "--first-steps", "1", "--quick"]) == 0
    assert built == ["bf16-reduce-overhead", "torchao-rowwise", "torchao-rowwise", "bf16-reduce-overhead",
                     "bf16-reduce-overhead", "torchao-rowwise"]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert sorted((r["repeat"], r["mode"]) for r in rows) == sorted(
        (i, m) for i in range(3) for m in ("bf16-reduce-overhead", "torchao-rowwise"))
    for r in rows:
        anchor = next(a for a in rows if a["mode"] == fp8.ANCHOR and a["repeat"] == r["repeat"])
        assert r["ratio_vs_bf16"] == pytest.approx(anchor["step_ms"] / r["step_ms"], abs=1e-3)
    (summary,) = [s for s in fp8.across_repeats(rows) if s["mode"] == "torchao-rowwise"]
    steps = sorted(r["step_ms"] for r in rows if r["mode"] == "torchao-rowwise")
    assert summary["repeats"] == 3 and summary["step_ms"] == pytest.approx(steps[1], abs=1e-3)
    assert summary["spread"] == [steps[0], steps[2]]
    md = out.with_suffix(".md").read_text()
    assert "## across repeats" in md and "| gpt2 | torchao-rowwise | 3 |" in md and "(repeat 2)" in md


def test_a_mode_past_its_timeout_is_skipped(tmp_path, cache, fake_models, monkeypatch):
    def slow(work, device):
        def step():
            import time
            time.sleep(0.05)
            return torch.tensor(1.0)
        return step

    monkeypatch.setitem(wl.LOOPS, "bf16-reduce-overhead", slow)
    out = tmp_path / "t"
    assert fp8.main(["--models", "gpt2", "--modes", "bf16-reduce-overhead", "--out", str(out), "--steps", "20",
                     "--warmup", "1", "--first-steps", "1", "--mode-timeout", "0.3", "--quick"]) == 0
    assert _rows(out)[("gpt2", "bf16-reduce-overhead")]["skipped"].startswith("timeout")


def test_rounds_are_even():
    assert fp8.ROUNDS % 2 == 0  # every mode leads as often as it trails (harness.block_order)


def test_torchao_filter_keeps_the_head_and_odd_dims_in_bf16():
    lin = torch.nn.Linear(64, 32)
    assert wl.torchao_filter(lin, "model.layers.0.mlp.up_proj")
    assert not wl.torchao_filter(lin, "lm_head") and not wl.torchao_filter(lin, "head")
    assert not wl.torchao_filter(torch.nn.Linear(64, 10), "blocks.0.fc")


def test_a_cpu_run_without_quick_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """GPT-2 and the Llamas at full size take minutes per step on a CPU: the suite says so and trains nothing."""
    gloo.cpu_host(monkeypatch)
    monkeypatch.setattr(fp8, "run_model", lambda *a, **k: pytest.fail("trained on a CPU"))
    out = tmp_path / "new" / "fp8"
    assert fp8.main(["--models", "gpt2", "--modes", "bf16-reduce-overhead", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "automp bench fp8: needs a CUDA GPU (these models take minutes per step on a CPU); add --quick for a "
        "CPU-sized smoke run\n")
    assert not list(tmp_path.iterdir())  # nothing written, no folder made


def test_a_missing_library_skips_its_rows_only(tmp_path, cache, fake_models, monkeypatch):
    monkeypatch.setitem(wl.LOOPS, "bf16-reduce-overhead", _counting_loop([]))
    monkeypatch.setattr(fp8, "missing", lambda lib: lib == "torchao")
    out = tmp_path / "m"
    assert fp8.main(["--models", "gpt2", "--modes", "bf16-reduce-overhead,torchao-tensorwise,torchao-rowwise",
                     "--out", str(out), *QUICK]) == 0
    rows = _rows(out)
    assert rows[("gpt2", "torchao-tensorwise")]["skipped"] == rows[("gpt2", "torchao-rowwise")]["skipped"] \
        == "pip install torchao"
    assert set(fp8.ROW_KEYS) <= set(rows[("gpt2", "torchao-rowwise")])
    assert rows[("gpt2", "bf16-reduce-overhead")]["step_ms"] > 0


def test_automp_modes_run_their_trial_cold_with_the_machines_measurements(tmp_path, fake_models, monkeypatch):
    """first_run_s counts automp's trial: a cached verdict would skip it; the device calibration is kept."""
    env = tmp_path / "env-cache"
    env.mkdir()
    (env / "verdicts.json").write_text("{}")
    (env / "calibration-dev.json").write_text("{\"x\": 1}")
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(env))
    monkeypatch.setitem(wl.LOOPS, "automp-bf16", _counting_loop([]))
    seen = []
    real_enable = automp.enable

    def enable(**kw):
        seen.append(sorted(p.name for p in (tmp_path / kw["cache_dir"]).iterdir()))
        real_enable(**kw)

    monkeypatch.setattr(automp, "enable", enable)
    assert fp8.main(["--models", "gpt2", "--modes", "automp-bf16", "--out", str(tmp_path / "c"), *QUICK]) == 0
    assert seen == [["calibration-dev.json"]]
    assert (env / "verdicts.json").read_text() == "{}"  # the user's cache untouched


def test_a_second_run_rebuilds_each_mode_on_its_own_warm_caches(tmp_path, cache, fake_models, monkeypatch):
    """--second-run: every mode builds twice, both times with the same Inductor cache directory, one no other mode
    uses; automp's second session opens on the first one's verdict cache; the losses are the first runs'."""
    dirs: dict[str, list[str]] = {}

    def recording(mode):
        inner = _counting_loop([])

        def build(work, device):
            dirs.setdefault(mode, []).append(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
            return inner(work, device)
        return build

    for mode in ("bf16-reduce-overhead", "automp-bf16"):
        monkeypatch.setitem(wl.LOOPS, mode, recording(mode))
    opened = []
    real_enable = automp.enable
    monkeypatch.setattr(automp, "enable", lambda **kw: opened.append(kw["cache_dir"]) or real_enable(**kw))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    for blocks, limit in (("alternating", fp8.RESIDENT_MAX_PARAMS), ("sequential", 0)):
        dirs.clear(), opened.clear()
        monkeypatch.setattr(fp8, "RESIDENT_MAX_PARAMS", limit)
        out = tmp_path / blocks
        assert fp8.main(["--models", "gpt2", "--modes", "bf16-reduce-overhead,automp-bf16", "--out", str(out),
                         "--second-run", *QUICK]) == 0
        rows = _rows(out)
        for mode in ("bf16-reduce-overhead", "automp-bf16"):
            row = rows[("gpt2", mode)]
            assert row["second_run_s"] >= 0 and "second_run_error" not in row and row["blocks"] == blocks
            assert row["loss"] == float(1 + fp8.ROUNDS)  # read in the first run, after the same steps
            assert len(dirs[mode]) == 2 and dirs[mode][0] == dirs[mode][1] and dirs[mode][0]
        assert dirs["bf16-reduce-overhead"][0] != dirs["automp-bf16"][0]
        assert len(opened) == 2 and opened[0] == opened[1]  # the second session finds the first one's verdicts
        assert rows[("gpt2", "automp-bf16")]["second_paths"] == {}  # the fake loop calls no module
        assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # restored
        assert not os.path.exists(dirs["automp-bf16"][0]) and not os.path.exists(opened[0])  # removed after


def test_a_modes_peak_is_its_own_growth_allocated_and_reserved(monkeypatch):
    """Both peaks above what was there at the start (other resident modes); reserved counts CUDA graph pools whole."""
    from automp.bench import fp8_run
    now = {"allocated": 5 * 2**30, "reserved": 8 * 2**30}
    peak = {"allocated": 0, "reserved": 0}
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: now["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: now["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: peak["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: peak["reserved"])
    mark = fp8_run.Peak("cuda")
    peak.update(allocated=7 * 2**30, reserved=12.5 * 2**30)
    row = {}
    mark.into(row, "second_")
    assert row == {"second_peak_gib": 2.0, "second_peak_reserved_gib": 4.5}
    cpu = {}
    fp8_run.Peak("cpu").into(cpu, "")
    assert cpu == {}


def test_each_steps_peak_is_its_own_and_the_modes_peak_keeps_the_highest(monkeypatch):
    """Peak.step reads the peak since the last step and resets torch's: the mode's peak must still be the highest
    of all steps, not the last one's."""
    from automp.bench import fp8_run
    now = {"allocated": 1 * 2**30, "reserved": 2 * 2**30}
    peak = dict(now)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: peak.update(now))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: now["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: now["reserved"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: peak["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: peak["reserved"])
    mark = fp8_run.Peak("cuda")
    steps = []
    for high in (3, 9, 4):  # GiB allocated at each step's high-water mark
        peak.update(allocated=high * 2**30, reserved=(high + 2) * 2**30)
        steps.append(mark.step())
    assert steps == [2.0, 8.0, 3.0]
    row = {}
    mark.into(row, "")
    assert row == {"peak_gib": 8.0, "peak_reserved_gib": 9.0}
    assert fp8_run.Peak("cpu").step() is None


def test_profile_adds_each_modes_kernel_time_by_category(tmp_path, cache, fake_models, monkeypatch):
    def matmuls(work, device):  # on the device the suite runs and profiles (a GPU host's: CUDA kernels)
        w = torch.randn(64, 64, device=device)

        def step():
            return (torch.randn(32, 64, device=device) @ w).relu().sum()
        return step

    monkeypatch.setitem(wl.LOOPS, "bf16-reduce-overhead", matmuls)
    args = ["--models", "gpt2", "--modes", "bf16-reduce-overhead", *QUICK]
    assert fp8.main([*args, "--out", str(tmp_path / "p"), "--profile"]) == 0
    row = _rows(tmp_path / "p")[("gpt2", "bf16-reduce-overhead")]
    assert row["matmul_ms"] > 0 and row["kernel_ms"] >= row["matmul_ms"] + row["other_ms"] - 1e-3
    assert row["top"][0]["category"] in ("matmul", "other") and row["kernels"] >= 2
    assert "kernel time of one step by category" in (tmp_path / "p.md").read_text()
    assert fp8.main([*args, "--out", str(tmp_path / "n")]) == 0
    assert "kernel_ms" not in _rows(tmp_path / "n")[("gpt2", "bf16-reduce-overhead")]


def test_profile_categories_name_training_kernels():
    from automp.bench import kernel_profile
    from automp.bench.fp8_run import PROFILE
    cases = {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26": "attention",
             "nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN": "matmul", "sm90_xmma_gemm_e4m3bf16_e4m3f32": "matmul",
             "triton_tem_fused_mm_3": "matmul", "aten::mm": "matmul", "aten::_scaled_mm": "matmul",
             "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
             "triton_red_fused__log_softmax__log_softmax_backward_data_0": "other",
             "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "other"}
    assert {name: kernel_profile.category(name, PROFILE) for name in cases} == cases


def test_a_row_names_each_verdicts_rule_and_what_ruled_candidates_out():
    """From automp's report: the rule of each root's verdict, and the bounds that kept a candidate out of its trial
    (here the FP8 step's bf16 twin, forecast slower and never run)."""
    import argparse
    from automp.bench.fp8_run import Run
    opts = argparse.Namespace(device="cpu", warmup=1, first_steps=1, steps=1)
    run = Run("llama-d2048", "automp-fp8", opts, "sequential")
    bound = {"rule": "bf16-twin-forecast-slower", "fp8_ms": 124.6, "saving_ms": 16.1, "forecast_ms": 140.7}
    run.note_report({"choices": [{"module": "Llama", "path": "fp8-graphed", "rule": "bf16-twin-forecast-slower",
                                  "timings_ms": {}, "bounds": {"autocast-graphed": bound}},
                                 {"module": "Head", "path": "autocast-compiled", "rule": "measured-fastest",
                                  "timings_ms": {"autocast-compiled": 1.0}}]})
    assert run.row["verdict_rules"] == {"Llama": "bf16-twin-forecast-slower", "Head": "measured-fastest"}
    assert run.row["trial_bounds"] == {"Llama": {"autocast-graphed": bound}}
    assert run.row["automp_paths"] == {"Llama": "fp8-graphed", "Head": "autocast-compiled"}
    run.finish()
