"""The session's graph rewrites on a transformers causal LM's stock compiled path, a causal mask built in the graph
as is_causal (config.causal_attention, on by default), sibling linear layers as one GEMM (config.fuse_siblings) and
the output layer + cross-entropy in blocks (config.fuse_linear_ce): the same losses and weight updates as without
them, each site in the report and the summary line, and no cross-entropy rewrite where the script reads the
logits."""
import pytest
import torch

import automp
from automp.config import AutoMPConfig
from automp.launcher import summary
from automp.runtime.decisions import Route
from automp.runtime.session import Session
from automp.runtime.trial import TrialConfig
from tests.runtime.sessions import inject

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("fresh_session", "eager_inductor")


def _train(monkeypatch, read_logits: bool = False, steps: int = 8, route: Route = Route.COMPILED_AUTOCAST, **fuse):
    fuse.setdefault("causal_attention", False)  # each test names the rewrites it is about
    # the trial runs it eagerly first (the script's reads are seen there), then on the compiled `route`, which a clock
    # of fixed costs per call makes the faster
    cost, now, run = {Route.EAGER_LOW: 2.0, route: 1.0}, [0.0], Session._run

    def timed_run(self, module, root, path, args, kwargs):
        out = run(self, module, root, path, args, kwargs)
        now[0] += cost.get(path, 0.0)
        return out

    monkeypatch.setattr(Session, "_run", timed_run)
    inject(monkeypatch, candidates=lambda device, low: ([Route.EAGER_LOW, route], "test"), clock=lambda: now[0],
           trial_config=TrialConfig(warmup={Route.EAGER_LOW: 1, route: 1}, measure=2, block=1))
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # updates in proportion to the gradients (Adam's are not)
    start = torch.cat([p.detach().flatten() for p in model.parameters()])
    automp.enable(dtype="bf16", **fuse)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 12), generator=g)
        out = model(input_ids=ids, labels=ids)
        loss = out.loss + (1e-3 * out.logits.float().pow(2).mean() if read_logits else 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return losses, params - start, automp.disable()


def test_the_rewritten_step_trains_as_the_stock_one_and_is_reported(monkeypatch):
    ref_losses, ref_moved, ref_report = _train(monkeypatch)
    losses, moved, report = _train(monkeypatch, fuse_linear_ce=True)
    assert ref_report["rewrites"] == []
    assert [(r["module"], r["rule"], r["vocab"]) for r in report["rewrites"]] == [
        ("LlamaForCausalLM", "fused-linear-ce", 256)]
    # bf16 GEMMs on both sides, the loss's softmax in FP32 on both: eight SGD steps apart by bf16 rounding only
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-2
    assert (moved - ref_moved).norm() / ref_moved.norm() < 3e-2
    line = summary(report, AutoMPConfig())
    assert "1 output layer(s) + cross-entropy in blocks" in line and "autocast-compiled" in line


def test_logits_the_script_reads_keep_the_stock_graph(monkeypatch):
    _, _, report = _train(monkeypatch, read_logits=True, fuse_linear_ce=True)
    assert report["rewrites"] == []


@pytest.mark.parametrize("route", [Route.COMPILED_AUTOCAST, Route.COMPILED])
def test_sibling_layers_join_and_train_as_the_unjoined_step(monkeypatch, route):
    ref_losses, ref_moved, _ = _train(monkeypatch, route=route)
    losses, moved, report = _train(monkeypatch, route=route, fuse_siblings=True)
    assert sorted(r["widths"] for r in report["rewrites"] if r["rule"] == "fused-sibling-linears") == [
        [32, 16, 16], [64, 64]]  # query/key/value and gate/up of the one layer, listed once however often compiled
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-2
    assert (moved - ref_moved).norm() / ref_moved.norm() < 3e-2
    line = summary(report, AutoMPConfig())
    assert "2 sibling linear group(s) as one GEMM" in line and route.value in line


@pytest.mark.parametrize("route", [Route.COMPILED_AUTOCAST, Route.COMPILED])
def test_a_causal_mask_built_in_the_graph_becomes_is_causal_by_default(monkeypatch, route):
    import transformers.masking_utils as masking
    if not hasattr(masking, "_ignore_causal_mask_sdpa"):
        pytest.skip("this transformers release decides the SDPA mask elsewhere")
    # as older transformers releases do while Dynamo traces: the mask is built as a tensor in the graph
    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    ref_losses, ref_moved, ref_report = _train(monkeypatch, route=route)
    losses, moved, report = _train(monkeypatch, route=route, causal_attention=True)
    assert ref_report["rewrites"] == []
    assert [(r["rule"], r["calls"]) for r in report["rewrites"]] == [("causal-attention", 1)]  # the one layer's
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-2
    assert (moved - ref_moved).norm() / ref_moved.norm() < 3e-2
    assert "1 causal mask(s) as is_causal" in summary(report, AutoMPConfig()) and route.value in summary(
        report, AutoMPConfig())
    assert AutoMPConfig().causal_attention
