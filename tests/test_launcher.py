"""`automp run` checks where the report goes before the script runs: a report path naming the script, or one that
cannot be written, is refused with a one-line message and the script does not run (so it cannot lose its work)."""
from pathlib import Path

import automp
from automp.launcher import run_script


def _script(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "ran.txt"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return script, marker


def test_report_equal_to_the_script_is_refused_and_the_script_kept(tmp_path, capsys):
    script, marker = _script(tmp_path)
    source = script.read_text()
    assert run_script(str(script), [], report=str(script)) == 2
    assert "is the script itself" in capsys.readouterr().err
    assert script.read_text() == source and not marker.exists() and not automp.is_enabled()


def test_report_in_a_missing_directory_is_refused_before_the_script_runs(tmp_path, capsys):
    script, marker = _script(tmp_path)
    assert run_script(str(script), [], report=str(tmp_path / "no" / "r.json")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not marker.exists() and not automp.is_enabled()


def test_report_that_is_a_directory_is_refused(tmp_path, capsys):
    script, marker = _script(tmp_path)
    assert run_script(str(script), [], report=str(tmp_path)) == 2
    assert "is a directory" in capsys.readouterr().err and not marker.exists()


def test_good_report_path_runs_the_script_and_writes_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    script, marker = _script(tmp_path)
    assert run_script(str(script), [], report=str(tmp_path / "r.json")) == 0
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
