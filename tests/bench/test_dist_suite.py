"""`automp bench dist`: a CPU run under torchrun (gloo) at 1 and 2 ranks with every key in every row, the ratios
and scaling efficiency, usage errors before any launch, and the rows of a worker that died."""
import importlib.util
import json
import math
import subprocess
from datetime import timedelta

import pytest
import torch

from automp.bench import dist_worker
from automp.bench.suites import dist
from tests import gloo

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
# --max-warmup: above the longest a CPU trial of the two eager paths can take to settle, so that `settled` does not
# depend on the host's noise: 3 warm-up iterations and 4 rounds x 2 paths x 2 iterations; then, where the two came
# within TrialConfig.confirm_within of each other, its re-measurement: 10 + 1 warm-up iterations and 16 timed (46).
QUICK = ["--quick", "--steps", "1", "--blocks", "2", "--warmup", "1", "--first-steps", "1", "--max-warmup", "60",
         "--mode-timeout", "0"]
KEYS = set(dist.ROW_KEYS) | {"device", "torch", "date"}


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_quick_run_on_one_and_two_ranks(tmp_path, monkeypatch):
    gloo.cpu_host(monkeypatch)  # the CPU (gloo) smoke run, also on a GPU host: no GPU count check, CPU ranks
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AUTOMP_INNER", "eager")  # automp's compiled path without Inductor: the suite, not compile time
    out = tmp_path / "dist-cpu"
    assert dist.main(["--gpus", "1,2", "--models", "llama-d2048-ddp,llama-d4096-fsdp2",
                      "--modes", "automp-bf16,automp-fp8", "--out", str(out), "--profile", *QUICK]) == 0
    rows = {(r["model"], r["mode"], r["gpus"]): r for r in json.loads((tmp_path / "dist-cpu.json").read_text())}
    assert set(rows) == {(m, mode, g) for m in dist.MODELS for mode in ("automp-bf16", "automp-fp8") for g in (1, 2)}
    for (model, mode, gpus), row in rows.items():
        assert KEYS <= set(row), (model, mode, gpus)
        if mode == "automp-fp8":  # no FP8 on a CPU: enable raises on every rank, the row says why
            assert "FP8" in row["skipped"] and row["step_ms"] is None
            continue
        assert "skipped" not in row
        assert row["step_ms"] > 0 and row["spread"][0] <= row["step_ms"] <= row["spread"][1]
        assert math.isfinite(row["loss"]) and row["loss"] != 0 and row["first_run_s"] > 0
        assert row["peak_gib"] is None and row["ratio_vs_bf16"] is None  # CPU; no bf16-compile in this run
        assert row["automp_paths"] and row["settled"] is True
        assert row["comm_ms"] is None and row["comm_overlap"] is None  # profiled, but a CPU has no kernels to read
        one = rows[(model, mode, 1)]
        assert row["scaling_eff"] == pytest.approx(row["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"],
                                                   abs=1e-3)
    for model in dist.MODELS:  # two ranks, two data shards: the averaged loss is not one rank's
        assert rows[(model, "automp-bf16", 2)]["loss"] != rows[(model, "automp-bf16", 1)]["loss"]
    md = (tmp_path / "dist-cpu.md").read_text()
    assert "## llama-d2048-ddp" in md and "## llama-d4096-fsdp2" in md and "| 2 | automp-bf16 |" in md
    assert "| exposed ms | overlap |" in md
    assert (tmp_path / "dist-cpu.png").read_bytes()[:4] == b"\x89PNG"


def _row(model, mode, gpus, step_ms, tokens):
    return {**{k: None for k in dist.ROW_KEYS}, "model": model, "mode": mode, "gpus": gpus, "step_ms": step_ms,
            "tokens_per_s_per_gpu": tokens}


def test_ratios_and_scaling_efficiency():
    rows = [_row("m", "bf16-compile", 1, 100.0, 800.0), _row("m", "automp-bf16", 1, 80.0, 1000.0),
            _row("m", "bf16-compile", 2, 110.0, 720.0), _row("m", "automp-bf16", 2, 100.0, 800.0),
            _row("m", "automp-fp8", 2, 50.0, 1600.0), _row("n", "automp-bf16", 2, 10.0, 5.0),
            {**_row("m", "torchao-float8", 2, None, None), "skipped": "pip install torchao"}]
    dist.add_ratios(rows)
    got = {(r["model"], r["mode"], r["gpus"]): (r["ratio_vs_bf16"], r["scaling_eff"]) for r in rows}
    assert got[("m", "bf16-compile", 1)] == (1.0, 1.0)
    assert got[("m", "automp-bf16", 1)] == (1.25, 1.0)
    assert got[("m", "bf16-compile", 2)] == (1.0, 0.9)
    assert got[("m", "automp-bf16", 2)] == (1.1, 0.8)
    assert got[("m", "automp-fp8", 2)] == (2.2, None)  # no 1-GPU row of its own
    assert got[("n", "automp-bf16", 2)] == (None, None)  # no anchor, no 1-GPU row
    assert got[("m", "torchao-float8", 2)] == (None, None)
    rows[4]["fp8_layers"] = {"LlamaForCausalLM": {"fp8_layers": 28, "layers_seen": 29,
                                                  "all_gather": {"rules": {"fp8-all-gather": 28}}}}
    md = dist.markdown(rows)
    assert "| 2 | automp-bf16 | 100.00 |" in md and "skipped: pip install torchao" in md
    assert "LlamaForCausalLM: 28 of 29 layers FP8, 28 all-gathered in FP8 |" in md


def test_usage_errors_exit_2_before_any_launch(tmp_path, capsys, monkeypatch):
    gloo.cpu_host(monkeypatch)  # each error below, not "--gpus N: only 1 CUDA device(s) visible" on a 1-GPU host
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    for args, says in ((["--modes", "automp-int4"], "--modes: unknown 'automp-int4'"),
                       (["--models", "llama-d2048"], "--models: unknown 'llama-d2048'"),
                       (["--gpus", "0"], "--gpus"), (["--gpus", "1,x"], "--gpus"), (["--gpus", ""], "--gpus"),
                       (["--blocks", "0"], "--blocks must be at least 1"),
                       (["--layers-d4096", "0"], "--layers-d4096 must be at least 1"),
                       (["--collective-timeout", "0"], "--collective-timeout must be at least 1")):
        assert dist.main([*args, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("automp bench dist: ") and says in err and "\n" not in err, err
    assert not list(tmp_path.iterdir())  # nothing written
    (tmp_path / "r.json").mkdir()
    assert dist.main(["--out", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.strip() == f"automp bench dist: --out {tmp_path / 'r.json'} is a directory"


def test_more_ranks_than_visible_gpus_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(dist, "device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    assert dist.main(["--gpus", "1,2", "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.strip() == "automp bench dist: --gpus 2: only 1 CUDA device(s) visible"


class _DyingWorker:
    """A torchrun launch that finished the first model x mode, then died (or hung: hang=True)."""

    def __init__(self, cmd, hang=False, **kwargs):
        result = cmd[cmd.index("--result") + 1]
        self.pid, self.hang = 4321, hang
        with open(result, "w") as f:
            json.dump([{**_row("llama-d2048-ddp", "automp-bf16", 2, 10.0, 100.0), "loss": 6.0}], f)

    def wait(self, timeout=None):
        if self.hang == "stop" and timeout is not None:
            raise dist.Stopped()  # what SIGTERM raises in the parent while it waits
        if self.hang and timeout is not None:
            raise subprocess.TimeoutExpired("torchrun", timeout)
        return -9 if self.hang else 1


def test_the_collective_timeout_is_the_workers_argument_not_an_environment_variable(tmp_path, monkeypatch):
    """--collective-timeout (default 900 s) goes on the worker's command line and into init_process_group;
    AUTOMP_DIST_TIMEOUT, which the worker once read, changes nothing."""
    gloo.cpu_host(monkeypatch)
    monkeypatch.setenv("AUTOMP_DIST_TIMEOUT", "5")
    commands = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **k: commands.append(cmd) or _DyingWorker(cmd))
    for extra, seconds in (([], 900.0), (["--collective-timeout", "60"], 60.0)):
        commands.clear()
        dist.main(["--gpus", "1", "--models", "llama-d2048-ddp", "--modes", "automp-bf16",
                   "--out", str(tmp_path / "t"), *extra])
        worker_argv = commands[0][commands[0].index("automp.bench.dist_worker") + 1:]
        assert dist_worker.parser().parse_args(worker_argv).collective_timeout == seconds
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    joined = {}
    monkeypatch.setattr(dist_worker.dist, "init_process_group", lambda backend, timeout: joined.update(
        backend=backend, timeout=timeout))
    dist_worker.Rank(60.0)
    assert joined == {"backend": "gloo", "timeout": timedelta(seconds=60)}


@pytest.mark.parametrize("hang", [False, True])
def test_a_dead_worker_keeps_its_rows_and_skips_the_rest(tmp_path, monkeypatch, hang):
    gloo.cpu_host(monkeypatch)  # --gpus 2 on a CPU host: a GPU host with fewer GPUs would refuse it before launching
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **k: _DyingWorker(cmd, hang))
    killed = []
    monkeypatch.setattr(dist.os, "killpg", lambda pid, sig: killed.append(pid))
    out = tmp_path / "d"
    assert dist.main(["--gpus", "2", "--models", "llama-d2048-ddp", "--modes", "automp-bf16,automp-fp8",
                      "--mode-timeout", "1", "--out", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads((tmp_path / "d.json").read_text())}
    assert rows["automp-bf16"]["step_ms"] == 10.0 and "skipped" not in rows["automp-bf16"]
    why = rows["automp-fp8"]["skipped"]
    assert ("ran past" in why and killed == [4321]) if hang else "exited with code 1" in why
    assert KEYS <= set(rows["automp-fp8"])


def test_a_stopped_suite_writes_the_rows_finished_so_far(tmp_path, monkeypatch):
    """`timeout 600 automp bench dist ...` ending the suite mid-launch: the ranks are killed, the modes they finished
    are written, the rest are skipped as stopped, and no further world size is launched."""
    gloo.cpu_host(monkeypatch)  # --gpus 2,4 on a CPU host: a GPU host with fewer GPUs would refuse it before launching
    launched = []

    def popen(cmd, **k):
        launched.append(cmd[cmd.index("--nproc_per_node") + 1])
        return _DyingWorker(cmd, "stop")
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(dist.os, "killpg", lambda pid, sig: None)
    out = tmp_path / "d"
    assert dist.main(["--gpus", "2,4", "--models", "llama-d2048-ddp", "--modes", "automp-bf16,automp-fp8",
                      "--mode-timeout", "1", "--out", str(out)]) == 143
    rows = {r["mode"]: r for r in json.loads((tmp_path / "d.json").read_text())}
    assert rows["automp-bf16"]["step_ms"] == 10.0 and "stopped" in rows["automp-fp8"]["skipped"]
    assert launched == ["2"]
