"""The live status line of a trial: shown on a terminal (a pseudo-terminal here) while a trial runs and cleared when it
decides; nothing at all in a pipe, with quiet, or between throttled ticks."""
import io
import os
import select
import subprocess
import sys
import textwrap

import pytest

from automp.config import AutoMPConfig
from automp.runtime.decisions import Route
from automp.runtime.progress import Off, TrialStatus, trial_status
from automp.runtime.trial import Trial, TrialConfig

ERASE_LINE = "\x1b[2K"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _trial(clock):
    return Trial([Route.FP32, Route.EAGER_LOW], TrialConfig(), clock, lambda: None)


def _read(fd) -> str:
    """What the pseudo-terminal's other end has been sent so far."""
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end closed (Linux reports EIO)
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


@pytest.fixture
def terminal(monkeypatch):
    """(file, master fd): a text file on a pseudo-terminal's slave end, as stderr would be in a terminal."""
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    master, slave = os.openpty()
    file = os.fdopen(slave, "w")
    yield file, master
    file.close()
    os.close(master)


def test_a_trial_shows_one_line_on_a_terminal_and_clears_it_when_it_decides(terminal):
    file, master = terminal
    clock = Clock()
    status = trial_status(AutoMPConfig(), file=file, stdout=io.StringIO(), clock=clock)
    assert isinstance(status, TrialStatus)
    trial = _trial(clock)
    try:
        status.tick("Net", trial)
        assert status.live is not None
        shown = _read(master)
        assert "automp: Net: trial, fp32-eager, warm-up, 0 s" in shown
        while trial.verdict is None:  # through the rounds, the clock past the throttle at each call
            clock.now += 1.0
            trial.tick(1)
            status.tick("Net", trial)
            if trial.verdict is None and trial.progress()[1] == 2:
                status.live.refresh()
                assert "round 2 of 4" in _read(master)
    finally:
        status.tick("Net", None)
    assert status.live is None
    cleared = _read(master)
    assert ERASE_LINE in cleared and "automp:" not in cleared.split(ERASE_LINE)[-1]


def test_nothing_is_shown_in_a_pipe_or_quiet_or_on_another_rank(terminal):
    file, _ = terminal
    assert isinstance(trial_status(AutoMPConfig(), file=io.StringIO()), Off)
    assert isinstance(trial_status(AutoMPConfig(quiet=True), file=file), Off)
    assert isinstance(trial_status(AutoMPConfig(rank=1, world_size=2), file=file), Off)
    read, write = os.pipe()
    with os.fdopen(write, "w") as pipe:
        assert isinstance(trial_status(AutoMPConfig(), file=pipe), Off)
    os.close(read)


def test_quiet_writes_nothing_to_a_terminal(terminal):
    file, master = terminal
    clock = Clock()
    status = trial_status(AutoMPConfig(quiet=True), file=file, clock=clock)
    trial = _trial(clock)
    for _ in range(5):
        clock.now += 1.0
        status.tick("Net", trial)
    status.stop()
    assert _read(master) == ""


def test_ticks_inside_the_interval_change_the_line_once():
    from rich.console import Console
    clock = Clock()
    status = TrialStatus(Console(file=io.StringIO(), force_terminal=True, width=100), clock, interval=0.25)
    trial = _trial(clock)
    try:
        for _ in range(100):
            clock.now += 0.001
            status.tick("Net", trial)
        assert status.updates == 1
        clock.now += 0.25
        status.tick("Net", trial)
        assert status.updates == 2
    finally:
        status.stop()


SCRIPT = textwrap.dedent("""
    import sys, time
    import torch, torch.nn as nn
    import automp
    from automp.runtime import session as sessions
    from automp.runtime.decisions import Route
    from automp.runtime.trial import TrialConfig
    sessions.open_session = lambda config, recorder: sessions.Session(
        config, recorder, candidates=lambda device, low: ([Route.FP32, Route.EAGER_LOW], "test"),
        trial_config=TrialConfig(confirm_after=0))
    automp.enable(cache_dir=sys.argv[1])
    net = nn.Linear(8, 8)
    for _ in range(40):
        net(torch.randn(4, 8)).sum().backward()
        time.sleep(0.05)
    assert all(c["path"] != "unsettled" for c in automp.report()["choices"])
    print("DONE", file=sys.stderr, flush=True)
""")


def _script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "NO_COLOR")}
    src = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "src")
    env.update(TERM="xterm", PYTHONPATH=os.path.abspath(src))
    return [sys.executable, str(path), str(tmp_path / "cache")], env


def test_a_script_shows_the_line_under_a_pty_and_not_in_a_pipe(tmp_path):
    command, env = _script(tmp_path)
    master, slave = os.openpty()
    try:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
        os.close(slave)
        out = ""
        while proc.poll() is None:
            out += _read(master)
        out += _read(master)
        assert proc.wait() == 0, out
    finally:
        os.close(master)
    assert "automp: Linear: trial, " in out and "round " in out, out
    after = out.rsplit("automp: Linear:", 1)[1]
    assert ERASE_LINE in after.split("DONE")[0], out  # cleared before the script went on
    assert "automp: Linear:" not in out.split("DONE", 1)[1]
    piped = subprocess.run(command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert "DONE" in piped.stderr and "trial," not in piped.stderr and "\x1b[" not in piped.stderr
