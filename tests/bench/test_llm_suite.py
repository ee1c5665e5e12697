"""`automp llm bench` is the benchmark suite automp.bench.suites.llm, reached from the command line; automp.llm
itself never imports automp.bench."""
import os
import re
import subprocess
import sys

import pytest

from automp.bench.suites import llm
from automp.cli import main


@pytest.mark.parametrize("argv", [["llm", "bench"], ["bench", "llm"]])
def test_automp_llm_bench_reaches_the_suite(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: automp llm bench") and "--only" in out


def test_every_option_has_help():
    assert [a.dest for a in llm.build_parser()._actions if not (a.help or "").strip()] == []


@pytest.mark.parametrize("missing", ["transformers", "safetensors"])
def test_without_the_llm_extra_the_suite_says_how_to_install_it(monkeypatch, tmp_path, capsys, missing):
    monkeypatch.setitem(sys.modules, missing, None)
    assert llm.main(["--quick", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"needs the {missing} package: pip install automp[llm]" in err
    assert not (tmp_path / "out").exists()


def test_the_llm_package_does_not_import_the_benchmarks():
    src = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "src")
    package = os.path.join(src, "automp", "llm")
    for name in os.listdir(package):
        if name.endswith(".py"):
            with open(os.path.join(package, name)) as f:
                assert not re.search(r"^\s*(from|import) automp\.bench", f.read(), re.M), name
    code = ("import sys, automp.llm, automp.llm.cli, automp.llm.store, automp.llm.generate; "
            "print(sorted(m for m in sys.modules if m.startswith('automp.bench')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
