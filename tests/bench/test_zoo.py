"""`automp bench zoo` on CPU: the quick workloads train, the third-party builders give finite losses and gradients,
the result files merge by model and keep their schema, and a failing or unavailable model only costs its rows."""
import json
import math
import time

import pytest
import torch
import torch.nn.functional as F

import automp
from automp.bench import harness, zoo_scripts
from automp.bench.suites import zoo
from tests import gloo

REQUIRED = {"model", "mode", "step_ms", "peak_gib", "loss"}


def _train(work, steps=20):
    loop = zoo.ModeLoop(work, "fp32-eager", "cpu")
    return [float(loop.step()) for _ in range(steps)]


@pytest.mark.parametrize("name", ["recsys", "lstm", "mlp"])
def test_small_script_trains(name):
    torch.manual_seed(0)
    losses = _train(zoo.MODELS[name][0](True, "cpu"))
    assert all(map(math.isfinite, losses))
    # fixed seeds and batch: the LSTM falls slowest, 4.16 -> 4.06; an optimizer that does not step leaves it flat
    assert losses[-1] < 0.99 * losses[0], f"{name}: {losses[0]:.4f} -> {losses[-1]:.4f}"


def _generator_loss(work):
    real, z = work.batch
    with torch.no_grad():
        logits = work.modules["D"](work.modules["G"](z))
    return float(F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits)))


def _gan(frozen=None):
    """The quick DCGAN; `frozen`'s optimizer gets lr 0 so the other player's progress shows in its own loss."""
    torch.manual_seed(0)
    work = zoo_scripts.gan(True, "cpu")
    for group in (work.optimizers[frozen].param_groups if frozen else []):
        group["lr"] = 0.0
    return work


def test_gan_each_optimizer_lowers_its_own_loss():
    """A GAN's losses need not fall together, so each player is checked against the other held still."""
    d_losses = _train(_gan(frozen="G"))
    assert d_losses[-1] < 0.85 * d_losses[0], f"D: {d_losses[0]:.4f} -> {d_losses[-1]:.4f}"
    work = _gan(frozen="D")
    before = _generator_loss(work)
    _train(work)
    assert _generator_loss(work) < 0.7 * before
    work = _gan()
    start = {k: [p.detach().clone() for p in m.parameters()] for k, m in work.modules.items()}
    assert all(map(math.isfinite, _train(work, steps=3)))
    for k, m in work.modules.items():  # the full loop steps both optimizers
        assert any(not torch.equal(a, b) for a, b in zip(start[k], m.parameters())), k


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-1b", "bert", "t5"])
def test_transformers_quick_config_gives_loss_and_gradients(name):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    work = zoo.MODELS[name][0](True, "cpu")
    model = work.modules["model"]
    loss = work.step(zoo.ModeLoop(work, "fp32-eager", "cpu"), work.batch)
    assert math.isfinite(loss.item())
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.parametrize("name", ["vit", "convnext", "effnet", "resnet50", "detector"])
def test_vision_quick_config_gives_finite_loss(name):
    for lib in zoo.MODELS[name][1]:
        pytest.importorskip(lib)
    torch.manual_seed(0)
    work = zoo.MODELS[name][0](True, "cpu")
    assert math.isfinite(float(zoo.ModeLoop(work, "fp32-eager", "cpu").step()))


def _row(model, mode, ms, loss=1.0):
    return {"model": model, "mode": mode, "step_ms": ms, "peak_gib": None, "loss": loss}


def test_outputs_merge_by_model_and_keep_schema(tmp_path):
    first = [_row(m, mode, 10.0) for m in ("a", "b") for mode in zoo.MODES]
    zoo.write_outputs(zoo.add_ratios(first[:6]) + zoo.add_ratios(first[6:]), str(tmp_path), "zoo-x")
    newer = zoo.add_ratios([_row("b", mode, 5.0 if mode == zoo.ANCHOR else 20.0, 2.0) for mode in zoo.MODES])
    merged, md = zoo.write_outputs(newer, str(tmp_path), "zoo-x")
    rows = json.loads((tmp_path / "zoo-x.json").read_text())
    assert rows == merged
    assert [(r["model"], r["mode"]) for r in rows] == [(m, mode) for m in ("a", "b") for mode in zoo.MODES]
    assert all(r["step_ms"] == 10.0 for r in rows if r["model"] == "a")
    b = {r["mode"]: r for r in rows if r["model"] == "b"}
    assert b[zoo.ANCHOR]["ratio_vs_anchor"] == 1.0 and b["fp32-eager"]["ratio_vs_anchor"] == 0.25
    assert b["automp-bf16"]["loss_vs_fp32"] == 0.0
    assert "| b | automp-fp16 | 20.00 | 0.25 |" in md and (tmp_path / "zoo-x.md").read_text() == md
    assert (tmp_path / "zoo-x.png").stat().st_size > 0


def test_failing_or_missing_model_gives_error_rows(monkeypatch):
    def broken(quick, device):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setitem(zoo.MODELS, "mlp", (broken, ()))
    monkeypatch.setitem(zoo.MODELS, "gan", (zoo_scripts.gan, ("no_such_library_zoo",)))
    rows = zoo.run_model("mlp", ["fp32-eager", "automp-bf16"], True, "cpu", 1, 1, 1)
    assert [r["error"] for r in rows] == ["RuntimeError: CUDA out of memory (simulated)"] * 2
    assert not automp.is_enabled()
    rows = zoo.run_model("gan", ["fp32-eager"], True, "cpu", 1, 1, 1)
    assert rows[0]["error"].startswith("skipped: pip install automp[zoo]") and "no_such_library_zoo" in rows[0]["error"]


def test_mode_past_its_time_limit_gives_error_row(monkeypatch):
    def slow(quick, device):
        time.sleep(5)

    monkeypatch.setitem(zoo.MODELS, "mlp", (slow, ()))
    t0 = time.perf_counter()
    row = zoo.run_mode("mlp", "automp-bf16", True, "cpu", 1, 1, 1, timeout=0.3)
    assert row["error"].startswith("timeout") and time.perf_counter() - t0 < 3
    assert not automp.is_enabled()


def test_device_name_and_gpu_slug(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, slug in [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H200", "h200"),
                       ("NVIDIA GeForce RTX 4090", "4090")]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert harness.device_name("cuda") == name and harness.gpu_slug(harness.device_name("cuda")) == slug
    assert harness.device_name("cpu") == "cpu" and harness.gpu_slug("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in (None, "cuda"):  # no GPU visible: the processor is named
        assert harness.device_name(device).startswith("cpu (")


@pytest.mark.parametrize("argv", [["--models", "gpt2,resnet50"], ["--device", "cpu", "--models", "mlp"]])
def test_a_cpu_run_without_quick_is_refused_in_one_line(argv, tmp_path, capsys, monkeypatch):
    """GPT-2 124M and ResNet-50 take minutes per step on a CPU: the suite says so and trains nothing."""
    gloo.cpu_host(monkeypatch)
    monkeypatch.setattr(zoo, "run_model", lambda *a, **k: pytest.fail("trained on a CPU"))
    assert zoo.main([*argv, "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "automp bench zoo: needs a CUDA GPU (these models take minutes per step on a CPU); add --quick for a "
        "CPU-sized smoke run\n")
    assert not list(tmp_path.iterdir())


def test_list(capsys):
    assert zoo.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["gpt2", "llama", "bert", "t5", "vit", "convnext", "effnet", "resnet50", "detector", "gan",
                      "recsys", "lstm", "mlp", "llama-1b"]


def test_llama_1b_has_the_dims_it_names_and_runs_only_when_asked(capsys):
    """Llama-3.2-1B's widths and depth, built on the meta device (no memory), and not in a default run."""
    pytest.importorskip("transformers")
    from automp.bench import zoo_models
    work = zoo_models.llama_1b(False, "meta")
    cfg = work.modules["model"].config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.vocab_size, cfg.tie_word_embeddings) == (2048, 8192, 16, 32, 8, 128256, True)
    assert tuple(work.batch["input_ids"].shape) == (4, 2048)
    with pytest.raises(SystemExit):
        zoo.main(["--help"])
    assert "default: all but llama-1b" in capsys.readouterr().out


def test_suite_end_to_end_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOMP_INNER", "eager")  # the same precision decisions without Inductor's compile time
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))  # no verdicts from earlier runs
    argv = ["--quick", "--device", "cpu", "--models", "mlp,gan", "--modes", "fp32-eager,automp-bf16", "--steps", "2",
            "--out", str(tmp_path)]
    assert zoo.main(argv) == 0
    assert not automp.is_enabled()
    rows = json.loads((tmp_path / "zoo-cpu-quick.json").read_text())
    assert [(r["model"], r["mode"]) for r in rows] == [(m, mode) for m in ("gan", "mlp")
                                                       for mode in ("fp32-eager", "automp-bf16")]
    for r in rows:
        assert REQUIRED <= r.keys() and "error" not in r, r
        assert r["step_ms"] > 0 and math.isfinite(r["loss"]) and r["compile_s"] >= 0 and r["warmup_steps"] >= 3, r
        assert r["device"] == "cpu" and r["quick"] is True, r
        assert abs(r["loss_vs_fp32"]) < (1e-12 if r["mode"] == "fp32-eager" else 0.2 * r["loss"]), r
    md = (tmp_path / "zoo-cpu-quick.md").read_text()
    assert "| mlp | automp-bf16 |" in md and "TF32 off" in md
    assert "| gan | fp32-eager |" in capsys.readouterr().out
    assert (tmp_path / "zoo-cpu-quick.png").exists()


def test_automp_modes_get_twice_the_time_limit(monkeypatch):
    """automp compiles two paths before its trial settles; one compile's time limit would cut every slow model."""
    limits = {}

    def fake(name, mode, quick, device, steps, warmup, max_warmup, timeout=0):
        limits[mode] = timeout
        return {"model": name, "mode": mode, "step_ms": 1.0, "peak_gib": None, "loss": 0.5, "compile_s": 0.0}

    monkeypatch.setattr(zoo, "run_mode", fake)
    zoo.run_model("mlp", ["autocast-bf16-compile", "automp-bf16", "automp-fp16"], True, "cpu", 1, 1, 1, timeout=10)
    assert limits == {"autocast-bf16-compile": 10, "automp-bf16": 10 * zoo.COMPILE_TIMEOUT_FACTOR,
                      "automp-fp16": 10 * zoo.COMPILE_TIMEOUT_FACTOR} and zoo.COMPILE_TIMEOUT_FACTOR > 1


def test_passes_alternate_the_mode_order_and_take_the_median(monkeypatch):
    """A host that slows down during the run (here: +1 ms per mode run) must not favour the modes that ran first:
    with the order reversed on the second pass every mode's median sees the same drift."""
    order, clock = [], iter(range(100))

    def drifting(name, mode, quick, device, steps, warmup, max_warmup, timeout=0):
        order.append(mode)
        return {"model": name, "mode": mode, "step_ms": 10.0 + next(clock), "peak_gib": 1.0 + len(order),
                "loss": 0.5, "compile_s": 0.0}

    monkeypatch.setattr(zoo, "run_mode", drifting)
    modes = ["fp32-eager", "autocast-bf16-compile", "automp-bf16"]
    rows = {r["mode"]: r for r in zoo.run_model("mlp", modes, True, "cpu", 1, 1, 1, passes=2)}
    assert order == modes + modes[::-1]
    assert {m: r["step_ms_passes"] for m, r in rows.items()} == {
        "fp32-eager": [10.0, 15.0], "autocast-bf16-compile": [11.0, 14.0], "automp-bf16": [12.0, 13.0]}
    assert {r["step_ms"] for r in rows.values()} == {12.5}  # drift cancelled: equal code, equal medians
    assert rows["fp32-eager"]["peak_gib"] == 7.0  # the largest peak of the passes
    assert rows["automp-bf16"]["ratio_vs_anchor"] == pytest.approx(1.0)


def test_markdown_shows_reserved_peak_where_measured():
    """CUDA graphs' private pool shows only in the reserved count: a row with it shows both, a CPU row neither."""
    rows = [{"model": "gpt2", "mode": zoo.ANCHOR, "step_ms": 30.0, "peak_gib": 6.43, "peak_reserved_gib": 7.1,
             "loss": 9.05},
            {"model": "gpt2", "mode": "automp-bf16", "step_ms": 26.0, "peak_gib": 1.47, "peak_reserved_gib": 7.25,
             "loss": 9.05},
            {"model": "mlp", "mode": "fp32-eager", "step_ms": 1.0, "peak_gib": None, "loss": 0.5}]
    table = zoo.markdown(rows)
    assert "| 6.43 / 7.10 |" in table and "| 1.47 / 7.25 |" in table
    assert "| mlp | fp32-eager | 1.00 |  |  | 0.5000 |" in table


def test_ratios_are_taken_against_the_strongest_loop_the_run_measured():
    """A run with the expert's loop (reduce-overhead + fused Adam) holds every mode to it, not to plain compile."""
    rows = zoo.add_ratios([_row("m", zoo.ANCHOR, 20.0), _row("m", zoo.STRONGEST, 10.0), _row("m", "automp-bf16", 8.0)])
    by = {r["mode"]: r for r in rows}
    assert by["automp-bf16"]["ratio_vs_anchor"] == 1.25 and by["automp-bf16"]["anchor"] == zoo.STRONGEST
    assert by[zoo.ANCHOR]["ratio_vs_anchor"] == 0.5
    only_compile = zoo.add_ratios([_row("m", zoo.ANCHOR, 20.0), _row("m", "automp-bf16", 8.0)])
    assert only_compile[1]["ratio_vs_anchor"] == 2.5 and only_compile[1]["anchor"] == zoo.ANCHOR


def test_the_experts_loop_fuses_only_adam_left_at_its_defaults():
    from automp.bench.zoo_modes import fuse_adam
    p = torch.nn.Parameter(torch.randn(3))
    chosen = torch.optim.AdamW([p], foreach=True)
    default = torch.optim.AdamW([p])
    fuse_adam([chosen, default])
    assert chosen.param_groups[0]["fused"] is None  # the script chose: left alone
    assert default.param_groups[0]["fused"] is None  # a CPU parameter: torch's fused Adam is a CUDA kernel here
