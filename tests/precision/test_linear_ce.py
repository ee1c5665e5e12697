"""Linear + cross-entropy in blocks (automp.precision.linear_ce): the loss, every gradient and the logits against
`F.cross_entropy(F.linear(...))` in float64, and the pass on the graph Dynamo captures of a transformers Llama: which
sites it rewrites, which it leaves alone, and the model's loss and gradients after the rewrite."""
import copy

import pytest
import torch
import torch.nn.functional as F

from automp.precision import linear_ce
from automp.precision.linear_ce import fuse_linear_cross_entropy, linear_cross_entropy


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(linear_ce, "BLOCK_VALUES", 37 * 5)  # 5 rows a block: several blocks, the last one short


@pytest.mark.parametrize("smoothing,reduction,bias", [(0.0, "mean", False), (0.1, "mean", True), (0.0, "sum", True),
                                                      (0.2, "sum", False)])
def test_loss_gradients_and_logits_match_the_unfused_ops(small_blocks, smoothing, reduction, bias):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 7, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(37, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    target = torch.randint(0, 37, (3, 7), generator=g)
    target[0, :4] = -100  # ignored rows, also at a block's edge
    inputs = [h, w] + ([b] if bias else [])
    ref = F.cross_entropy(F.linear(h, w, b).view(-1, 37), target.view(-1), label_smoothing=smoothing,
                          reduction=reduction)
    ref_grads = torch.autograd.grad(ref * 1.7, inputs)  # a loss scaled after it: the backward scales the gradients
    loss, logits = linear_cross_entropy(h, w, b, target, label_smoothing=smoothing, reduction=reduction,
                                        logits_shape=(3, 7, 37), loss_dtype=torch.float64)
    grads = torch.autograd.grad(loss * 1.7, inputs)
    # the softmax arithmetic runs in FP32 whatever the inputs: tolerances of FP32 rounding
    assert _rel(loss, ref) < 1e-6
    assert all(_rel(a, r) < 1e-6 for a, r in zip(grads, ref_grads))
    assert _rel(logits, F.linear(h, w, b)) < 1e-12 and not logits.requires_grad


def test_every_row_ignored_gives_torchs_nan_mean_and_zero_sum():
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    target = torch.full((4,), -100)
    assert torch.isnan(linear_cross_entropy(h, w, None, target)[0])
    assert torch.isnan(F.cross_entropy(h @ w.t(), target))
    loss, _ = linear_cross_entropy(h, w, None, target, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


def test_unsupported_reduction_is_refused_in_one_line():
    with pytest.raises(ValueError, match="reduction 'none'"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(5, 4), None, torch.zeros(2, dtype=torch.long),
                             reduction="none")


transformers = pytest.importorskip("transformers")


def _llama(tied=True):
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _capture(fn, *args, rewrite=True):
    """fn compiled with a backend that applies the pass and runs the graph as it is; (result, sites)."""
    sites = []

    def backend(gm, example_inputs):
        if rewrite:
            gm, found = fuse_linear_cross_entropy(gm)
            sites.extend(found)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend)(*args), sites


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_llama_loss_and_every_gradient_match_after_the_rewrite(small_blocks, tied, autocast):
    model = _llama(tied)
    ref_model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100

    def step(m):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(input_ids=ids, labels=labels)
            return out.loss, out.logits.detach()  # the logits leave detached, as for a field the script never reads

    (loss, logits), sites = _capture(step, model)
    ref_loss, ref_logits = step(ref_model)
    loss.backward()
    ref_loss.backward()
    assert len(sites) == 1 and sites[0].vocab == 300
    tol = 2e-2 if autocast else 1e-5  # bf16 GEMMs on both sides, rounded at different points
    assert _rel(loss, ref_loss) < tol and _rel(logits.float(), ref_logits.float()) < tol
    assert logits.dtype == ref_logits.dtype
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert _rel(p.grad, q.grad) < tol, name
    assert model.state_dict().keys() == ref_model.state_dict().keys()


def test_logits_that_may_carry_a_gradient_keep_the_stock_graph():
    """The script's own loss may read logits returned attached: the rewrite would leave them without a gradient."""
    model = _llama()
    ids = torch.randint(0, 300, (2, 8))
    (out, _), sites = _capture(lambda m: (m(input_ids=ids, labels=ids).logits, 0), model)
    assert sites == [] and out.requires_grad


def test_cross_entropy_of_something_else_or_with_class_weights_is_left_alone():
    w = torch.randn(9, 4, requires_grad=True)
    x, t = torch.randn(6, 4), torch.randint(0, 9, (6,))
    _, sites = _capture(lambda: F.cross_entropy(torch.tanh(F.linear(x, w)), t))  # not a linear layer's output
    assert sites == []
    _, sites = _capture(lambda: F.cross_entropy(F.linear(x, w), t, weight=torch.ones(9)))
    assert sites == []
    _, sites = _capture(lambda: F.cross_entropy(F.linear(x, w), t, reduction="none"))
    assert sites == []
    _, sites = _capture(lambda: (F.cross_entropy(F.linear(x, w), t), F.linear(x, w)))  # a second, separate layer call
    assert len(sites) == 1
