"""automp's own notices to the user (a calibration it doubts, a cache it cannot write) are one line each on stderr,
`automp: ...`, once per message: never a Python warning with its file, line and source line."""
import os
import subprocess
import sys
import textwrap


SCRIPT = textwrap.dedent("""
    import torch
    from automp.precision import calibrate
    from automp.runtime.starts import CalibratedCandidates

    def doubted(device, timer=None):  # a calibration disturbed by a neighbour: used for this run, and said so
        return calibrate.Calibration("cpu: test", torch.__version__, {"float32": {"small": 1.0},
                                     "bfloat16": {"small": 3.0}}, 10.0, 5.0, "now", doubts=("the copy: noisy",))

    calibrate.measure = doubted
    for cache in ("a", "b"):  # two sessions of one process meet the same doubt: said once
        print(CalibratedCandidates(cache)(torch.device("cpu"), torch.bfloat16)[0])
""")


def test_a_doubted_calibration_is_one_line_with_no_source_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "src"),
           "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("Route.FP32") == 2  # both sessions went on, on the doubted figures
    lines = done.stderr.strip().splitlines()
    assert lines == ["automp: the calibration of cpu: test is unreliable (the copy: noisy); it is used for this run "
                     "only and not cached"], done.stderr
    assert ".py:" not in done.stderr and "Warning" not in done.stderr


def test_a_notice_is_written_once(capsys):
    from automp.runtime.report import notice
    notice("automp: a test notice, said once")
    notice("a test notice, said once")  # the prefix is added where missing
    notice("automp: another test notice")
    assert capsys.readouterr().err == "automp: a test notice, said once\nautomp: another test notice\n"
