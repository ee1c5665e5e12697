"""Bad command-line values are one-line usage errors (rc 2), never a traceback from inside the command."""
import pytest

import automp.cli.demo
from automp.cli import main


@pytest.mark.parametrize("steps", ["-1", "0", "ten"])
def test_demo_rejects_bad_steps_before_running(monkeypatch, capsys, steps):
    monkeypatch.setattr(automp.cli.demo, "main", lambda **kw: pytest.fail("the demo ran with bad --steps"))
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--steps", steps])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("automp demo: error: argument --steps:") and steps in last


def test_demo_passes_good_steps_on(monkeypatch):
    seen = {}
    monkeypatch.setattr(automp.cli.demo, "main", lambda **kw: seen.update(kw) or 0)
    assert main(["demo", "--steps", "3", "--device", "cpu"]) == 0
    assert seen["steps"] == 3


@pytest.mark.parametrize("argv, env, named", [(["--loss-scale", "banana"], {}, "banana"),
                                              ([], {"AUTOMP_INNER": "bogus"}, "AUTOMP_INNER='bogus'")])
def test_run_rejects_a_bad_setting_before_the_script_runs(tmp_path, monkeypatch, capsys, argv, env, named):
    marker = tmp_path / "ran.txt"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", *argv, str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("automp run: ") and named in err[0] and not marker.exists()
