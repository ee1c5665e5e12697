"""CUDA graphs for small models: copies the script can keep, which models a trial tries them for, the memory given
back when they lose, and (on a GPU) a graphed training loop against the same loop under torch.autocast."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import automp
import automp.session
from automp import cuda_graphs
from automp.choose import Path, TrialConfig
from automp.config import AutoMPConfig
from automp.session import Session

pytestmark = pytest.mark.usefixtures("fresh_session")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_outputs_survive_the_next_replay_and_carry_gradients():
    # a graph replay writes its outputs into the same memory every time: this stand-in does the same
    buffer = torch.empty(5)

    def replay(x):
        buffer.copy_(x.detach() * 2)
        return {"out": buffer + 0 * x, "parts": (buffer[:2], 7)}  # the first field carries x's graph

    call = cuda_graphs.owned_outputs(replay)
    x1 = torch.randn(5, requires_grad=True)
    first = call(x1)
    kept = first["out"].detach().clone()
    call(torch.randn(5))  # overwrites the buffer
    assert torch.equal(first["out"], kept) and torch.equal(first["parts"][0], kept[:2])
    assert first["parts"][1] == 7
    first["out"].sum().backward()
    assert x1.grad is not None and torch.equal(x1.grad, torch.zeros(5))  # 0 * x: the graph is there, not cut


class PoolGrad(torch.autograd.Function):
    """Its backward returns the gradient in one persistent buffer, as a graph replay returns it in its pool."""
    pool = torch.empty(6)

    @staticmethod
    def forward(ctx, w):
        return w * 3

    @staticmethod
    def backward(ctx, g):
        PoolGrad.pool.copy_(g * 3)
        return PoolGrad.pool.view(6)  # a new tensor over the pool's memory, as a replay's output is


def test_gradients_taken_from_the_pool_are_copied_and_accumulate_correctly():
    w = torch.randn(6, requires_grad=True)
    PoolGrad.apply(w).sum().backward()
    assert w.grad.data_ptr() == PoolGrad.pool.data_ptr()  # what autograd does: the pool's tensor becomes .grad
    w.grad = None
    grads = cuda_graphs.StableGrads()
    grads.watch([w])
    PoolGrad.apply(w).sum().backward()
    assert w.grad.data_ptr() != PoolGrad.pool.data_ptr() and torch.equal(w.grad, torch.full((6,), 3.0))
    copy = w.grad.data_ptr()
    PoolGrad.pool.fill_(-1e9)  # the next replay overwrites the pool
    (2 * PoolGrad.apply(w)).sum().backward()  # accumulates into the copy
    assert torch.equal(w.grad, torch.full((6,), 9.0)) and w.grad.data_ptr() == copy
    grads.remove()
    w.grad = None
    PoolGrad.apply(w).sum().backward()
    assert w.grad.data_ptr() == PoolGrad.pool.data_ptr()  # hooks gone


def _cuda_candidates(monkeypatch, **config):
    from automp.precision import calibrate
    monkeypatch.setattr(calibrate, "load_or_measure", lambda device, cache_dir=None: None)
    monkeypatch.setattr(calibrate, "low_precision_gain", lambda cal, dtype: 10.0)
    session = Session(AutoMPConfig(**config))
    limit = session.trial_config.graphs_max_param_bytes
    return lambda nbytes: session._candidates(torch.device("cuda"), torch.bfloat16, nbytes)[0], limit


def test_cuda_graphs_are_tried_for_small_models_only(monkeypatch):
    candidates, limit = _cuda_candidates(monkeypatch)
    assert Path.GRAPHED in candidates(limit) and Path.GRAPHED not in candidates(limit + 1)
    assert Path.COMPILED in candidates(limit + 1)  # a large model still has its compiled paths
    off, _ = _cuda_candidates(monkeypatch, cudagraphs=False)
    assert Path.GRAPHED not in off(1)


def test_cudagraphs_switch_is_checked():
    with pytest.raises(TypeError, match="cudagraphs"):
        AutoMPConfig(cudagraphs="no")


class Clock:
    """Time advances by the cost of the path the module ran on (the trial reads it at the module's next call)."""

    def __init__(self, cost):
        self.cost, self.now = cost, 0.0

    def __call__(self):
        return self.now


def _trial(monkeypatch, graphed_cost, compiled_cost=None):
    """A CPU session whose trial runs FP32 and the graphed path (automp's graph pass run op by op; on a CPU
    Inductor would record no graph anyway), timed by a clock that charges each path its given cost."""
    released = []
    monkeypatch.setattr(cuda_graphs, "release", lambda: released.append(True))
    cost = {Path.FP32: 0.010, Path.GRAPHED: graphed_cost}
    if compiled_cost is not None:
        cost[Path.COMPILED] = compiled_cost
    monkeypatch.setattr(Session, "_candidates", lambda self, device, low, nbytes: (list(cost), "test"))
    clock = Clock(cost)
    session = Session(AutoMPConfig(dtype="bf16", inner="eager", spec="h100"), trial_config=TrialConfig(give_up=10),
                      clock=clock)
    session.install()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    try:
        for _ in range(40):
            out = net(x)
            root = session.roots[net]
            clock.now += clock.cost[root.path or root.trial.current]  # the path this call ran
            F.cross_entropy(out, y).backward()
        root = session.roots[net]
        watched = len(session.grads.handles)
        return root, session.uninstall(), released, watched
    finally:
        if nn.Module.__call__ is not automp.session.ORIG_CALL:
            session.uninstall()


def test_graphs_that_lose_their_trial_give_their_memory_back(monkeypatch):
    root, report, released, watched = _trial(monkeypatch, graphed_cost=0.020, compiled_cost=0.015)
    assert root.path is Path.FP32 and root.compiled is None  # the losing compiled path is dropped too
    assert root.graphed is None and released == [True] and watched == 0  # gradient hooks removed too
    assert report["cuda_graphs"] == {}


def test_graphs_that_win_are_kept_and_reported(monkeypatch):
    root, report, released, watched = _trial(monkeypatch, graphed_cost=0.002)
    assert root.path is Path.GRAPHED and root.graphed is not None and released == [] and watched == 4
    assert report["cuda_graphs"]["modules"] == ["Sequential"]
    (choice,) = report["choices"]
    assert choice["path"] == "automp-compiled-cudagraphs"


def _train(steps, run):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    outs, losses = [], []
    for _ in range(steps):
        out = run(net, x)
        loss = F.cross_entropy(out.float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        outs.append(out)  # kept across iterations: a graph replay must not overwrite them
        losses.append(loss.detach())
    return torch.stack(outs), torch.stack(losses)


@cuda
def test_graphed_training_matches_autocast_and_kept_outputs_stay_valid():
    def hand(net, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return net(x)

    ref_outs, ref_losses = _train(12, hand)
    automp.enable(dtype="bf16", path="compile-cudagraphs")
    outs, losses = _train(12, lambda net, x: net(x))
    report = automp.disable()
    assert report["cuda_graphs"]["modules"] == ["Sequential"] and report["cuda_graphs"]["not_recorded"] == 0
    assert outs.dtype == torch.float32  # the script's dtype, as on every path
    err = ((outs.float() - ref_outs.float()).norm() / ref_outs.float().norm()).item()
    assert err < 3e-2, err  # bf16 GEMMs on both sides, 12 Adam steps apart from rounding order
    assert (losses - ref_losses).abs().max().item() < 2e-2
    assert losses[-1] < losses[0]


@cuda
def test_graphed_gan_pattern_runs_and_trains():
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 16)).cuda()
    d = nn.Sequential(nn.Linear(16, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1)).cuda()
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    real = torch.randn(32, 16, device="cuda") + 2
    automp.enable(dtype="bf16", path="compile-cudagraphs")
    scores = []
    for _ in range(10):
        z = torch.randn(32, 8, device="cuda")
        fake = g(z)
        loss_d = F.softplus(-d(real)).mean() + F.softplus(d(fake.detach())).mean()
        od.zero_grad()
        loss_d.backward()
        od.step()
        loss_g = F.softplus(-d(fake)).mean()
        og.zero_grad()
        loss_g.backward()
        og.step()
        scores.append(loss_d.detach())
    report = automp.disable()
    assert sorted(report["cuda_graphs"]["modules"]) == ["Sequential", "Sequential#2"]
    assert torch.isfinite(torch.stack(scores)).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in g.parameters())
