"""A trial's candidate that runs out of device memory leaves the trial: the call runs again on the next candidate,
the script loses no step and trains as on that candidate alone, and the report names the candidate, what it asked
for and the rule. Where no candidate is left, the error reaches the script as it is."""
import pytest
import torch
import torch.nn as nn

import automp
from automp.runtime import compiled_paths
from automp.runtime.decisions import TRIAL_OOM, Route
from automp.runtime.guards.oom import oom_cause, oom_size
from automp.runtime.trial import TrialConfig
from tests.runtime.sessions import inject, train_mlp as _train

pytestmark = pytest.mark.usefixtures("fresh_session")
MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB"


def _oom():
    return torch.OutOfMemoryError(MESSAGE)


def _out_of_memory_when_compiled(monkeypatch, wrapped=False):
    def stock(module, root, **kwargs):
        def call(*args, **kw):
            if wrapped:  # as Dynamo reports an error of Inductor's autotuning or a graph's first run
                raise torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, _oom(), None)
            raise _oom()
        return call
    monkeypatch.setattr(compiled_paths, "stock", stock)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _trial(monkeypatch):
    inject(monkeypatch, candidates=lambda device, low: ([Route.EAGER_LOW, Route.COMPILED_AUTOCAST], "test"),
           trial_config=TrialConfig(warmup={Route.EAGER_LOW: 1, Route.COMPILED_AUTOCAST: 1}))


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_candidate_out_of_memory_leaves_the_trial_and_no_step_is_lost(monkeypatch, wrapped):
    automp.enable(dtype="bf16", path="eager")
    ref = _train(_net())
    automp.disable()
    _trial(monkeypatch)
    _out_of_memory_when_compiled(monkeypatch, wrapped)
    automp.enable(dtype="bf16")
    losses = _train(_net())
    report = automp.disable()
    assert losses == ref  # every step ran, on low precision eager as the forced run did
    assert [c["path"] for c in report["choices"]] == ["low-precision-eager"]
    oom = [f for f in report["fallbacks"] if f.get("rule") == TRIAL_OOM]
    assert len(oom) == 1 and "autocast-compiled ran out of device memory" in oom[0]["reason"]
    assert "2.00 GiB" in oom[0]["reason"] and "ran out of device memory" in report["choices"][0]["reason"]


def test_with_no_candidate_left_the_script_sees_the_error(monkeypatch):
    _trial(monkeypatch)
    _out_of_memory_when_compiled(monkeypatch)

    class Hungry(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 4)

        def forward(self, x):
            raise _oom()

    automp.enable(dtype="bf16")
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
        Hungry()(torch.randn(2, 16))
    report = automp.disable()
    assert [f["reason"].split(" ran")[0] for f in report["fallbacks"] if f.get("rule") == TRIAL_OOM] == [
        "low-precision-eager"]  # the first left the trial; the last one's error is the script's


def test_the_error_is_read_for_its_size_and_found_inside_a_compile_failure():
    assert oom_size(_oom()) == "2.00 GiB" and oom_size(RuntimeError("no size")) is None
    inner = _oom()
    assert oom_cause(torch._dynamo.exc.BackendCompilerFailed(lambda *a: None, inner, None)) is inner
    try:
        try:
            raise inner
        except torch.OutOfMemoryError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as outer:
        assert oom_cause(outer) is inner
    assert oom_cause(RuntimeError("other")) is None


@pytest.mark.usefixtures("eager_inductor")
def test_out_of_memory_beside_the_graphs_early_warmup_drops_the_graphs_not_the_candidate(monkeypatch):
    """With TrialConfig.early_warmup the graphed path warms up first, before its memory check: a candidate that runs out
    of memory beside its pool stays in the trial, and the graphs leave instead (their pool was what came on top)."""
    real, failed = compiled_paths.stock, []

    def stock(module, root, path=Route.COMPILED_AUTOCAST, **kwargs):
        compiled = real(module, root, path=path, **kwargs)
        if path is not Route.COMPILED_AUTOCAST:
            return compiled

        def call(*args, **kw):
            if not failed:
                failed.append(path)
                raise _oom()
            return compiled(*args, **kw)
        return call
    monkeypatch.setattr(compiled_paths, "stock", stock)
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.GRAPHED], "test"),
           trial_config=TrialConfig(early_warmup=1))
    automp.enable(dtype="bf16")
    net = _net()
    losses = _train(net, steps=12)
    root = automp._session.roots[net]
    report = automp.disable()
    assert failed == [Route.COMPILED_AUTOCAST] and all(torch.isfinite(torch.tensor(losses)))
    assert root.graphed is None and root.path is Route.COMPILED_AUTOCAST
    (oom,) = [f for f in report["fallbacks"] if f.get("rule") == TRIAL_OOM]
    assert "beside the CUDA graph pool of autocast-graphed's warm-up" in oom["reason"]
    assert report["choices"][0]["path"] == "autocast-compiled"
