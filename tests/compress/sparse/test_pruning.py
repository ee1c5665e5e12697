"""prune(): masks installed on the selected layers, zeros that survive training (plain, under automp.enable, with
any optimizer), finalize() leaving a plain model whose state_dict and ONNX export hold the zeros, clear errors."""
import json

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import numpy_helper

import automp
from automp.compress.sparse import (SparsityConfig, apply_masks, finalize, get_masks, is_pruned, prune,
                                    sparsity_report)
from automp.compress.sparse import pruning as P


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=64, d_out=8):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


@pytest.fixture(autouse=True)
def _no_leftover_masks(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    yield
    automp.disable()
    for model in list(P._ACTIVE):
        finalize(model)


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :8] * 2 - x[:, 8:16]).detach()


def _model(seed=0):
    torch.manual_seed(seed)
    return MLP()


def _train(model, opt, steps=10, seed=0):
    x, y = _data(seed=seed)
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def _assert_two_four(w):
    nonzero = (w.detach() != 0).reshape(w.shape[0], -1, 4).sum(-1)
    assert (nonzero == 2).all(), "expected exactly 2 nonzeros in every group of 4 input weights"


def test_two_four_prunes_every_matched_linear_and_reports_it():
    model = _model()
    dense = {n: p.detach().clone() for n, p in model.named_parameters()}
    rep = prune(model, SparsityConfig("2:4", layers="fc*"))
    assert [r.name for r in rep.layers] == ["fc1", "fc2"] and {r.pattern for r in rep.layers} == {"2:4"}
    for name in ("fc1", "fc2"):
        w = getattr(model, name).weight
        _assert_two_four(w)
        kept = w != 0
        assert torch.equal(w[kept], dense[f"{name}.weight"][kept])  # kept weights untouched
        # the kept ones are the largest of their group
        groups = dense[f"{name}.weight"].abs().reshape(w.shape[0], -1, 4)
        k = kept.reshape(groups.shape)
        assert (groups.masked_fill(~k, float("inf")).amin(-1) >= groups.masked_fill(k, -1).amax(-1)).all()
    assert torch.equal(model.head.weight, dense["head.weight"])  # not matched: untouched
    assert rep.sparsity == pytest.approx(0.5) and all(r.sparsity == 0.5 for r in rep.layers)
    d = json.loads(rep.to_json())
    assert d["pattern"] == "2:4" and d["layers"][0]["shape"] == [64, 32] and d["sparsity"] == pytest.approx(0.5)
    assert "fc1" in rep.table()


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_unstructured_amount_per_layer_or_global(scope):
    model = _model()
    rep = prune(model, SparsityConfig("unstructured", 0.7, scope=scope, types=(nn.Linear,)))
    total = sum(r.numel for r in rep.layers)
    assert abs(sum(r.zeros for r in rep.layers) - 0.7 * total) <= 1
    if scope == "layer":
        for r in rep.layers:
            assert abs(r.zeros - 0.7 * r.numel) <= 1
    keep = get_masks(model)
    assert set(keep) == {"fc1", "fc2", "head"}
    assert all(torch.equal(~keep[n], getattr(model, n).weight == 0) for n in keep)


def _optimizers(params):
    return {"sgd-momentum": torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3),
            "adam-weight-decay": torch.optim.Adam(params, lr=1e-2, weight_decay=1e-2),
            "adamw": torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)}


@pytest.mark.parametrize("name", ["sgd-momentum", "adam-weight-decay", "adamw"])
@pytest.mark.parametrize("before", [True, False], ids=["opt-before-prune", "opt-after-prune"])
def test_zeros_survive_optimizer_steps(name, before):
    model = _model()
    opt = _optimizers(list(model.parameters()))[name] if before else None
    if before:
        _train(model, opt, steps=3)  # momentum and moments built up before pruning would revive the weights
    prune(model, SparsityConfig("2:4"))
    zero = {n: ~m for n, m in get_masks(model).items()}
    opt = opt or _optimizers(list(model.parameters()))[name]
    start = {n: getattr(model, n).weight.detach().clone() for n in zero}
    x, y = _data()
    for _ in range(5):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for n, z in zero.items():  # the gradient of a pruned weight is zero before the optimizer sees it
            assert (getattr(model, n).weight.grad[z] == 0).all()
        opt.step()
        for n, z in zero.items():
            assert (getattr(model, n).weight[z] == 0).all(), f"{name}: {n} lost zeros after a step"
    for n, z in zero.items():
        w = getattr(model, n).weight
        assert not torch.equal(w[~z], start[n][~z])  # the kept weights did train
        _assert_two_four(w)


@pytest.mark.parametrize("kw", [dict(path="eager", dtype="bf16"),
                                dict(path="compile", inner="eager", spec="h100", dtype="fp16")],
                         ids=["eager-bf16", "compiled-fp16-loss-scaled"])
def test_zeros_survive_training_under_automp(kw):
    torch._dynamo.reset()
    model = _model(seed=1)
    rep = prune(model, SparsityConfig("unstructured", 0.6))
    zero = {n: ~m for n, m in get_masks(model).items()}
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-2)
    x, y = _data(seed=1)
    with torch.no_grad():
        first = F.mse_loss(model(x), y).item()
    automp.enable(**kw)
    last = _train(model, opt, steps=12, seed=1)
    automp_report = automp.disable()
    assert automp_report["choices"], "automp did not see the model"
    assert last < first  # it trained
    for n, z in zero.items():
        assert (getattr(model, n).weight[z] == 0).all()
        assert abs(int(z.sum()) - 0.6 * z.numel()) <= 1
    assert sparsity_report(model).sparsity == pytest.approx(rep.sparsity)


def test_a_pruned_model_freed_without_finalize_does_not_break_other_optimizers():
    import gc

    model = _model()
    prune(model, SparsityConfig(pattern="2:4"))
    del model
    gc.collect()
    assert not P._ACTIVE
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = []
    later = register_optimizer_step_post_hook(lambda *_: steps.append(1))  # registered after pruning's (loss scaling's)
    try:
        other = _model(1)
        opt = torch.optim.SGD(other.parameters(), lr=0.1)
        before = other.fc1.weight.detach().clone()
        _train(other, opt, steps=2)  # raised "OrderedDict mutated during iteration" in the step's post-hook loop
    finally:
        later.remove()
    assert steps == [1, 1] and not torch.equal(other.fc1.weight, before)
    assert (other.fc1.weight != 0).float().mean() > 0.9  # the other model is not pruned


def test_masks_follow_the_model_and_apply_masks_restores_zeros():
    model = _model()
    prune(model, SparsityConfig("2:4"))
    model.double()  # a conversion keeps the zeros; masks move along lazily
    with torch.no_grad():
        model.fc1.weight.add_(1.0)  # e.g. load_state_dict of a dense checkpoint
    apply_masks(model)
    _assert_two_four(model.fc1.weight)


def test_finalize_leaves_a_plain_model_whose_exports_keep_the_zeros(tmp_path):
    model = _model()
    prune(model, SparsityConfig("unstructured", 0.5, layers=["fc1", "fc2"]), evaluate=lambda m: 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _train(model, opt, steps=3)
    rep = finalize(model, evaluate=lambda m: torch.tensor(0.5))
    assert P._step_hook is None  # the process-wide optimizer hook goes once no model has masks
    assert not is_pruned(model) and rep.accuracy == {"before": 1.0, "after_prune": 1.0, "after_finetune": 0.5}
    assert not model.fc1.weight._backward_hooks  # the gradient hook is gone
    zeros = {n: getattr(model, n).weight.detach().clone() == 0 for n in ("fc1", "fc2")}
    assert all(abs(z.float().mean().item() - 0.5) < 1e-3 for z in zeros.values())
    # after finalize nothing keeps zeros any more: a step moves them (the model really is plain)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.05), steps=1)
    assert (model.fc1.weight[zeros["fc1"]] != 0).any()

    model = _model()
    prune(model, SparsityConfig("2:4", layers=["fc1", "fc2"]))
    finalize(model)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    sd = torch.load(tmp_path / "m.pt")
    assert set(sd) == set(MLP().state_dict())  # loadable into a plain model
    for n in ("fc1", "fc2"):
        _assert_two_four(sd[f"{n}.weight"])

    from automp.deploy.qdq.export import export_float
    x = _data(4)[0]
    exported = export_float(model, (x,), ["x"], ["y"])
    inits = [numpy_helper.to_array(t) for t in exported.graph.initializer]
    for n in ("fc1", "fc2"):
        w = getattr(model, n).weight.detach().numpy()
        found = [a for a in inits if (a.shape == w.shape and np.array_equal(a, w))
                 or (a.shape == w.T.shape and np.array_equal(a, w.T))]
        assert found, f"{n}'s weight is not among the ONNX initializers"
        assert (found[0] == 0).sum() == w.size // 2
    import onnxruntime as ort
    sess = ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])
    got, ref = sess.run(None, {"x": x.numpy()})[0], model(x).detach().numpy()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
    onnx.checker.check_model(exported)


def test_pruning_again_adds_to_the_masks_and_records_accuracy():
    model = _model()
    calls = []

    def evaluate(m):
        calls.append(m.training)
        m.eval()
        return float((m.fc1.weight != 0).float().mean())

    model.train()
    first = prune(model, SparsityConfig("unstructured", 0.3), evaluate=evaluate)
    assert first.accuracy == pytest.approx({"before": 1.0, "after_prune": 0.7}, abs=1e-3)
    assert model.training  # restored after the user's evaluate switched to eval()
    old = ~get_masks(model)["fc1"]
    second = prune(model, SparsityConfig("unstructured", 0.5), evaluate=evaluate)
    assert (~get_masks(model)["fc1"])[old].all()  # the old zeros stay
    assert second.accuracy["before"] == 1.0 and second.accuracy["after_prune"] == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("make, match", [
    (lambda: SparsityConfig("3:8"), "unknown sparsity pattern '3:8'"),
    (lambda: SparsityConfig("unstructured", 1.0), r"amount in \[0, 1\)"),
    (lambda: SparsityConfig("unstructured", -0.1), r"amount in \[0, 1\)"),
    (lambda: SparsityConfig("unstructured", True), r"amount in \[0, 1\)"),
    (lambda: SparsityConfig("unstructured"), r"amount in \[0, 1\)"),
    (lambda: SparsityConfig("2:4", 0.7), "leave amount unset"),
    (lambda: SparsityConfig("2:4", scope="global"), "unstructured"),
    (lambda: SparsityConfig("unstructured", 0.5, scope="row"), "unknown scope"),
])
def test_bad_configs_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()
    with pytest.raises(TypeError, match="types must be"):
        SparsityConfig(types=(int,))
    with pytest.raises(TypeError, match="layers must be"):
        SparsityConfig(layers=[])


def test_errors_name_the_layer_and_the_problem():
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 10), nn.Linear(10, 4))
    with pytest.raises(ValueError, match=r"layer '3' \(Linear 10->4, weight \[4, 10\]\).*divisible by 4, got 10"):
        prune(model, SparsityConfig("2:4"))
    assert not is_pruned(model) and (model[0].weight != 0).all()  # nothing was pruned
    with pytest.raises(ValueError, match=r"no layer matched layers=\('enc\*',\).*3 Linear module\(s\).*'0', '2'"):
        prune(model, SparsityConfig("2:4", layers="enc*"))
    conv = nn.Sequential(nn.Conv2d(4, 8, 3))
    with pytest.raises(ValueError, match="'0' is Conv2d: 2:4 applies to nn.Linear only"):
        prune(conv, SparsityConfig("2:4", types=(nn.Conv2d,)))
    assert prune(conv, SparsityConfig("unstructured", 0.25, types=nn.Conv2d)).layers[0].sparsity == 0.25
    with pytest.raises(ValueError, match="finalize: this model has no sparsity masks"):
        finalize(model)
    with pytest.raises(TypeError, match="SparsityConfig"):
        prune(model, {"pattern": "2:4"})
    with pytest.raises(TypeError, match="must return a number"):
        prune(model, SparsityConfig("2:4", layers="[02]"), evaluate=lambda m: "good")
    prune(model, SparsityConfig("2:4", layers="0"))
    with pytest.raises(ValueError, match="already pruned through another module"):
        prune(model[0], SparsityConfig("2:4"))
