"""`automp llm ...` and `automp protect ...` hand the rest of the command line to the feature CLIs (automp.llm.cli,
automp.protect.cli): their own help, their own errors, their exit codes."""
import json
import os
import subprocess
import sys

import onnx
import pytest
import torch

from automp.cli import main

from tests.deploy.util import convnet


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "net.onnx"
    onnx.save(convnet(), path)
    return path


def test_top_level_help_lists_llm_and_protect(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "weight-only quantized LLMs" in out and "obfuscate (and optionally encrypt) an ONNX model" in out


@pytest.mark.parametrize("argv, usage, only_there", [
    (["llm", "--help"], "usage: automp llm", "Weight-only quantized LLM inference."),
    (["llm", "-h"], "usage: automp llm", "generate text with a saved quantized model"),
    (["llm", "quantize", "--help"], "usage: automp llm quantize", "--group-size"),
    (["protect", "--help"], "usage: automp protect", "--rename-io"),
    (["protect", "-o", "x.onnx", "-h"], "usage: automp protect", "Obfuscation-grade"),
])
def test_help_is_the_feature_clis_own(capsys, argv, usage, only_there):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(usage) and only_there in out


def test_protect_writes_the_protected_model(model_file, tmp_path, capsys):
    out, rep = tmp_path / "out.onnx", tmp_path / "r.json"
    assert main(["protect", str(model_file), "-o", str(out), "--seed", "3", "--report", str(rep)]) == 0
    assert f"automp protect: wrote {out}" in capsys.readouterr().out
    got = onnx.load(out)
    onnx.checker.check_model(got)
    assert [o.name for o in got.graph.output] == [o.name for o in onnx.load(model_file).graph.output]
    assert json.loads(rep.read_text())["output"] == str(out)


def test_protect_missing_input_is_a_one_line_error(tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main(["protect", str(tmp_path / "missing.onnx"), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("automp protect: error:") and "missing.onnx" in err
    assert not out.exists()


def test_protect_usage_errors_exit_2(model_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["protect", str(model_file)])  # no -o
    assert exc.value.code == 2
    assert "automp protect: error: the following arguments are required: -o/--output" in capsys.readouterr().err


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_llm_quantize_then_generate(one_thread, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["llm", "quantize", "--model", "tiny-llama", "--bits", "8", "--group-size", "32", "--device", "cpu",
                 "-o", str(out)]) == 0
    assert "tiny-llama -> " in capsys.readouterr().out
    assert (out / "automp_llm.json").is_file() and (out / "model.safetensors").is_file()
    quant = json.loads((out / "automp_llm.json").read_text())["quant"]
    assert quant["scheme"] == "int8" and quant["group_size"] == 32
    assert main(["llm", "generate", str(out), "--prompt", "hi", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("hi") and "2 tokens in" in captured.err


def test_llm_errors_propagate(tmp_path, capsys):
    # user error inside the command: one line, rc 1, nothing written
    out = tmp_path / "x"
    assert main(["llm", "generate", str(tmp_path / "nothing"), "--prompt", "a", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.startswith("automp llm generate: error:")
    # usage error in the feature CLI's parser: rc 2
    with pytest.raises(SystemExit) as exc:
        main(["llm", "quantize", "--model", "tiny-llama", "--bits", "3", "-o", str(out)])
    assert exc.value.code == 2
    assert "automp llm quantize: error: argument --bits" in capsys.readouterr().err
    assert not out.exists()


def test_feature_clis_are_imported_lazily():
    code = ("import sys, automp.cli; automp.cli.build_parser(); print(sorted(m for m in "
            "('automp.llm.cli', 'automp.protect.cli', 'automp.deploy.cli') if m in sys.modules))")
    src = os.path.join(os.path.dirname(__file__), os.pardir, "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.parametrize("suite", ["deploy_gpu", "sparsity", "distill"])
def test_bench_reaches_every_suite(suite, capsys):
    """Each suite module is reachable as `automp bench SUITE` (its own --help answers, rc 0)."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", suite, "--help"])
    assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out.lower()
