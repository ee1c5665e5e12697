"""`automp bench deploy_gpu` argument handling and its pieces that need no GPU (the run itself is the lead's)."""
import glob
import json

import pytest
import torch

from automp.bench.suites import deploy_gpu


def test_defaults_full_and_quick():
    full = deploy_gpu.parse([])
    assert (full.models, full.batches, full.seq, full.sentences) == (["minilm", "bert-base"], [1, 64], 128, 256)
    assert full.modes == list(deploy_gpu.MODES)
    quick = deploy_gpu.parse(["--quick", "--modes", "int8"])
    assert quick.modes == ["anchor", "int8"] and quick.batches == [1, 2] and quick.seq == 32  # ratios need it


@pytest.mark.parametrize("argv", [["--models", "resnet"], ["--modes", "int2"], ["--batches", "1,x"],
                                  ["--batches", "0"]])
def test_bad_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit):
        deploy_gpu.parse(argv)
    assert "error:" in capsys.readouterr().err


def test_texts_and_pooling():
    docs = deploy_gpu.texts(5, seed=0)
    assert len(docs) == 5 and docs == deploy_gpu.texts(5, seed=0) and all(d.endswith(".") for d in docs)

    class Hidden(torch.nn.Module):
        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"last_hidden_state": input_ids[..., None].float().repeat(1, 1, 2)})
    ids = torch.tensor([[1, 3, 9]])
    pooled = deploy_gpu.MeanPooled(Hidden())(ids, torch.tensor([[1, 1, 0]]))
    assert torch.equal(pooled, torch.tensor([[2.0, 2.0]]))  # the padded token is left out


@pytest.mark.parametrize("argv", [["--iters", "-1"], ["--rounds", "-2"], ["--seq", "-8"]])
def test_counts_below_one_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        deploy_gpu.parse(argv)
    assert "must be at least 1" in capsys.readouterr().err


def test_modes_take_turns_in_every_round(monkeypatch):
    """Blocks alternate A B C, C B A, ...: each mode leads as often as it trails, and untimed calls precede each."""
    timed, called = [], []
    monkeypatch.setattr(deploy_gpu, "block_ms", lambda fn, n, device: timed.append(fn.__name__) or 1.0)
    args = deploy_gpu.parse(["--quick", "--rounds", "4"])

    def call(name):
        def f():
            called.append(name)
        f.__name__ = name
        return f
    blocks = deploy_gpu.alternating({m: call(m) for m in ("anchor", "int8", "int8-static")}, args, "cpu")
    assert timed == ["anchor", "int8", "int8-static", "int8-static", "int8", "anchor"] * 2
    assert blocks == {m: [1.0] * 4 for m in ("anchor", "int8", "int8-static")}
    assert called == timed  # --quick: one untimed call before each block


def test_a_quick_cpu_run_writes_paired_ratios_with_their_spread(tmp_path, monkeypatch):
    """The run from build to rows, each mode's set-up timed apart from the others; the quantized model is the FP32 one
    here (automp.deploy.quantized's own tests cover the quantization, under the Triton interpreter: minutes here)."""
    real = deploy_gpu._build

    def build(mode, fp32, calib, cuda):
        if mode in ("fp32-eager", "anchor"):
            return real(mode, fp32, calib, cuda)
        return fp32, {"quantized_layers": 0}
    monkeypatch.setattr(deploy_gpu, "_build", build)
    out = tmp_path / "r"
    assert deploy_gpu.main(["--quick", "--models", "bert-base", "--modes", "anchor,int8-static", "--batches", "1,3",
                            "--rounds", "4", "--out", str(out)]) == 0
    (enc,) = glob.glob(str(out / "encoders-*.json"))
    with open(enc) as f:
        rows = json.load(f)
    batches = [1, 3] + ([4] if torch.cuda.is_available() else [])  # on CUDA the report's calibration batch too
    assert [(r["case"], r["activations"], r["batch"]) for r in rows] == [("int8", "static", b) for b in batches]
    for r in rows:
        assert r["rounds"] == 4 and r["spread"][0] <= r["ms"] <= r["spread"][1]
        assert r["ratio_spread"][0] <= r["ratio"] <= r["ratio_spread"][1] and r["setup_s"] >= 0
        phases = r["setup_phases"]  # the set-up split: building, then each shape's first call
        assert sorted(int(b) for b in phases["first_call_s"]) == batches
        assert phases["built_s"] + sum(phases["first_call_s"].values()) <= r["setup_s"] + 0.02 * (1 + len(batches))
        assert r["cos_min"] > 0.999999 and {"device", "torch", "date", "commit"} <= set(r)  # the FP32 model itself


def test_encoder_rows_name_the_int8_cases_and_skip_the_anchors():
    from automp.bench.harness import Result

    def row(name, ms, anchor_ms, batch, **extra):
        return Result("deploy_gpu", name, ms, "torch.compile fp16", anchor_ms,
                      {"batch": batch, "cos_min": 0.99712, "report_batch": 16, **extra})
    timed = dict(spread=[3.0, 3.2], ratio=1.17, ratio_spread=[1.12, 1.2], rounds=6, setup_s=47.2,
                 setup_phases={"convert": 9.0, "built_s": 30.0, "first_call_s": {64: 17.2}})
    results = [row("bert-base seq128 bs64 anchor", 3.6, 3.6, 64),
               row("bert-base seq128 bs64 int8-static", 3.1, 3.6, 64, report_speedup=1.3, **timed),
               row("bert-base seq128 bs16 int8-static", 1.0, 1.1, 16, report_speedup=1.12, **timed),  # 1.12 / 1.17
               row("bert-base seq128 bs16 int8", 1.0, 1.4, 16, report_speedup=1.2, **{**timed, "ratio": 1.4}),
               row("minilm-L6 (real weights) seq128 bs1 int4-weight", 0.8, 0.4, 1),
               row("bert-base seq128 bs1 int8", float("nan"), 0.8, 1)]  # skipped by the time limit
    rows = deploy_gpu.encoder_rows(results)
    where = {k: rows[0][k] for k in ("device", "torch", "date", "commit", "source")}
    assert rows[0] == {"model": "bert-base", "case": "int8", "activations": "static", "batch": 64, "ms": 3.1,
                       "anchor_ms": 3.6, "cos_min": 0.99712, **timed, "report_speedup": None, "agrees": None,
                       **where}  # the report timed batch 16, not 64: nothing to compare
    assert (rows[1]["report_speedup"], rows[1]["agrees"]) == (1.12, True)  # within 5% of 1.17
    assert (rows[2]["report_speedup"], rows[2]["agrees"]) == (1.2, False)  # 1.2 against 1.4
    assert rows[3] == {"model": "minilm", "case": "int4-weight", "activations": None, "batch": 1, "ms": 0.8,
                       "anchor_ms": 0.4, "cos_min": 0.99712, "ratio": 0.5, "spread": None, "ratio_spread": None,
                       "rounds": None, "setup_s": None, "setup_phases": None, "report_speedup": None, "agrees": None,
                       **where}
    assert len(rows) == 4
    md = deploy_gpu.encoder_markdown(rows, "automp bench deploy_gpu")
    assert ("| bert-base | int8 | static | 64 | 3.100 | 3.000-3.200 | 3.600 | 1.17x | 1.12-1.20 | 47.2 | 0.99712 |  |"
            in md)
    assert "| 1.12x, agrees |" in md and "| 1.20x, off by more than 5% |" in md
