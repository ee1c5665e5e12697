"""Which kernel serves a decode batch's rows, driven by a fake clock: no kernel runs and nothing is really timed."""
from types import SimpleNamespace

import pytest
import torch

from automp.kernels import crossover

F16 = torch.float16


class FakeClock:
    """timer(label, fn): calls fn (so a failing kernel fails here as under the real timer) and returns the table's
    milliseconds for label."""

    def __init__(self, **ms: float):
        self.ms = ms
        self.calls: list[str] = []

    def __call__(self, label, fn):
        self.calls.append(label)
        fn()
        return self.ms[label]


@pytest.fixture
def clean(monkeypatch):
    """No decisions before or after, and kernels that only record that they ran."""
    ran: list[str] = []
    for label in crossover.KERNELS:
        monkeypatch.setitem(crossover.KERNELS, label, lambda a, qw, s, _l=label: ran.append(_l) or _result(a, qw))
    crossover.reset()
    yield ran
    crossover.reset()


def _result(a, qw):
    return torch.linspace(1, 2, a.shape[0] * qw.shape[0]).reshape(a.shape[0], qw.shape[0])


def _shape(m, n=24, k=64, bits=4, group=32):
    """Group 32 (the default): only the rows kernel competes with the GEMM; group >= 128 with K a whole number of
    words: the planes kernel too."""
    cols = k if bits == 8 else (k + 1) // 2
    qw = torch.zeros(n, cols, dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.ones(n, 1 if group is None else -(-k // group))
    return torch.zeros(m, k, dtype=F16), qw, scales


def test_candidates_follow_what_each_kernel_takes():
    assert crossover.candidates(*_shape(4)) == ["rows"]
    assert crossover.candidates(*_shape(4, k=256, group=128)) == ["rows", "planes"]
    assert crossover.candidates(*_shape(17, k=256, group=128)) == ["planes"]  # past the rows kernel's 16
    assert crossover.candidates(*_shape(17)) == []
    assert crossover.candidates(*_shape(4, k=260, group=None)) == ["rows"]  # 260 is no whole number of int4 words


@pytest.mark.parametrize("ms,chosen", [({"rows": 1.0, "planes": 2.0, "gemm": 3.0}, "rows"),
                                       ({"rows": 2.0, "planes": 1.0, "gemm": 3.0}, "planes"),
                                       ({"rows": 3.0, "planes": 2.0, "gemm": 1.0}, "gemm")])
def test_fastest_kernel_is_kept_and_each_shape_is_measured_once(monkeypatch, clean, ms, chosen):
    clock = FakeClock(**ms)
    monkeypatch.setattr(crossover, "TIMER", clock)
    shape = _shape(4, k=256, group=128)
    assert crossover.choose(*shape) == chosen
    assert crossover.choose(*shape) == chosen
    assert clock.calls == ["rows", "planes", "gemm"]  # once for the shape
    crossover.choose(*_shape(5, k=256, group=128))  # another M is another shape
    crossover.choose(*_shape(4, k=256, group=128, bits=8))  # and so are other bits
    assert clock.calls == ["rows", "planes", "gemm"] * 3
    decision = crossover.decisions()[("cpu", 24, 256, 4, 128, 4, "float16")]
    assert decision == {"kernel": chosen, "ms": ms, "errors": {}}


def test_a_kernel_that_disagrees_with_the_gemm_is_not_used(monkeypatch, clean):
    """A kernel that compiles but computes something else (a GPU-only miscompile) must lose however fast."""
    monkeypatch.setitem(crossover.KERNELS, "planes", lambda a, qw, s: _result(a, qw) * 1.1)
    monkeypatch.setattr(crossover, "TIMER", FakeClock(rows=2.0, planes=0.1, gemm=3.0))
    assert crossover.choose(*_shape(4, k=256, group=128)) == "rows"
    (decision,) = crossover.decisions().values()
    assert decision["ms"] == {"rows": 2.0, "gemm": 3.0}
    assert "differs from quant_gemm's" in decision["errors"]["planes"]


def test_failing_kernels_leave_the_gemm_and_are_remembered(monkeypatch, clean):
    def broken(a, qw, s):
        raise RuntimeError("no compile")
    monkeypatch.setitem(crossover.KERNELS, "rows", broken)
    monkeypatch.setitem(crossover.KERNELS, "planes", broken)
    clock = FakeClock(rows=0.1, planes=0.1, gemm=9.0)
    monkeypatch.setattr(crossover, "TIMER", clock)
    shape = _shape(3, k=256, group=None)
    assert crossover.choose(*shape) == "gemm"
    assert crossover.choose(*shape) == "gemm"
    assert clock.calls == ["rows", "planes"]  # not retried, and the GEMM needs no timing to be the only choice
    (decision,) = crossover.decisions().values()
    assert decision == {"kernel": "gemm", "ms": {},
                        "errors": {"rows": "RuntimeError: no compile", "planes": "RuntimeError: no compile"}}


def test_outside_the_batch_range_nothing_is_measured(monkeypatch, clean):
    clock = FakeClock(rows=1.0, planes=1.0, gemm=2.0)
    monkeypatch.setattr(crossover, "TIMER", clock)
    assert crossover.choose(*_shape(1, k=256, group=128)) == "gemm"
    assert crossover.choose(*_shape(crossover.MAX_ROWS + 1, k=256, group=128)) == "gemm"
    assert clock.calls == [] and crossover.decisions() == {}


def test_no_timer_on_cpu_means_the_gemm_and_no_decision(clean):
    assert crossover.TIMER is None
    assert crossover.choose(*_shape(4)) == "gemm"
    assert crossover.decisions() == {} and clean == []


def test_compiling_defers_until_eager_and_then_uses_the_decision(monkeypatch, clean):
    clock = FakeClock(rows=1.0, gemm=2.0)
    monkeypatch.setattr(crossover, "TIMER", clock)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert crossover.choose(*_shape(4)) == "gemm"
    assert clock.calls == [] and crossover.decisions() == {}
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert crossover.choose(*_shape(4)) == "rows"
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert crossover.choose(*_shape(4)) == "rows"  # a decision made eagerly serves traced code too
    assert clock.calls == ["rows", "gemm"]


def test_cuda_graph_capture_defers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert crossover._deferred(SimpleNamespace(is_cuda=True))
    assert not crossover._deferred(SimpleNamespace(is_cuda=False))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert not crossover._deferred(SimpleNamespace(is_cuda=True))


def test_decisions_are_copies(monkeypatch, clean):
    monkeypatch.setattr(crossover, "TIMER", FakeClock(rows=1.0, gemm=2.0))
    crossover.choose(*_shape(2))
    for value in crossover.decisions().values():
        value["kernel"] = "gemm"
        value["ms"]["rows"] = 9.0
    assert [(d["kernel"], d["ms"]["rows"]) for d in crossover.decisions().values()] == [("rows", 1.0)]


class _FakeGraph:
    replays = 0

    def replay(self):
        _FakeGraph.replays += 1


def test_graph_clock_captures_calls_and_divides_by_them(monkeypatch):
    """The CUDA clock: WARMUP eager calls (autotuning), then CALLS calls captured once and replayed; the time is per
    captured call. Driven on the CPU with stand-ins for the CUDA graph API."""
    import contextlib
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(crossover, "time_fn", lambda fn, warmup, iters, flush_l2=False: (fn(), 30.0)[1])
    _FakeGraph.replays = 0
    ms = crossover.cuda_graph_timer("planes", lambda: calls.append(1))
    assert len(calls) == crossover.WARMUP + crossover.CALLS  # warm-up, then the captured calls: none while timing
    assert ms == pytest.approx(30.0 / crossover.CALLS)
    assert _FakeGraph.replays == 2  # once after capture, once (here) inside the timer


def test_graph_clock_falls_back_to_eager_timing_where_capture_fails(monkeypatch):
    def no_capture(g):
        raise RuntimeError("operation not permitted when stream is capturing")
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", no_capture)
    monkeypatch.setattr(crossover, "time_fn", lambda fn, warmup, iters, flush_l2=False: (fn(), 7.0)[1])
    assert crossover.cuda_graph_timer("rows", lambda: calls.append(1)) == 7.0  # not divided: eager calls
    assert len(calls) == crossover.WARMUP + 1
