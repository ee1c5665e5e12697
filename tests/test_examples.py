"""The example scripts run unchanged under `automp run`: same exit code, nearly the same loss, and a report that
shows low precision in both the forward and the backward graph. Plus the launcher's promise to behave like
`python SCRIPT ARGS` (exit codes, the script's own traceback, sys.argv).

Every script is run twice, in FP32 with plain `python` and in bf16 with `automp run`, as two concurrent
subprocesses (one thread each, the same on both sides). Same seed, same data: the final losses differ by
precision only. Tolerances are relative and per script (see CASES).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


@dataclass
class Case:
    steps: int
    rtol: float  # |automp - fp32| / fp32 on the final held-out loss


CASES = {
    # Smooth regression with Adam: bf16 rounding of the matmul inputs moved the MSE by 0.02% (measured); 2% leaves
    # room for another CPU's bf16 kernels without hiding a broken pass (which moves it by tens of percent).
    "train_mlp.py": Case(steps=30, rtol=0.02),
    # BatchNorm statistics from bf16 convolutions plus SGD momentum amplify rounding more than Adam on an MLP, and
    # the held-out loss goes through the running statistics: measured 0.004% here, 0.2% at 40 steps; allowed 5%.
    "train_cnn_bn.py": Case(steps=20, rtol=0.05),
    # The nn.LSTM runs as one fused op under autocast, the rest through the pass; a recurrence compounds rounding,
    # so 5% (measured 0.003% at 30 steps with the whole LSTM in bf16).
    "train_lstm_lm.py": Case(steps=20, rtol=0.05),
    # Pre-LN Transformer, softmax and LayerNorm statistics kept FP32 by the pass: measured 0.002%, allowed 3%.
    "train_transformer_lm.py": Case(steps=20, rtol=0.03),
    # The dense MLP is bf16, the huge table FP32; the loss is a noisy BCE near 0.5-0.6: measured 0.006%, allowed 3%.
    "train_recommender.py": Case(steps=30, rtol=0.03),
}
HUGE_TABLE_ELEMS = 200_000 * 32  # train_recommender.py's user table


def _env(inner: str | None = "eager") -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("AUTOMP_INNER", None)
    env["AUTOMP_PATH"] = "compile"  # these tests check the graph pass itself, whatever a trial would choose
    if inner is not None:
        env["AUTOMP_INNER"] = inner
    return env


def _automp_run(script: Path, args: list[str], report: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "automp.cli", "run", "--dtype", "bf16"]
    if report is not None:
        cmd += ["--report", str(report)]
    return cmd + [str(script), *args]


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _final_loss(proc: subprocess.CompletedProcess) -> float:
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])["final_loss"]


@dataclass
class Pair:
    fp32: float
    automp: float
    report: dict


_pairs: dict[str, Pair] = {}


def _pair(script: str, tmp_dir: Path) -> Pair:
    """FP32 and automp runs of one script, once per session (two tests read them)."""
    if script not in _pairs:
        path, steps = EXAMPLES / script, ["--steps", str(CASES[script].steps)]
        report = tmp_dir / f"{script}.report.json"
        fp32 = _start([sys.executable, str(path), *steps], _env())
        low = _start(_automp_run(path, steps, report), _env("eager"))
        ref, got = _final_loss(_finish(fp32)), _final_loss(_finish(low))
        _pairs[script] = Pair(ref, got, json.loads(report.read_text()))
    return _pairs[script]


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("examples")


@pytest.mark.parametrize("script", sorted(CASES))
def test_automp_run_matches_fp32_loss(script, tmp_dir):
    pair = _pair(script, tmp_dir)
    rel = abs(pair.automp - pair.fp32) / abs(pair.fp32)
    assert rel < CASES[script].rtol, f"{script}: automp {pair.automp:.5f} vs FP32 {pair.fp32:.5f} ({rel:.2%})"


def _low_kinds(report: dict) -> set[str]:
    return {g["kind"] for g in report["graphs"] if any(n["dtype"] == "bfloat16" for n in g["nodes"])}


@pytest.mark.parametrize("script", sorted(CASES))
def test_report_has_low_precision_forward_and_backward(script, tmp_dir):
    report = _pair(script, tmp_dir).report
    assert report["dtype"] == "bfloat16"
    assert {"forward", "backward"} <= _low_kinds(report), [(g["name"], g["kind"]) for g in report["graphs"]]


def test_huge_embedding_table_stays_fp32(tmp_dir):
    report = _pair("train_recommender.py", tmp_dir).report
    lookups = [n for g in report["graphs"] if g["kind"] == "forward" for n in g["nodes"]
               if n["op"] == "embedding" and str(HUGE_TABLE_ELEMS) in n["reason"]]
    assert lookups, "no forward embedding node names the 200000x32 table in its reason"
    for n in lookups:
        assert n["dtype"] == "float32" and "table" in n["reason"], n


@pytest.mark.slow
def test_mlp_with_inductor_matches_fp32(tmp_dir):
    """The real thing: Inductor generates the CPU code for the rewritten graphs."""
    path, steps = EXAMPLES / "train_mlp.py", ["--steps", str(CASES["train_mlp.py"].steps)]
    report = tmp_dir / "mlp.inductor.json"
    ref = _pair("train_mlp.py", tmp_dir).fp32
    got = _final_loss(_finish(_start(_automp_run(path, steps, report), _env(None)), timeout=400))
    assert abs(got - ref) / ref < CASES["train_mlp.py"].rtol, (got, ref)
    assert {"forward", "backward"} <= _low_kinds(json.loads(report.read_text()))


# ---- the launcher behaves like `python SCRIPT ARGS` -------------------------------------------------------------

def _run_tiny(tmp_path: Path, source: str, args: list[str] = ()) -> tuple[Path, subprocess.CompletedProcess]:
    script = tmp_path / "tiny_script.py"
    script.write_text(source)
    return script, _finish(_start(_automp_run(script, list(args)), _env("eager")), timeout=120)


def test_script_exception_exits_1_with_its_own_traceback(tmp_path):
    script, proc = _run_tiny(tmp_path, "def fail():\n    raise ValueError('boom from the script')\n\nfail()\n")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ValueError: boom from the script" in proc.stderr
    assert script.name in proc.stderr and 'in fail' in proc.stderr
    assert "launcher.py" not in proc.stderr and "runpy" not in proc.stderr  # automp's frames are not shown


def test_script_sys_exit_code_is_kept(tmp_path):
    _, proc = _run_tiny(tmp_path, "import sys\nsys.exit(3)\n")
    assert proc.returncode == 3, proc.stderr


def test_script_sees_its_own_argv(tmp_path):
    args = ["--steps", "5", "--dtype", "fp16", "--report", "x.json", "two words"]  # automp's flags go to the script
    script, proc = _run_tiny(tmp_path, "import json, sys\nprint(json.dumps([__name__, sys.argv]))\n", args)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == ["__main__", [str(script), *args]]
