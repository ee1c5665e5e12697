"""The capture backend and enable(): which modules get compiled, what the report holds, how failures fall back."""
import json

import pytest
import torch
import torch.nn as nn

import automp
import automp.runtime.session
from automp.precision import capture
from automp.precision.paint import PrecisionConfig
from automp.runtime.report import Recorder


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
        self.head = nn.Linear(256, 8)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.fixture(autouse=True)
def _clean():
    torch._dynamo.reset()
    yield
    automp.disable()


def test_enable_compiles_root_modules_only_and_writes_report(tmp_path):
    torch.manual_seed(0)
    net, loss_fn = Net(), nn.CrossEntropyLoss()
    x, y = torch.randn(512, 256), torch.randint(0, 8, (512,))
    path = tmp_path / "r.json"
    automp.enable(dtype="bf16", report=str(path), inner="eager", path="compile")
    loss = loss_fn(net(x), y)
    loss.backward()
    assert loss.dtype == torch.float32
    automp.disable()
    rep = json.loads(path.read_text())
    assert set(rep) >= {"device", "dtype", "graphs", "loss_scale"}
    assert rep["dtype"] == "bfloat16"
    names = {g["name"] for g in rep["graphs"]}
    assert names == {"Net.0.forward", "Net.0.backward"}  # no separate graphs for nested or parameterless modules
    for g in rep["graphs"]:
        assert set(g["casts"]) == {"inserted", "eliminated", "remaining"}
        for n in g["nodes"]:
            assert set(n) >= {"name", "op", "dtype", "reason"} and n["reason"]
    fwd = next(g for g in rep["graphs"] if g["kind"] == "forward")
    assert any(n["op"] == "addmm" and n["dtype"] == "bfloat16" for n in fwd["nodes"])
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in net.parameters())


def test_disable_restores_plain_module_calls():
    net = Net()
    automp.enable(dtype="bf16", inner="eager", path="compile")
    automp.disable()
    assert nn.Module.__call__ is automp.runtime.session.ORIG_CALL
    assert not automp.is_enabled()
    x = torch.randn(4, 256)
    assert torch.equal(net(x), net.forward(x))


def test_failure_inside_the_pass_falls_back_to_fp32_and_is_reported(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("simulated pass failure")

    monkeypatch.setattr(capture, "apply_precision", broken)
    torch.manual_seed(0)
    net, x = Net(), torch.randn(64, 256)
    rec = Recorder()
    compiled = torch.compile(net, backend=capture.make_backend(PrecisionConfig(), rec, inner="eager", label="Net"))
    out = compiled(x)
    assert torch.allclose(out, net(x), rtol=1e-5, atol=1e-6)  # FP32 result
    assert rec.fallbacks and "simulated pass failure" in rec.fallbacks[0]["reason"]


def test_bad_dtype_is_refused_with_a_clear_message():
    with pytest.raises(ValueError, match="unsupported dtype 'int3'"):
        automp.enable(dtype="int3")
    assert not automp.is_enabled()


def test_device_spec_override_changes_the_plan_and_bad_names_are_refused():
    torch.manual_seed(0)
    small = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))
    x = torch.randn(512, 512)

    def plan(spec):
        torch._dynamo.reset()
        automp.enable(dtype="bf16", inner="eager", spec=spec, path="compile")
        small(x).sum().backward()
        rep = automp.disable()
        return [n["reason"] for g in rep["graphs"] for n in g["nodes"] if n["op"] == "addmm"], rep["device"]

    cpu, dev_cpu = plan("cpu")
    h100, dev_h100 = plan("h100")
    assert "CPU" in dev_cpu and "H100" in dev_h100
    assert cpu != h100  # the estimated gains (and so possibly the decisions) come from the chosen device's figures
    with pytest.raises(ValueError, match="unknown device spec 'tpu9'"):
        automp.enable(spec="tpu9")


def test_many_modules_each_get_compiled_not_evicted_past_dynamos_recompile_limit():
    # Dynamo counts recompiles per code object; a shared wrapper would silently leave modules 9+ uncompiled (FP32)
    automp.enable(dtype="bf16", inner="eager", spec="h100", path="compile")
    for _ in range(12):
        net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
        net(torch.randn(256, 256)).sum().backward()
    rep = automp.disable()
    forwards = [g for g in rep["graphs"] if g["kind"] == "forward"]
    assert len(forwards) == 12
    assert all(any(n["dtype"] == "bfloat16" for n in g["nodes"]) for g in forwards)


def test_graph_break_is_reported_and_both_sides_still_get_the_pass():
    class Chatty(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

        def forward(self, x):
            h = self.a(x)
            print("between the layers")  # Dynamo cannot trace print: a graph break
            return self.b(h)

    automp.enable(dtype="bf16", inner="eager", spec="h100", path="compile")
    net = Chatty()
    net(torch.randn(256, 256)).sum().backward()
    rep = automp.disable()
    breaks = [fb for fb in rep["fallbacks"] if fb["where"] == "graph break"]
    assert breaks and "print" in breaks[0]["reason"]
    forwards = [g for g in rep["graphs"] if g["kind"] == "forward"]
    assert len(forwards) >= 2 and all(any(n["dtype"] == "bfloat16" for n in g["nodes"]) for g in forwards)
