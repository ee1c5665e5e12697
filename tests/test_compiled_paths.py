"""The compiled paths automp builds for a root module (automp.compiled_paths): stock Inductor with autocast entered
around the compiled call as a hand-written loop does, and closures that leave the model collectable."""
import pytest
import torch
import torch.nn as nn

import automp

pytestmark = pytest.mark.usefixtures("fresh_session")


def test_autocast_compiled_path_enters_autocast_outside_the_graph(monkeypatch):
    """As a hand-written `with autocast(): compiled(x)`: entered inside the compiled function instead, the graph holds
    the autocast region and compiled differently on an H100 (BERT-base MLM: GEMMs the loop runs in bf16 ran in FP32)."""
    import torch._inductor.compile_fx as compile_fx
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(compile_fx, "compile_fx", capture)
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), torch.randn(16, 64)
    ref = net(x)
    automp.enable(dtype="bf16", path="autocast-compile")
    out = net(x)
    automp.disable()
    (gm,) = graphs
    assert not [n for n in gm.graph.nodes if "autocast" in str(n.target).lower()]
    assert 1e-5 < (out - ref).norm() / ref.norm() < 1e-2  # the matmuls did run in bf16


def test_a_model_that_ran_a_trial_is_freed_after_disable(monkeypatch):
    """Dynamo keeps compiled functions and backends in process-wide caches: nothing it keeps may hold the model. Before
    the fix the compile closures held the module's _Root, whose parameter list kept the model and its gradients alive
    (H100, zoo LSTM: +0.28 GiB in the next run of the same process)."""
    import gc
    import weakref

    from automp.choose import Path
    from automp.session import Session

    paths = [Path.EAGER_LOW, Path.COMPILED, Path.COMPILED_AUTOCAST, Path.FP32]
    monkeypatch.setattr(Session, "_candidates", lambda self, device, low: (paths, "test: every path"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(net.parameters())
    x = torch.randn(8, 16)
    automp.enable(dtype="bf16", inner="eager", spec="h100")
    ran = set()
    for _ in range(60):
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        root = automp._session.roots[net]
        ran.add(root.path or root.trial.current)
        if automp.settled():
            break
    automp.disable()
    assert set(paths) <= ran  # every path ran, the compiled ones included
    param = weakref.ref(net[0].weight)
    del net, opt, root
    gc.collect()
    assert param() is None
