"""`automp demo` on CPU with the eager inner compiler: automp's held-out loss stays near FP32's for both built-in
models, the report file has low-precision forward and backward graphs for both, and automp is off afterwards."""
import json
import math
import re

import pytest
import torch

import automp
from automp.cli import demo
from automp.models.data import MarkovCorpus
from automp.models.gpt import GPT, GPTConfig
from automp.runtime.decisions import AS_WRITTEN

# Few steps of Adam from the same weights on the same batches: measured differences are ~0.01-0.1%. The CNN's
# eval-mode loss goes through BatchNorm running statistics, which amplify small weight differences: 3% vs 2%.
RTOL = {"gpt": 0.02, "cnn": 0.03}


def test_demo_matches_fp32_and_writes_report(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_INNER", "eager")
    monkeypatch.setenv("AUTOMP_PATH", "compile")  # the graph pass itself, whatever a trial would choose
    path = tmp_path / "demo.json"
    assert demo.main(steps=8, device="cpu", dtype="auto", report=str(path)) == 0
    assert not automp.is_enabled()
    rep = json.loads(path.read_text())
    runs = {(r["model"], r["mode"].split()[0]): r for r in rep["demo"]}
    assert runs.keys() == {(m, mode) for m in RTOL for mode in ("fp32", "automp")}
    assert runs["gpt", "fp32"]["final_loss"] < math.log(GPTConfig().vocab)  # FP32 did learn something
    for model, rtol in RTOL.items():
        ref, got = runs[model, "fp32"]["final_loss"], runs[model, "automp"]["final_loss"]
        assert abs(got - ref) / ref < rtol, f"{model}: automp {got:.5f} vs FP32 {ref:.5f}"
    assert rep["dtype"] == "bfloat16"
    for label in ("GPT", "CNN"):
        low = {g["kind"] for g in rep["graphs"] if g["name"].startswith(label + ".")
               and any(n["dtype"] == "bfloat16" for n in g["nodes"])}
        assert {"forward", "backward"} <= low, (label, [g["name"] for g in rep["graphs"]])


def test_demo_rejects_zero_steps():
    with pytest.raises(ValueError, match="steps"):
        demo.run_demo(0, torch.device("cpu"))


def test_markov_corpus_follows_its_table():
    corpus = MarkovCorpus(vocab=32, successors=3)
    tokens = corpus.batch(16, 20, torch.Generator().manual_seed(0))
    allowed = corpus.table[tokens[:, :-1]]  # [n, seq, successors]
    assert (allowed == tokens[:, 1:, None]).any(-1).all()
    assert corpus.entropy() == pytest.approx(math.log(3))


def test_gpt_rejects_sequence_longer_than_context():
    model = GPT(GPTConfig(vocab=16, ctx=8, d=16, layers=1, heads=2))
    with pytest.raises(ValueError, match="context of 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_demo_on_cpu_keeps_the_path_it_measured_fastest_or_fp32_within_the_noise(tmp_path, monkeypatch):
    """With the default path="auto" automp times its candidates on this CPU and keeps the fastest; it never
    compiles here (Inductor's CPU compile costs more than a short script can win back) and says why."""
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AUTOMP_PATH", raising=False)
    results, rep = demo.run_demo(30, torch.device("cpu"))
    assert {c["module"] for c in rep["choices"]} == {"GPT", "CNN"}
    for c in rep["choices"]:
        assert c["path"] in ("fp32-eager", "low-precision-eager", "unsettled") and c["reason"]
        if len(c["timings_ms"]) > 1:  # a trial ran: the kept path is the fastest one measured, or the script as
            t, best = c["timings_ms"], min(c["timings_ms"].values())  # written when that led it by noise only
            assert t[c["path"]] == best or (c["path"] == "fp32-eager" and t["fp32-eager"] <= 1.03 * best
                                            and c["rule"] == AS_WRITTEN)
    assert rep["graphs"] == [] and rep["compiles"] == {}
    # measured afresh in a cache of the demo's own: nothing read from or left in the user's
    assert not any(c["cached"] for c in rep["choices"]) and not any(tmp_path.iterdir())
    for r in results:
        if r.mode == "automp" and r.path == "fp32-eager":
            assert not r.speedup and r.label.startswith("automp: ")


def test_a_run_that_kept_fp32_is_said_in_words_with_no_speedup(tmp_path, monkeypatch, capsys):
    """automp on FP32 runs the code the FP32 run ran: its row says so and shows no step-time ratio (which would only
    measure noise). The demo writes nothing into the user's cache (HOME and AUTOMP_CACHE_DIR point at empty
    directories that stay empty)."""
    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir(), cache.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(cache))
    monkeypatch.setenv("AUTOMP_PATH", "fp32")
    monkeypatch.setenv("COLUMNS", "250")  # one line per table row
    path = tmp_path / "demo.json"
    assert demo.main(steps=2, device="cpu", report=str(path)) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "automp: FP32 as written" in line]
    assert len(rows) == 2 and not any(re.search(r"\d\.\d\dx", row) for row in rows), out
    assert not any(home.iterdir()) and not any(cache.iterdir())
    automp_rows = [r for r in json.loads(path.read_text())["demo"] if r["mode"] == "automp"]
    assert [(r["path"], r["speedup"]) for r in automp_rows] == [("fp32-eager", False)] * 2


@pytest.mark.parametrize("choice, words, ratio", [
    ({"path": "fp32-eager", "timings_ms": {"fp32-eager": 10.0, "low-precision-eager": 10.4}, "reason": "fastest"},
     "automp: kept FP32 as written — no low-precision path measured faster here", False),
    ({"path": "fp32-eager", "timings_ms": {"fp32-eager": 10.0, "low-precision-eager": 10.4}, "reason": "fastest",
      "calls": {"trial": {"low-precision-eager": 12, "fp32-eager": 6}, "chosen": {"fp32-eager": 62}}},
     "kept FP32 as written — no low-precision path measured faster here (trial: 12 calls bfloat16, 6 FP32)", False),
    ({"path": "as-written", "timings_ms": {}, "reason": "compilation failed"}, "compilation failed", False),
    ({"path": "unsettled", "timings_ms": {"fp32-eager": 10.0}, "reason": "still timing"}, "still timing", False),
    ({"path": "low-precision-eager", "timings_ms": {"fp32-eager": 10.0, "low-precision-eager": 6.0}, "reason": "x"},
     "automp (bfloat16, low-precision-eager)", True),
])
def test_describe_says_what_automp_did(choice, words, ratio):
    label, speedup = demo.describe(choice, "bfloat16")
    assert words in label and speedup is ratio
