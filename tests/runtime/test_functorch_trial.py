"""A module called inside a torch.func transform (grad, vmap) leaves its trial's compiled candidates: torch.compile
cannot trace a call made from eager code inside a transform, so a compiled candidate would time the eager path
under a compiled name and could win on it. The report gives the rule; no call runs a compiled path."""
import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad

import automp
from automp.runtime.decisions import FUNCTORCH, Route
from automp.runtime.trial import TrialConfig
from tests.runtime.sessions import inject

pytestmark = pytest.mark.usefixtures("fresh_session", "eager_inductor")


def _train(steps=6):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    params = {k: v.detach() for k, v in net.named_parameters()}
    for _ in range(steps):
        g = grad(lambda p: ((functional_call(net, p, (x,)) - y) ** 2).mean())(params)
        params = {k: v - 0.1 * g[k] for k, v in params.items()}
    return params


def test_calls_inside_torch_func_take_the_compiled_candidates_out_of_the_trial(monkeypatch):
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.EAGER_LOW], "test"),
           trial_config=TrialConfig(warmup={Route.EAGER_LOW: 1, Route.COMPILED_AUTOCAST: 1}))
    automp.enable(dtype="bf16")
    params = _train()
    report = automp.disable()
    (choice,) = report["choices"]
    assert choice["path"] == Route.EAGER_LOW.value and "torch.func transform" in choice["reason"]
    assert Route.COMPILED_AUTOCAST.value not in str(choice["calls"])  # no call ran (or was counted) compiled
    assert [f["rule"] for f in report["fallbacks"]] == [FUNCTORCH]
    assert all(torch.isfinite(p).all() for p in params.values())
