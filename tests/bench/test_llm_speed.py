"""`automp llm bench --model/--batches/--cases`: the speed matrix's rows (every key, finite numbers), their merge
with an earlier file, skipped and failed rows instead of lost ones, and usage errors before any work."""
import importlib.util
import json
import math
import statistics
import sys
import time

import pytest
import torch

from automp.bench import llm_profile, llm_rounds, llm_speed
from automp.bench.llm_results import ROW_KEYS, merge
from automp.bench.suites import llm

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")


def _rows(path):
    with open(path) as f:
        return {(r["model"], r["case"], r["batch"]): r for r in json.load(f)}


def test_quick_matrix_decodes_a_batch_of_two_and_writes_finite_rows(tmp_path, capsys):
    assert llm.main(["--quick", "--model", "llama-8b-shape", "--batches", "2", "--cases", "fp16-compiled,automp-int4",
                     "--new-tokens", "6", "--repeats", "2", "--profile", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "llm-cpu.json")
    assert set(rows) == {("llama-8b-shape", c, 2) for c in ("fp16-compiled", "automp-int4")}
    for row in rows.values():
        assert set(ROW_KEYS) <= set(row) and "error" not in row and "skipped" not in row, row
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ROW_KEYS[3:]), row
        assert row["tokens_per_s"] == pytest.approx(2 * 1000 / row["ms_per_token"])
        assert row["layers"] == 2 and row["device"] == "cpu" and row["dtype"] == "float16"
        # the median of the alternating rounds, inside their spread (rounded to 4 decimals)
        assert row["rounds"] == 2 and row["spread"][0] <= row["spread"][1], row
        assert row["spread"][0] - 5e-5 <= row["ms_per_token"] <= row["spread"][1] + 5e-5, row
    assert rows[("llama-8b-shape", "automp-int4", 2)]["weight_gib"] < rows[("llama-8b-shape", "fp16-compiled",
                                                                             2)]["weight_gib"]
    md = (tmp_path / "llm-cpu.md").read_text()
    assert "| llama-8b-shape | 2 | automp-int4 | 2 |" in md and "| ms/step | spread |" in md
    profiles = _rows(tmp_path / "llm-profile-cpu.json")  # each timed batch size's step, profiled
    assert set(profiles) == {("llama-8b-shape", c, 2) for c in ("fp16-compiled", "automp-int4")}
    for p in profiles.values():
        assert "error" not in p, p
        assert p["step_ms"] > 0 and p["kernels"] > 0 and p["top"]
        assert p["kernel_ms"] == pytest.approx(sum(p[f"{c}_ms"] for c in llm_profile.CATEGORIES))
    assert "automp bench llm profile" in capsys.readouterr().out


def test_rows_merge_by_model_case_and_batch(tmp_path):
    old = [{"model": "m", "case": "automp-int4", "batch": 1, "ms_per_token": 9.0},
           {"model": "m", "case": "automp-int4", "batch": 8, "ms_per_token": 3.0}]
    new = [{"model": "m", "case": "automp-int4", "batch": 1, "ms_per_token": 1.0},
           {"model": "m", "case": "fp16-compiled", "batch": 1, "ms_per_token": 2.0}]
    merged = merge(old, new)
    assert [(r["case"], r["batch"], r["ms_per_token"]) for r in merged] == [
        ("fp16-compiled", 1, 2.0), ("automp-int4", 1, 1.0), ("automp-int4", 8, 3.0)]
    # through the command: an earlier file's other rows stay, the rerun one is replaced
    (tmp_path / "llm-cpu.json").write_text(json.dumps(old))
    assert llm.main(["--quick", "--batches", "1", "--cases", "automp-int4", "--new-tokens", "3", "--out",
                     str(tmp_path)]) == 0
    rows = _rows(tmp_path / "llm-cpu.json")
    assert rows[("m", "automp-int4", 8)]["ms_per_token"] == 3.0 and ("m", "automp-int4", 1) in rows
    assert rows[("llama-8b-shape", "automp-int4", 1)]["ms_per_token"] > 0


def test_without_torchao_its_rows_are_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    assert llm.main(["--quick", "--batches", "1,2", "--cases", "torchao-int8,torchao-int4", "--out",
                     str(tmp_path)]) == 0
    rows = _rows(tmp_path / "llm-cpu.json")
    assert len(rows) == 4 and all(r["skipped"] == "pip install torchao" for r in rows.values())
    assert all(r["ms_per_token"] is None for r in rows.values())


def _fake_warm(slow_case=None):
    def warm(model, m, batch, row, bandwidth, expired):
        if row["case"] == slow_case:
            time.sleep(30)  # the alarm interrupts it
        row.update(weight_gib=1.0, step_gib=1.0, bandwidth_gbps=1000.0)
        return row["case"]  # what the samples get: here the case, so that they can say whose they are
    return warm


def _fake_sample(values=None, calls=None):
    """ms per step by case: `values[case]` in turn (1.0 where none), each call recorded in `calls`."""
    def sample(model, m, ids, case):
        if calls is not None:
            calls.append(ids)
        v = (values or {}).get(ids)
        if isinstance(v, list):
            v = v.pop(0)
        if isinstance(v, Exception):
            raise v
        return 1.0 if v is None else v
    return sample


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(llm_speed, "prepare", lambda case, m: (torch.nn.Linear(1, 1), ""))
    monkeypatch.setattr(llm_speed, "sample", _fake_sample())


def test_a_case_past_its_timeout_errors_and_the_next_case_runs(tmp_path, monkeypatch, no_model):
    monkeypatch.setattr(llm_speed, "warm", _fake_warm("automp-int8"))
    assert llm.main(["--quick", "--batches", "1,4", "--cases", "automp-int8,fp16-compiled", "--case-timeout", "1",
                     "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "llm-cpu.json")
    assert rows[("llama-8b-shape", "automp-int8", 1)]["error"] == "ran past --case-timeout 1 s"
    assert rows[("llama-8b-shape", "automp-int8", 4)]["skipped"] == "case timeout"
    assert rows[("llama-8b-shape", "fp16-compiled", 1)]["ms_per_token"] == 1.0
    assert rows[("llama-8b-shape", "fp16-compiled", 4)]["ms_per_token"] == 1.0


def test_a_failing_batch_is_an_error_row_and_the_next_batch_runs(tmp_path, monkeypatch, no_model):
    def warm(model, m, batch, row, bandwidth, expired):
        if batch == 1:
            raise RuntimeError("out of memory\nsecond line")
        return _fake_warm()(model, m, batch, row, bandwidth, expired)
    monkeypatch.setattr(llm_speed, "warm", warm)
    assert llm.main(["--quick", "--batches", "1,2", "--cases", "fp16-compiled", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "llm-cpu.json")
    assert rows[("llama-8b-shape", "fp16-compiled", 1)]["error"] == "RuntimeError: out of memory"
    assert rows[("llama-8b-shape", "fp16-compiled", 2)]["ms_per_token"] == 1.0


def test_cases_are_timed_in_alternating_rounds_and_report_median_and_spread(tmp_path, monkeypatch, no_model):
    calls = []
    values = {"fp16-compiled": [3.0, 1.0, 4.0, 2.0] * 2, "automp-int8": [5.0, 5.0, 6.0, 9.0] * 2,
              "automp-int4": [0.5, 0.25, 1.0, 0.75] * 2}
    monkeypatch.setattr(llm_speed, "warm", _fake_warm())
    monkeypatch.setattr(llm_speed, "sample", _fake_sample(values, calls))
    assert llm.main(["--quick", "--batches", "1,2", "--cases", "fp16-compiled,automp-int8,automp-int4", "--repeats",
                     "4", "--out", str(tmp_path)]) == 0
    a, b, c = "fp16-compiled", "automp-int8", "automp-int4"
    assert calls == [a, b, c, c, b, a, a, b, c, c, b, a] * 2  # per batch size: A B C, C B A, A B C, C B A
    rows = _rows(tmp_path / "llm-cpu.json")
    for batch in (1, 2):
        for case, ms, spread in ((a, 2.5, [1.0, 4.0]), (b, 5.5, [5.0, 9.0]), (c, 0.625, [0.25, 1.0])):
            row = rows[("llama-8b-shape", case, batch)]
            assert (row["ms_per_token"], row["spread"], row["rounds"]) == (ms, spread, 4), row
            assert row["tokens_per_s"] == pytest.approx(batch * 1000 / ms)
            assert row["roofline_frac"] == pytest.approx(2**30 / 1e12 / (ms / 1e3))
    md = (tmp_path / "llm-cpu.md").read_text()
    assert "| llama-8b-shape | 2 | automp-int8 | 2 | 5.500 | 5.000-9.000 |" in md


def test_a_failing_sample_ends_its_case_and_the_others_go_on(tmp_path, monkeypatch, no_model):
    calls = []
    values = {"automp-int8": [2.0, RuntimeError("illegal memory access\nmore")]}
    monkeypatch.setattr(llm_speed, "warm", _fake_warm())
    monkeypatch.setattr(llm_speed, "sample", _fake_sample(values, calls))
    assert llm.main(["--quick", "--batches", "1", "--cases", "fp16-compiled,automp-int8,automp-int4", "--repeats",
                     "4", "--out", str(tmp_path)]) == 0
    a, b, c = "fp16-compiled", "automp-int8", "automp-int4"
    assert calls == [a, b, c, c, b, a, a, c, c, a]  # b raised in round 2 and is not sampled again
    rows = _rows(tmp_path / "llm-cpu.json")
    assert rows[("llama-8b-shape", b, 1)]["error"] == "RuntimeError: illegal memory access"
    assert rows[("llama-8b-shape", b, 1)]["ms_per_token"] is None
    for case in (a, c):
        row = rows[("llama-8b-shape", case, 1)]
        assert (row["ms_per_token"], row["spread"], row["rounds"]) == (1.0, [1.0, 1.0], 4) and "error" not in row


def test_the_time_limit_ends_the_rounds_and_keeps_what_they_took():
    def slow():
        time.sleep(0.3)
        return 2.0
    deadline = time.perf_counter() + 0.2
    samples = llm_rounds.time_rounds({"a": slow, "b": lambda: 1.0}, 4, deadline)
    assert samples == {"a": [2.0], "b": []}  # a's first sample ran past the limit: b's was never started
    row = llm_rounds.timed_row({"note": "", "step_gib": 1.0, "bandwidth_gbps": 1.0}, samples["a"], 1, 4)
    assert row["ms_per_token"] == 2.0 and row["rounds"] == 1 and row["spread"] == [2.0, 2.0]
    assert row["note"] == "--time-limit ended the timing after 1 of 4 rounds"


def test_cases_not_started_within_the_time_limit_are_skipped(tmp_path):
    assert llm.main(["--quick", "--batches", "1", "--cases", "fp16-compiled,automp-int8", "--time-limit", "1e-9",
                     "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "llm-cpu.json")
    assert [r["skipped"] for r in rows.values()] == ["time limit", "time limit"]


def test_torchao_falls_back_to_bf16_and_says_so(monkeypatch):
    def fake(case, m, dtype):
        if dtype == torch.float16:
            raise AssertionError("Only bfloat16 is supported")
        return "model"
    monkeypatch.setattr(llm_speed, "_torchao", fake)
    model, note = llm_speed.prepare("torchao-int4", None)
    assert model == "model" and note == "bf16 (fp16 failed: AssertionError: Only bfloat16 is supported)"


def test_torchao_weights_count_their_packed_bytes():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    quantize_(model, Int8WeightOnlyConfig(set_inductor_config=False))
    assert 256 * 128 <= llm_speed.model_bytes(model) < 256 * 128 * 2  # int8 codes and per-row scales, not 4 B each


@pytest.mark.parametrize("args", [["--batches", "0"], ["--batches", "1,x"], ["--cases", "fp16-compiled,int3"],
                                  ["--model", "llama-70b"], ["--layers", "0"], ["--case-timeout", "-1"],
                                  ["--repeats", "0"],
                                  ["--new-tokens", "1"], ["--batches", "1", "--only", "accuracy"]])
def test_bad_input_is_a_one_line_usage_error(tmp_path, capsys, args):
    assert llm.main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("automp llm bench: error: ") and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_an_unreadable_results_file_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "llm-cpu.json").write_text("{not json")
    assert llm.main(["--quick", "--batches", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("automp llm bench: error: --out: ") and "move it away" in err and "\n" not in err
    assert (tmp_path / "llm-cpu.json").read_text() == "{not json"


def test_kernel_names_fall_into_categories():
    cases = {"_wq_gemv_kernel": "quantized", "_split_sum_kernel": "quantized",
             "void at::native::tinygemm_m16n8k16_chunk_kernel<...>": "quantized",
             "_decode_attention_split": "attention", "_decode_attention_combine": "attention",
             "fmha_cutlassF_f16_aligned_64x64_rf_sm80": "attention", "flash_fwd_splitkv_kernel": "attention",
             "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN": "matmul", "sm90_xmma_gemm_f16f16_f16f32": "matmul",
             "triton_tem_fused_mm_0": "matmul", "aten::mm": "matmul", "aten::addmm": "matmul",
             "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "other", "Memcpy DtoD": "other"}
    assert {name: llm_profile.category(name) for name in cases} == cases


def test_torchao_cases_compile_under_torchaos_inductor_settings_and_only_they():
    import torch._inductor.config as inductor
    before = {k: getattr(inductor, k) for k in llm_speed.TORCHAO_INDUCTOR}
    with llm_speed.inductor_settings("torchao-int8"):
        assert all(getattr(inductor, k) == v for k, v in llm_speed.TORCHAO_INDUCTOR.items())
    with llm_speed.inductor_settings("automp-int8"):
        assert {k: getattr(inductor, k) for k in before} == before
    assert {k: getattr(inductor, k) for k in before} == before  # restored


def test_vs_fp16_pairs_the_rounds_of_one_run():
    """Rows timed in the same rounds compare round by round (a drift between rounds cancels); rows of different runs,
    or with a round missing, by their medians."""
    from automp.bench.llm_results import _vs_anchor

    def row(case, samples, run="r1"):
        ms = sorted(samples)[len(samples) // 2]
        return {"model": "m", "layers": 2, "device": "d", "batch": 1, "case": case, "ms_per_token": ms,
                "samples": samples, "run": run}
    # the host slows down over the rounds: the int4 case is exactly half the anchor's time in every round
    anchor, int4 = row("fp16-compiled", [2.0, 4.0, 8.0]), row("automp-int4", [1.0, 2.0, 4.0])
    assert _vs_anchor([anchor, int4], int4) == pytest.approx(2.0)
    skewed = row("automp-int4", [4.0, 1.0, 2.0])  # the same samples, not in round order: pairing matters
    assert _vs_anchor([anchor, skewed], skewed) == pytest.approx(statistics.median([0.5, 4.0, 4.0]))
    other_run = row("automp-int4", [4.0, 1.0, 2.0], run="r2")
    assert _vs_anchor([anchor, other_run], other_run) == pytest.approx(4.0 / 2.0)  # medians
    short = row("automp-int4", [1.0, 2.0])
    assert _vs_anchor([anchor, short], short) == pytest.approx(4.0 / 2.0)


@pytest.mark.parametrize("argv,seconds", [(["--batches", "8,16,32"], 450.0), (["--batches", "1"], 150.0),
                                          (["--batches", "1,8", "--case-timeout", "40"], 40.0)])
def test_the_case_timeout_default_grows_with_the_batch_sizes(tmp_path, monkeypatch, argv, seconds):
    """Every batch size compiles and captures its own step: one flat default skipped the later sizes of a case."""
    seen = []
    monkeypatch.setattr(llm_speed, "run_matrix", lambda m, *a: seen.append(m.case_timeout))
    assert llm.main(["--quick", "--cases", "fp16-compiled", *argv, "--out", str(tmp_path)]) == 0
    assert seen == [seconds]
