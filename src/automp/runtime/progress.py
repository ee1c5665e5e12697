"""One live line on the terminal while a trial runs: which module, which candidate path, which round, how long so far.

A first run spends its first iterations timing candidate paths (automp.runtime.trial), which on a large model takes
a minute or two; without a word the script only seems slow until the summary at exit. So while a trial (or its
re-measurement in steady state) runs, stderr shows one transient line, for example

    automp: LlamaForCausalLM: trial, autocast-compiled, round 2 of 4, 37 s

cleared when the trial decides. It is for a person watching: nothing is shown, created or started when stderr is
not a terminal (a pipe, a log file, a notebook), with `quiet`, or on a torch.distributed rank other than 0.

While the line is up, rich redirects the script's writes to stderr (and to stdout where that is the same kind of
terminal) so that they print above it instead of through it; each such line costs the console's rendering, tens of
microseconds, inside the trial's timed iterations alike for every candidate, and nothing once the trial is over.
"""
from __future__ import annotations

import sys
import time
import weakref
from typing import Any, Callable, TextIO

from automp.config import AutoMPConfig
from automp.runtime.trial import Trial

INTERVAL = 0.25  # seconds: the line changes at most this often, and a tick between changes only reads the clock


class Off:
    """The status where nothing may be shown: every call does nothing."""

    def tick(self, label: str, trial: Trial | None) -> None:
        pass

    def stop(self) -> None:
        pass


class TrialStatus:
    """The line of the trial running now, fed by Session.call at each call of a root: `tick(label, trial)` with the
    trial that root is in (its trial or its re-measurement), None once it has a path. Ticks are throttled before
    anything is formatted, and only a few attributes change: rich's refresh thread draws the line (so the seconds go
    on counting through a long compile), and `stop()` (a decided trial, automp.disable(), exit) ends it and clears
    the line."""

    def __init__(self, console: Any, clock: Callable[[], float] = time.monotonic, interval: float = INTERVAL,
                 redirect_stdout: bool = False) -> None:
        self.console, self.clock, self.interval, self.redirect_stdout = console, clock, interval, redirect_stdout
        self.live: Any = None  # rich.live.Live while the line is up
        self.trial: Trial | None = None  # the trial the line is about
        self.labels: list[str] = []  # its modules seen so far (a GAN's two)
        self.started: weakref.WeakKeyDictionary[Trial, float] = weakref.WeakKeyDictionary()
        self.line = ""  # the line without its seconds, which are counted at each draw
        self.updates = 0  # times the line was formatted
        self._next = 0.0  # ticks before this time change nothing

    def tick(self, label: str, trial: Trial | None) -> None:
        if trial is None or trial.verdict is not None:
            shown = self.trial
            if shown is not None and (trial is shown or shown.verdict is not None or label in self.labels):
                self.stop()  # the trial on show decided, or this module left it (stepped aside)
            return
        now = self.clock()
        if trial is self.trial and now < self._next:
            return
        self._next = now + self.interval
        path, round_ = trial.progress()
        if trial.incumbent is not None and path is trial.incumbent and round_ is None:
            self.stop()  # a re-measurement's first iterations run the verdict in steady state: nothing to wait for
            return
        if trial is not self.trial:
            self.trial, self.labels = trial, []
            self.started.setdefault(trial, now)
        if label not in self.labels:
            self.labels.append(label)
        what = "re-measuring" if trial.incumbent is not None else "trial"
        step = "warm-up" if round_ is None else f"round {round_} of {trial.config.measure}"
        self.line = f"automp: {', '.join(self.labels)}: {what}, {path.value}, {step}"
        self.updates += 1
        if self.live is None:
            self._start()

    def __rich__(self) -> Any:
        from rich.text import Text
        seconds = self.clock() - self.started.get(self.trial, self.clock()) if self.trial is not None else 0.0
        return Text(f"{self.line}, {seconds:.0f} s", no_wrap=True, overflow="ellipsis")

    def _start(self) -> None:
        if not _rank0():  # a process group that came up after the session opened: rank 0's terminal only
            return
        from rich.live import Live
        self.live = Live(self, console=self.console, transient=True, refresh_per_second=1 / self.interval,
                         redirect_stdout=self.redirect_stdout, redirect_stderr=True)
        self.live.start(refresh=True)

    def stop(self) -> None:
        """Clear the line and end its refresh thread (idempotent); the next trial's tick shows it again."""
        if self.live is not None:
            self.live.stop()
        self.live, self.trial, self.labels = None, None, []


def trial_status(config: AutoMPConfig, file: TextIO | None = None, stdout: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> TrialStatus | Off:
    """The status for a run: a TrialStatus writing to `file` (default: stderr) where that is a terminal rich can
    draw on, else Off. rich alone would call a pipe a terminal where FORCE_COLOR is set (CI does), so the file itself
    must say it is a tty."""
    file = sys.stderr if file is None else file
    if config.quiet or config.rank != 0 or not _tty(file) or not _rank0():
        return Off()
    from rich.console import Console
    console = Console(file=file)
    if not console.is_terminal or console.is_dumb_terminal:
        return Off()
    return TrialStatus(console, clock, redirect_stdout=_tty(sys.stdout if stdout is None else stdout))


def _tty(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed file
        return False


def _rank0() -> bool:
    from automp.runtime.ranks import writer
    return writer()
