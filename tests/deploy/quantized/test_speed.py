"""The quantized-vs-float timing check: its verdict and warning from an injected timer (timings never go into tests),
the float twin it builds, where it does not run, and its place in the report."""
from __future__ import annotations

import warnings

import pytest
import torch

from automp.deploy.quantized import TorchQuantConfig, optimize_torch, quantize_module, speed

from tests.quant.torch_helpers import DEVICE, mlp, randn, rel_err


class FakeTimer:
    """Runs each timed closure once and returns the ms of the model it ran, told apart by a forward hook on the
    quantized module (`watch`); round r's float sample is scaled by drift[r] (a host that slows down)."""

    def __init__(self, q_ms: float, f_ms: float, drift=None):
        self.q_ms, self.f_ms, self.drift, self.calls, self.seen, self.order = q_ms, f_ms, drift, 0, 0, []

    def watch(self, quantized):
        quantized.register_forward_hook(lambda *_: setattr(self, "seen", self.seen + 1))
        return self

    def __call__(self, fn):
        before = self.seen
        fn()
        self.calls += 1
        side = "q" if self.seen > before else "f"
        self.order.append(side)
        scale = self.drift[(self.calls - 1) // 2] if self.drift else 1.0
        return self.q_ms * scale if side == "q" else self.f_ms * scale


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
        timer = FakeTimer(q_ms, f_ms).watch(quantized)
        result = speed.check(quantized, net, torch.float16, torch.float32, ((x,), {}), build, timer)
    assert result.speedup == pytest.approx(f_ms / q_ms)
    d = result.to_dict()
    assert d["measured"] and d["faster"] == faster and d["quantized_ms"] == q_ms and d["float16_ms"] == f_ms
    assert d["rounds"] == speed.ROUNDS and d["spread"] == pytest.approx([f_ms / q_ms] * 2)
    # the models take turns, each leading as often as it trails
    assert timer.order == ["q", "f", "f", "q"] * (speed.ROUNDS // 2)
    assert any("saves memory, not time" in str(w.message) for w in caught) == warns
    # the twin: the same module in fp16 behind the same float32 boundary, the original left untouched
    (twin,) = built
    assert all(p.dtype == torch.float16 for p in twin.parameters())
    assert all(p.dtype == torch.float32 for p in net.parameters())
    with torch.no_grad():
        y = twin(x)
        assert y.dtype == torch.float32 and 0 < rel_err(y, net(x)) < 5e-3


def test_a_drifting_host_biases_neither_model():
    """Each round's pair is timed back to back: a host slowing down by half between rounds leaves every round's
    ratio, and so the verdict, as it is."""
    net = mlp(64, 32)
    x = randn(4, 64, seed=1).to(DEVICE)
    quantized, _ = quantize_module(net, "int8-weight", [x], TorchQuantConfig(compile=False, measure=False))
    drift = [1.0 + 0.5 * r for r in range(speed.ROUNDS)]
    result = speed.check(quantized, net, torch.float16, torch.float32, ((x,), {}), lambda m: m,
                         FakeTimer(1.0, 1.1, drift).watch(quantized))
    assert result.speedup == pytest.approx(1.1) and min(result.ratios) == pytest.approx(max(result.ratios))


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
        assert list(rep["seconds"]) == ["convert"]  # no check, no check's time
    timer = FakeTimer(1.0, 3.0)
    monkeypatch.setattr(speed, "skipped_because", lambda device, calls, enabled: None)
    monkeypatch.setattr(speed, "default_timer", timer)
    from automp.quant.int8 import Int8Linear
    from automp.quant.weight_only import WeightOnlyLinear
    # the quantized model is built inside: its layers' forward marks its samples
    for cls in (Int8Linear, WeightOnlyLinear):
        monkeypatch.setattr(cls, "__call__", _marking(cls.__call__, timer))
    _, rep = optimize_torch(net, "int8-weight", calib, config=TorchQuantConfig(compile=False))
    assert timer.calls == 2 * speed.ROUNDS and timer.order[:2] == ["q", "f"]
    assert rep["speed"]["speedup"] == pytest.approx(3.0) and rep["speed"]["faster"] == "quantized"
    # the set-up's phases: the conversion, and the check with each model's first call (its compile) apart
    assert set(rep["seconds"]) == {"convert", "speed_check"} and rep["seconds"]["convert"] >= 0
    first = rep["speed"]["first_call_s"]
    assert set(first) == {"quantized", "float16"} and rep["seconds"]["speed_check"] >= sum(first.values()) - 0.02  # each rounded


def _marking(call, timer):
    def marked(self, *args, **kwargs):
        timer.seen += 1
        return call(self, *args, **kwargs)
    return marked
