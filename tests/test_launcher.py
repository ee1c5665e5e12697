"""`automp run` checks where the report goes before the script runs: a report path naming the script, or one that
cannot be written, is refused with a one-line message and the script does not run (so it cannot lose its work)."""
import json
from pathlib import Path

import pytest

import automp
from automp.config import AutoMPConfig
from automp.launcher import run_script
from tests import gloo


def _script(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "ran.txt"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return script, marker


def test_report_equal_to_the_script_is_refused_and_the_script_kept(tmp_path, capsys):
    script, marker = _script(tmp_path)
    source = script.read_text()
    assert run_script(str(script), [], AutoMPConfig(report=str(script))) == 2
    assert "is the script itself" in capsys.readouterr().err
    assert script.read_text() == source and not marker.exists() and not automp.is_enabled()


def test_report_in_a_missing_directory_is_refused_before_the_script_runs(tmp_path, capsys):
    script, marker = _script(tmp_path)
    assert run_script(str(script), [], AutoMPConfig(report=str(tmp_path / "no" / "r.json"))) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not marker.exists() and not automp.is_enabled()


def test_report_that_is_a_directory_is_refused(tmp_path, capsys):
    script, marker = _script(tmp_path)
    assert run_script(str(script), [], AutoMPConfig(report=str(tmp_path))) == 2
    assert "is a directory" in capsys.readouterr().err and not marker.exists()


def test_good_report_path_runs_the_script_and_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    script, marker = _script(tmp_path)
    assert run_script(str(script), [], AutoMPConfig(report=str(tmp_path / "r.json"))) == 0
    assert marker.exists() and (tmp_path / "r.json").exists()


def test_the_switches_reach_the_session(tmp_path, monkeypatch):
    """`automp run --no-tune-cudnn --no-fuse-optimizers --no-cuda-graphs` configures the session the script runs
    under."""
    from automp.cli import main

    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "config.txt"
    script = tmp_path / "train.py"
    script.write_text("import automp\nc = automp._session.config\n"
                      f"open({str(out)!r}, 'w').write(f'{{c.tune_cudnn}} {{c.fuse_optimizers}} {{c.cuda_graphs}}')\n")
    assert main(["run", "--no-tune-cudnn", "--no-fuse-optimizers", "--no-cuda-graphs", str(script)]) == 0
    assert out.read_text() == "False False False"
    assert main(["run", str(script)]) == 0
    assert out.read_text() == "True True True"


# ---- `automp run` as a user meets it: usage errors, what it prints, the report whatever the script does ----------

TRAIN = "import torch, torch.nn as nn\nnet = nn.Linear(8, 4)\nnet(torch.randn(2, 8)).sum().backward()\n"


@pytest.fixture
def automp_run(tmp_path, monkeypatch, capsys):
    """`automp run --dtype bf16 ARGS...` in this process (the eager inner compiler, automp's compiled path, a fresh
    cache): (exit code, stderr lines)."""
    from automp.cli import main

    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AUTOMP_INNER", "eager")
    monkeypatch.setenv("AUTOMP_PATH", "compile")

    def go(*argv: str) -> tuple[int, list[str]]:
        code = main(["run", "--dtype", "bf16", *argv])
        return code, capsys.readouterr().err.strip().splitlines()
    yield go
    automp.disable()


def test_one_line_says_how_each_module_ran(tmp_path, automp_run):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    code, err = automp_run(str(script))
    assert code == 0 and err == ["automp: Linear automp-compiled (bf16)"]


def test_the_line_names_the_scripts_own_autocast_and_comes_when_the_script_fails(tmp_path, automp_run):
    script = tmp_path / "train.py"
    script.write_text("import torch, torch.nn as nn\nnet = nn.Linear(8, 4)\nwith torch.autocast('cpu'):\n"
                      "    net(torch.randn(2, 8))\nraise RuntimeError('late failure')\n")
    code, err = automp_run(str(script))
    assert code == 1 and "RuntimeError: late failure" in err[-2]
    assert err[-1] == "automp: Linear as written (the script's own autocast)"


@pytest.mark.parametrize("own", ["enable(report=OWN)", "enable()", "disable()"])
def test_the_command_lines_report_is_written_whatever_the_script_does_with_automp(tmp_path, automp_run, own):
    report, mine = tmp_path / "cli.json", tmp_path / "own.json"
    script = tmp_path / "train.py"
    script.write_text(f"import automp\nOWN = {str(mine)!r}\n" + TRAIN + f"automp.{own}\n" + TRAIN)
    code, err = automp_run("--report", str(report), str(script))
    assert code == 0, err
    assert json.loads(report.read_text())["choices"][0]["module"] == "Linear"
    assert mine.exists() == ("OWN" in own)
    assert err[-1].startswith("automp: Linear automp-compiled (bf16); report in " + str(report))


@pytest.mark.parametrize("torchrun", ["torchrun", "wrapper"])
def test_torchrun_as_the_script_is_refused_with_the_command_that_works(tmp_path, automp_run, torchrun):
    if torchrun == "wrapper":  # what pip installs as bin/torchrun, under another name
        wrapper = tmp_path / "launch_workers"
        wrapper.write_text("import sys\nfrom torch.distributed.run import main\nsys.exit(main())\n")
        torchrun = str(wrapper)
    code, err = automp_run(torchrun, "--nproc_per_node", "2", "s.py")
    assert code == 2 and len(err) == 1
    assert "`torchrun --nproc_per_node 2 -m automp run s.py`" in err[0] and err[0].startswith("automp run: ")


def test_each_rank_writes_its_own_report(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    for rank in (0, 1):
        config = AutoMPConfig.from_env({"RANK": str(rank), "WORLD_SIZE": "2", "AUTOMP_INNER": "eager"},
                                       dtype="bf16", path="compile", report=str(tmp_path / "r.json"))
        assert run_script(str(script), [], config) == 0
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.rank1.json").exists()


def test_a_syntax_error_shows_the_scripts_file_and_line_not_ours(tmp_path, automp_run):
    script = tmp_path / "broken.py"
    script.write_text("x = 1\ndef f(:\n    pass\n")
    code, err = automp_run(str(script))
    assert code == 1 and err[0].strip() == f'File "{script}", line 2' and err[-1].startswith("SyntaxError:")
    assert not any("launcher" in line or "runpy" in line or "Traceback" in line for line in err)


def test_a_binary_file_is_one_line(tmp_path, automp_run):
    script = tmp_path / "model.bin"
    script.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    code, err = automp_run(str(script))
    assert code == 1 and len(err) == 1 and err[0].startswith("automp run: ") and "not a Python script" in err[0]


def test_a_directory_is_named_as_such(tmp_path, automp_run):
    code, err = automp_run(str(tmp_path))
    assert code == 2 and err == [f"automp run: cannot run {str(tmp_path)!r}: it is a directory, not a script"]


def test_sigterm_still_writes_the_report_and_exits_143(tmp_path, automp_run):
    import signal
    report = tmp_path / "r.json"
    script = tmp_path / "train.py"
    script.write_text(TRAIN + "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nraise SystemExit(5)\n")
    before = signal.getsignal(signal.SIGTERM)
    code, err = automp_run("--report", str(report), str(script))
    assert code == 143 and report.exists() and err[-1].startswith("automp: Linear")
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_summary_line_says_how_many_layers_ran_fp8_and_when_the_run_left_fp8() -> None:
    from automp.config import AutoMPConfig
    from automp.launcher import summary
    report = {"dtype": "bfloat16", "choices": [{"module": "Llama", "path": "fp8-graphed", "reason": "x"}],
              "fp8": {"Llama": {"fp8_layers": 49, "layers_seen": 113}}, "fp8_fallback": None}
    config = AutoMPConfig(dtype="fp8", cache_dir=".")
    assert "Llama fp8-graphed (bf16, 49 of 113 linear layers FP8)" in summary(report, config)
    report["fp8"]["Llama"]["all_gather"] = {"rules": {"fp8-all-gather": 48, "bf16-all-gather-unsupported": 1}}
    assert "(bf16, 49 of 113 linear layers FP8, 48 all-gathered in FP8)" in summary(report, config)
    report["fp8_fallback"] = {"step": 40, "rule": "loss-spike", "loss": 9.0, "median": 3.0}
    assert summary(report, config).endswith("left FP8 for bf16 at backward 40 (loss-spike)")


def test_fp8_on_a_machine_without_it_is_one_line_and_exit_code_2(tmp_path, capsys, monkeypatch) -> None:
    gloo.cpu_host(monkeypatch)  # a machine without FP8, wherever this runs (automp checks the CUDA device if any)
    from automp.config import AutoMPConfig
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    assert run_script(str(script), [], AutoMPConfig(dtype="fp8", cache_dir=str(tmp_path))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("automp run: dtype fp8 is not available") and "8.9" in err[0]
    assert not marker.exists()  # the script did not run in bf16 behind the user's back
    import automp
    assert not automp.is_enabled()


FUNC_GRAD = """import torch, torch.nn as nn
from torch.func import functional_call, grad
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
x, y = torch.randn(4, 8), torch.randn(4, 4)
params = {k: v.detach() for k, v in net.named_parameters()}
for _ in range(3):
    g = grad(lambda p: ((functional_call(net, p, (x,)) - y) ** 2).mean())(params)
    params = {k: v - 0.1 * g[k] for k, v in params.items()}
"""


def test_a_compiled_path_that_ran_no_graph_is_said_so_not_claimed(tmp_path, automp_run):
    """Gradients taken with torch.func.grad: torch.compile cannot trace a call made from eager code inside the
    transform, so the forced automp-compiled path ran every call FP32 as written. The line says so, and why."""
    script = tmp_path / "train.py"
    script.write_text(FUNC_GRAD)
    report = tmp_path / "r.json"
    code, err = automp_run("--report", str(report), str(script))
    assert code == 0, err
    line = err[-1]
    assert "automp-compiled (bf16)" not in line, line
    assert "Sequential automp-compiled forced, but no graph ran through it: the model ran FP32 as written" in line
    assert "torch.func" in line
    (choice,) = json.loads(report.read_text())["choices"]
    assert choice["calls"] == {"chosen": {"fp32-eager": 3}}


def test_the_line_says_a_compiled_path_ran_where_its_graphs_did():
    from automp.launcher import summary
    config = AutoMPConfig(dtype="bf16", cache_dir=".")
    report = {"dtype": "bfloat16", "choices": [{"module": "Net", "path": "automp-compiled", "rule": "forced",
                                                "calls": {"chosen": {"automp-compiled": 5}}}],
              "graphs": [{"name": "Net.0.forward"}], "fallbacks": []}
    assert summary(report, config) == "automp: Net automp-compiled (bf16)"
    report["graphs"] = []  # the calls took the compiled route, but no graph went through the pass (Dynamo skipped)
    assert "Net automp-compiled forced, but no graph ran through it" in summary(report, config)
