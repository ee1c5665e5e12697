"""cuDNN's benchmark mode as a measured choice (automp.runtime.tuning.conv_tuning), with an injected clock: the
iteration's cost depends on the flag in force while it runs, as on a GPU. A CPU stands in for the CUDA device
(conv_tuning.tunable)."""
import pytest
import torch
import torch.nn as nn

from automp.runtime.decisions import AS_WRITTEN, MEASURED, SCRIPTS_SETTING, SHAPES_CHURN
from automp.runtime.tuning import allocator, conv_tuning
from automp.runtime.trial import TrialConfig
from automp.config import AutoMPConfig
from automp.runtime.tuning.conv_tuning import MAX_SHAPES, SETTING, ConvTuning
from automp.runtime.session import Session
from automp.runtime.verdicts import VerdictCache

from .timed_session import train

DEV = torch.device("cuda")  # only its type is read: nothing runs on it


@pytest.fixture
def cudnn_flags(monkeypatch):
    """The flags as torch starts, whatever a test sets; a CPU counts as a device whose convolutions cuDNN runs."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(conv_tuning, "tunable", lambda device: True)


def _conv() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))


def _drive(tuning: ConvTuning, module: nn.Module, cost: dict[bool, float], now: list[float], calls: int,
           shape=(2, 3, 8, 8)) -> list[bool]:
    """`calls` iterations: the tuning sees the call, then the iteration runs (and costs) under the flag it left."""
    flags = []
    for _ in range(calls):
        tuning.call(module, DEV, "key", (torch.randn(shape),), {})
        flags.append(torch.backends.cudnn.benchmark)
        now[0] += cost[torch.backends.cudnn.benchmark]
    return flags


def _tuning(tmp_path, now, reports, cache="cache") -> ConvTuning:
    return ConvTuning(TrialConfig(), lambda: now[0], VerdictCache(tmp_path / cache), reports.append, sync=lambda: None)


@pytest.mark.parametrize("on_ms, kept", [(0.90, True), (0.99, False), (1.10, False)])
def test_the_flag_is_kept_on_only_when_it_leads_by_more_than_the_margin(tmp_path, cudnn_flags, on_ms, kept):
    now, reports = [0.0], []
    tuning, net = _tuning(tmp_path, now, reports), _conv()
    flags = _drive(tuning, net, {True: on_ms, False: 1.0}, now, 80)
    assert set(flags[:10]) == {True, False}  # both values ran while it measured
    assert tuning.done and flags[-1] is kept and torch.backends.cudnn.benchmark is kept
    (entry,) = reports
    assert entry["setting"] == SETTING and entry["value"] is kept and not entry["cached"]
    assert entry["timings_ms"]["cudnn-benchmark"] == pytest.approx(1e3 * on_ms)
    assert entry["timings_ms"]["cudnn-heuristics"] == pytest.approx(1e3)
    assert entry["rule"] == (AS_WRITTEN if on_ms == 0.99 else MEASURED)  # 0.99: a lead within the noise


def test_a_second_run_starts_on_the_cached_outcome(tmp_path, cudnn_flags):
    now, reports = [0.0], []
    _drive(_tuning(tmp_path, now, reports), _conv(), {True: 0.8, False: 1.0}, now, 80)
    torch.backends.cudnn.benchmark = False
    second = _tuning(tmp_path, now, reports)
    flags = _drive(second, _conv(), {True: 0.8, False: 1.0}, now, 3)
    assert flags == [True] * 3 and reports[-1]["cached"] and second.done


def test_the_script_as_written_is_restored(tmp_path, cudnn_flags):
    now, reports = [0.0], []
    tuning = _tuning(tmp_path, now, reports)
    _drive(tuning, _conv(), {True: 0.5, False: 1.0}, now, 80)
    assert torch.backends.cudnn.benchmark
    tuning.restore()
    assert torch.backends.cudnn.benchmark is False
    again = _tuning(tmp_path, now, reports, cache="other")
    _drive(again, _conv(), {True: 1.0, False: 0.5}, now, 80)
    assert again.done and not torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True  # the script's own setting, after automp's decision: it stays
    again.restore()
    assert torch.backends.cudnn.benchmark is True


@pytest.mark.parametrize("flag, why", [("benchmark", "turned it on itself"), ("deterministic", "deterministic")])
def test_a_script_that_chose_its_own_cudnn_settings_is_left_alone(tmp_path, cudnn_flags, flag, why):
    now, reports = [0.0], []
    tuning = _tuning(tmp_path, now, reports)
    setattr(torch.backends.cudnn, flag, True)  # the script's first lines, after `automp run` enabled automp
    flags = _drive(tuning, _conv(), {True: 0.5, False: 1.0}, now, 5)
    assert flags == [flag == "benchmark"] * 5 and tuning.idle and not tuning.pending([(_conv(), DEV)])
    assert reports[0]["rule"] == SCRIPTS_SETTING and reports[0]["value"] is (flag == "benchmark")
    assert why in reports[0]["reason"]  # which of the script's settings, in words
    tuning.restore()
    assert getattr(torch.backends.cudnn, flag) is True


def test_modules_without_convolutions_are_not_tuned(tmp_path, cudnn_flags):
    now, reports = [0.0], []
    tuning, mlp = _tuning(tmp_path, now, reports), nn.Linear(4, 4)
    assert not tuning.pending([(mlp, DEV, True)]) and tuning.pending([(_conv(), DEV, True)])
    for _ in range(5):
        tuning.call(mlp, DEV, "key", (torch.randn(2, 4),), {})
    assert not torch.backends.cudnn.benchmark and not reports and tuning.trial is None


def test_changing_input_shapes_turn_the_flag_back_off(tmp_path, cudnn_flags):
    now, reports = [0.0], []
    tuning, net = _tuning(tmp_path, now, reports), nn.Sequential(nn.Conv2d(3, 4, 3))
    _drive(tuning, net, {True: 0.5, False: 1.0}, now, 80)
    assert torch.backends.cudnn.benchmark
    for size in range(8, 8 + MAX_SHAPES):  # MAX_SHAPES shapes in all (8x8 was the first): still on
        _drive(tuning, net, {True: 0.5, False: 1.0}, now, 2, shape=(2, 3, size, size))
    assert torch.backends.cudnn.benchmark
    _drive(tuning, net, {True: 0.5, False: 1.0}, now, 1, shape=(2, 3, 99, 99))
    assert not torch.backends.cudnn.benchmark and tuning.idle
    assert reports[-1]["rule"] == SHAPES_CHURN and reports[-1]["value"] is False


def tuned(report):
    """The report's settings but the allocator's (on a GPU automp sets it too: automp.runtime.tuning.allocator)."""
    return [s for s in report["settings"] if s["setting"] != allocator.SETTING]


def test_a_session_tunes_after_the_paths_are_chosen_and_settles_after_it(monkeypatch, fresh_session, cudnn_flags):
    """Forced onto the eager path, the module has its path at its first call: the flag's trial runs next, settled()
    waits for it, the report names the outcome, and disable() gives the script its flag back."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    now = [0.0]
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8)
    report, settled = train(AutoMPConfig(dtype="bf16", path="eager", tune_layout=False), _conv(), x, 80, now,
                            lambda s: 0.8 if torch.backends.cudnn.benchmark else 1.0)
    assert settled[0] is False and settled[-1] is True
    (entry,) = tuned(report)
    assert entry["setting"] == SETTING and entry["value"] is True
    assert report["choices"][0]["path"] == "low-precision-eager"
    assert torch.backends.cudnn.benchmark is False  # restored
    session = Session(AutoMPConfig(dtype="bf16", path="eager", tune_layout=False),
                      clock=lambda: now[0])  # a second run: from the cache
    session.install()
    try:
        _conv()(x).sum().backward()  # a new process's model: its lazy layer uninitialized again, as in the key
        assert session.settled() and torch.backends.cudnn.benchmark is True
    finally:
        report = session.uninstall()
    assert tuned(report)[0]["cached"] and torch.backends.cudnn.benchmark is False


def test_the_switch_turns_it_off(monkeypatch, fresh_session, cudnn_flags):
    session = Session(AutoMPConfig(dtype="bf16", path="eager", tune_cudnn=False, tune_layout=False))
    session.install()
    net = _conv()
    try:
        for _ in range(5):
            net(torch.randn(2, 3, 8, 8))
        assert session.settled()
    finally:
        report = session.uninstall()
    assert tuned(report) == []
    with pytest.raises(TypeError, match="tune_cudnn"):
        AutoMPConfig(tune_cudnn="yes")
