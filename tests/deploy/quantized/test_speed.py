"""The quantized-vs-float timing check: its verdict and warning from an injected timer (timings never go into tests),
the float twin it builds, where it does not run, and its place in the report."""
from __future__ import annotations

import warnings

import pytest
import torch

from automp.deploy.quantized import TorchQuantConfig, optimize_torch, quantize_module, speed

from .helpers import DEVICE, mlp, randn, rel_err


class FakeTimer:
    """Returns the given ms per timed closure, in call order (quantized first, then float), and runs each once."""

    def __init__(self, *ms: float):
        self.ms, self.calls = list(ms), 0

    def __call__(self, fn):
        fn()
        self.calls += 1
        return self.ms.pop(0)


@pytest.mark.parametrize("q_ms,f_ms,faster,warns", [(2.0, 1.0, "float16", True), (1.0, 2.0, "quantized", False)])
def test_verdict_and_warning(q_ms, f_ms, faster, warns):
    net = mlp(64, 96, 32)
    x = randn(4, 64, seed=1).to(DEVICE)
    quantized, _ = quantize_module(net, "int8-weight", [x], TorchQuantConfig(compile=False, measure=False))
    built = []

    def build(m):
        built.append(m)
        return m

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = speed.check(quantized, net, torch.float16, torch.float32, ((x,), {}), build, FakeTimer(q_ms, f_ms))
    assert result.speedup == pytest.approx(f_ms / q_ms)
    d = result.to_dict()
    assert d["measured"] and d["faster"] == faster and d["quantized_ms"] == q_ms and d["float16_ms"] == f_ms
    assert any("saves memory, not time" in str(w.message) for w in caught) == warns
    # the twin: the same module in fp16 behind the same float32 boundary, the original left untouched
    (twin,) = built
    assert all(p.dtype == torch.float16 for p in twin.parameters())
    assert all(p.dtype == torch.float32 for p in net.parameters())
    with torch.no_grad():
        y = twin(x)
        assert y.dtype == torch.float32 and 0 < rel_err(y, net(x)) < 5e-3


def test_where_it_does_not_run():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "cpu" in speed.skipped_because(cpu, [((), {})], True)
    assert "calibration" in speed.skipped_because(cuda, [], True)
    assert "measure=False" in speed.skipped_because(cuda, [((), {})], False)
    assert speed.skipped_because(cuda, [((), {})], True) is None
    assert speed.SpeedCheck(skipped="x").to_dict() == {"measured": False, "why": "x"}
    assert speed.SpeedCheck(skipped="x").speedup is None


def test_report_carries_the_check(monkeypatch):
    """quantize_module times on the first calibration batch where the check applies, and says why where it does
    not."""
    net = mlp(64, 32)
    calib = [randn(3, 64, seed=s).to(DEVICE) for s in (1, 2)]
    _, rep = optimize_torch(net, "int8-weight", calib, config=TorchQuantConfig(compile=False))
    if DEVICE == "cpu":
        assert rep["speed"]["measured"] is False and "cpu" in rep["speed"]["why"]
    timer = FakeTimer(1.0, 3.0)
    monkeypatch.setattr(speed, "skipped_because", lambda device, calls, enabled: None)
    monkeypatch.setattr(speed, "default_timer", timer)
    _, rep = optimize_torch(net, "int8-weight", calib, config=TorchQuantConfig(compile=False))
    assert timer.calls == 2 and rep["speed"]["speedup"] == pytest.approx(3.0) and rep["speed"]["faster"] == "quantized"
