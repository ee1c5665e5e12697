"""to_semi_structured on a CPU: it says the kernels are unavailable and keeps dense (raises when forced), and with
a fake backend and a fake timer its per-layer choice keeps dense wherever sparse measures slower, names every
layer it cannot convert and why, and records both timings."""
import json

import pytest
import torch
import torch.nn as nn

from automp.compress.sparse import (Backend, SparsityConfig, detect_backend, finalize, prune, to_semi_structured)
from automp.compress.sparse import pruning as P

DT = torch.bfloat16


@pytest.fixture(autouse=True)
def _finalize_leftovers():
    yield
    for model in list(P._ACTIVE):
        finalize(model)


class Net(nn.Module):
    """fast / slow: 2:4 layers the fake timer makes faster / slower sparse; odd: 2:4 but a shape the backend
    refuses; dense: never pruned; unused: not called by forward."""

    def __init__(self):
        super().__init__()
        self.fast, self.slow = nn.Linear(64, 128), nn.Linear(128, 64)
        self.odd, self.dense, self.unused = nn.Linear(64, 40), nn.Linear(40, 32), nn.Linear(32, 32)

    def forward(self, x):
        return self.dense(self.odd(self.slow(self.fast(x).relu())))


def _pruned_net(dtype=DT):
    torch.manual_seed(0)
    net = Net()
    prune(net, SparsityConfig("2:4", layers=["fast", "slow", "odd", "unused"]))
    finalize(net)
    return net.to(dtype).eval()


def _example(dtype=DT):
    return (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)).to(dtype),)


class FakeBackend:
    """Compression that keeps the dense tensor (so F.linear runs on a CPU), recording what it compressed."""

    def __init__(self, corrupt=False):
        self.compressed = []
        self.corrupt = corrupt

    def compress(self, w):
        out = w.clone() * (2 if self.corrupt else 1)
        self.compressed.append(out)
        return out

    def backend(self):
        return Backend("fake", self.compress, {torch.float16: (16, 16), torch.bfloat16: (16, 16)})


def fake_timer(speed):
    """dense takes 1 ms; sparse takes 1/speed[layer] ms."""
    calls = []

    def timer(layer, kind, fn):
        fn()
        calls.append((layer, kind))
        return 1.0 if kind == "dense" else 1.0 / speed[layer]
    timer.calls = calls
    return timer


def test_cpu_says_unavailable_keeps_dense_and_refuses_to_force():
    backend, why = detect_backend(torch.device("cpu"))
    assert backend is None and "CUDA GPU" in why and "cpu" in why
    net = _pruned_net()
    before = {n: p for n, p in net.named_parameters()}
    rep = to_semi_structured(net, _example())
    assert not rep.available and rep.backend is None and rep.converted == []
    assert {c.name: c.reason for c in rep.layers}["fast"] == why
    assert {c.name: c.reason for c in rep.layers}["dense"] == "not 2:4 sparse"
    assert all(p is before[n] for n, p in net.named_parameters())  # untouched
    with pytest.raises(RuntimeError, match="choose=False.*unavailable.*CUDA GPU"):
        to_semi_structured(net, _example(), choose=False)


def test_choice_keeps_dense_where_sparse_is_slower():
    net, x = _pruned_net(), _example()
    ref = net(*x)
    fake = FakeBackend()
    timer = fake_timer({"fast": 1.6, "slow": 0.6})
    rep = to_semi_structured(net, x, timer=timer, backend=fake.backend())
    by = {c.name: c for c in rep.layers}
    assert rep.available and rep.backend == "fake" and rep.converted == ["fast"]
    fast, slow = by["fast"], by["slow"]
    assert (fast.dense_ms, fast.sparse_ms, fast.tokens) == (1.0, pytest.approx(1 / 1.6), 15)
    assert fast.speedup == pytest.approx(1.6) and "1.60x" in fast.reason
    assert slow.decision == "dense" and slow.speedup == pytest.approx(0.6) and "kept dense" in slow.reason
    assert slow.tokens == 15 and slow.dense_ms == 1.0
    assert by["odd"].decision == "dense" and "[40, 64] is not a multiple of (16, 16)" in by["odd"].reason
    assert by["dense"].reason == "not 2:4 sparse" and by["dense"].dense_ms is None
    assert "not called" in by["unused"].reason
    assert net.fast.weight.data_ptr() == fake.compressed[0].data_ptr()  # the compressed weight, frozen
    assert not net.fast.weight.requires_grad
    assert net.slow.weight.data_ptr() != fake.compressed[1].data_ptr()
    assert {layer for layer, _ in timer.calls} == {"fast", "slow"}  # only eligible layers are timed
    out = net(*x)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    json.dumps(rep.as_dict())  # JSON-able, with speedups
    assert rep.as_dict()["layers"][0]["speedup"] == pytest.approx(1.6)
    # min_gain: a small win is not worth a conversion
    net2 = _pruned_net()
    rep2 = to_semi_structured(net2, x, timer=fake_timer({"fast": 1.03, "slow": 1.5}),
                              backend=FakeBackend().backend(), min_gain=1.05)
    assert rep2.converted == ["slow"]


def test_forced_conversion_takes_slow_layers_and_raises_on_ineligible_ones():
    net, x = _pruned_net(), _example()
    with pytest.raises(RuntimeError, match=r"layer 'odd' cannot run sparse: weight \[40, 64\]"):
        to_semi_structured(net, x, choose=False, timer=fake_timer({"fast": 2, "slow": 0.5}),
                           backend=FakeBackend().backend())
    net.odd = nn.Linear(64, 40).to(DT)  # dense again: not a candidate, so no error
    net.unused = nn.Linear(32, 32).to(DT)
    rep = to_semi_structured(net, x, choose=False, timer=fake_timer({"fast": 2, "slow": 0.5}),
                             backend=FakeBackend().backend())
    assert rep.converted == ["fast", "slow"] and "(forced)" in {c.name: c for c in rep.layers}["slow"].reason


def test_wrong_results_fp32_and_training_masks_keep_dense_or_raise():
    net, x = _pruned_net(), _example()
    rep = to_semi_structured(net, x, timer=fake_timer({"fast": 2, "slow": 2}), backend=FakeBackend(True).backend())
    assert rep.converted == [] and "differs from dense" in {c.name: c for c in rep.layers}["fast"].reason
    net32 = _pruned_net(torch.float32)
    rep = to_semi_structured(net32, _example(torch.float32), timer=fake_timer({"fast": 2, "slow": 2}),
                             backend=FakeBackend().backend())
    assert rep.converted == [] and "fp16/bf16 only" in {c.name: c for c in rep.layers}["fast"].reason
    torch.manual_seed(0)
    training = Net()
    prune(training, SparsityConfig("2:4", layers="fast"))
    with pytest.raises(ValueError, match="call finalize"):
        to_semi_structured(training, _example(torch.float32))
    with pytest.raises(TypeError, match="tuple"):
        to_semi_structured(net, x[0])
