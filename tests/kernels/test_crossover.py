"""The rows-kernel / GEMM choice, driven by a fake clock: no kernel runs and nothing is really timed."""
from types import SimpleNamespace

import pytest
import torch

from automp.kernels import crossover

F16 = torch.float16


class FakeClock:
    """timer(label, fn): calls fn (so a failing kernel fails here as under the real timer) and returns the table's
    milliseconds for label."""

    def __init__(self, rows_ms: float, gemm_ms: float):
        self.ms = {"rows": rows_ms, "gemm": gemm_ms}
        self.calls: list[str] = []

    def __call__(self, label, fn):
        self.calls.append(label)
        fn()
        return self.ms[label]


@pytest.fixture
def clean(monkeypatch):
    """No decisions before or after, and kernels that only record that they ran."""
    ran: list[str] = []
    monkeypatch.setitem(crossover.KERNELS, "rows", lambda a, qw, s: ran.append("rows") or _result(a, qw))
    monkeypatch.setitem(crossover.KERNELS, "gemm", lambda a, qw, s: ran.append("gemm") or _result(a, qw))
    crossover.reset()
    yield ran
    crossover.reset()


def _result(a, qw):
    return torch.linspace(1, 2, a.shape[0] * qw.shape[0]).reshape(a.shape[0], qw.shape[0])


def test_a_rows_kernel_that_disagrees_with_the_gemm_is_not_used(monkeypatch, clean):
    """A rows kernel that compiles but computes something else (a GPU-only miscompile) must lose however fast."""
    monkeypatch.setitem(crossover.KERNELS, "rows", lambda a, qw, s: _result(a, qw) * 1.1)
    monkeypatch.setattr(crossover, "TIMER", FakeClock(0.1, 2.0))
    assert crossover.rows_kernel_wins(*_shape(4)) is False
    (decision,) = crossover.decisions().values()
    assert decision["kernel"] == "gemm" and "differs from quant_gemm's" in decision["error"]


def _shape(m, n=24, k=64, bits=4, group=32):
    cols = k if bits == 8 else (k + 1) // 2
    qw = torch.zeros(n, cols, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.ones(n, 1 if group is None else -(-k // group))
    return torch.zeros(m, k, dtype=F16), qw, scales


@pytest.mark.parametrize("rows_ms,gemm_ms,wins", [(1.0, 2.0, True), (3.0, 2.0, False)])
def test_faster_kernel_is_kept_and_each_shape_is_measured_once(monkeypatch, clean, rows_ms, gemm_ms, wins):
    clock = FakeClock(rows_ms, gemm_ms)
    monkeypatch.setattr(crossover, "TIMER", clock)
    assert crossover.rows_kernel_wins(*_shape(4)) is wins
    assert crossover.rows_kernel_wins(*_shape(4)) is wins
    assert clock.calls == ["rows", "gemm"]  # once for the shape
    crossover.rows_kernel_wins(*_shape(5))  # another M is another shape
    crossover.rows_kernel_wins(*_shape(4, bits=8))  # and so are other bits
    assert clock.calls == ["rows", "gemm"] * 3
    decision = crossover.decisions()[("cpu", 24, 64, 4, 32, 4, "float16")]
    assert decision == {"kernel": "rows" if wins else "gemm", "rows_ms": rows_ms, "gemm_ms": gemm_ms, "error": None}


def test_failing_rows_kernel_leaves_the_gemm_and_is_remembered(monkeypatch, clean):
    def broken(a, qw, s):
        raise RuntimeError("no compile")
    monkeypatch.setitem(crossover.KERNELS, "rows", broken)
    clock = FakeClock(0.1, 9.0)
    monkeypatch.setattr(crossover, "TIMER", clock)
    assert crossover.rows_kernel_wins(*_shape(3, group=None)) is False
    assert crossover.rows_kernel_wins(*_shape(3, group=None)) is False
    assert clock.calls == ["rows"]  # not retried, and the GEMM needs no timing to be the only choice
    (decision,) = crossover.decisions().values()
    assert decision["kernel"] == "gemm" and decision["error"] == "RuntimeError: no compile"


def test_outside_two_to_sixteen_rows_nothing_is_measured(monkeypatch, clean):
    clock = FakeClock(1.0, 2.0)
    monkeypatch.setattr(crossover, "TIMER", clock)
    assert not crossover.rows_kernel_wins(*_shape(1))
    assert not crossover.rows_kernel_wins(*_shape(17))
    assert clock.calls == [] and crossover.decisions() == {}


def test_no_timer_on_cpu_means_the_gemm_and_no_decision(clean):
    assert crossover.TIMER is None
    assert not crossover.rows_kernel_wins(*_shape(4))
    assert crossover.decisions() == {} and clean == []


def test_compiling_defers_until_eager_and_then_uses_the_decision(monkeypatch, clean):
    clock = FakeClock(1.0, 2.0)
    monkeypatch.setattr(crossover, "TIMER", clock)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not crossover.rows_kernel_wins(*_shape(4))
    assert clock.calls == [] and crossover.decisions() == {}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert crossover.rows_kernel_wins(*_shape(4))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert crossover.rows_kernel_wins(*_shape(4))  # a decision made eagerly serves traced code too
    assert clock.calls == ["rows", "gemm"]


def test_cuda_graph_capture_defers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert crossover._deferred(SimpleNamespace(is_cuda=True))
    assert not crossover._deferred(SimpleNamespace(is_cuda=False))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not crossover._deferred(SimpleNamespace(is_cuda=True))


def test_decisions_are_copies(monkeypatch, clean):
    monkeypatch.setattr(crossover, "TIMER", FakeClock(1.0, 2.0))
    crossover.rows_kernel_wins(*_shape(2))
    for value in crossover.decisions().values():
        value["kernel"] = "gemm"
    assert [d["kernel"] for d in crossover.decisions().values()] == ["rows"]
