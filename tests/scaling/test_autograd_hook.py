"""The hook gives user code true-unit gradients from an fp16 backward, for every way of asking for them."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tests.scaling.fp16_nets import HalfMLP, grads, rel, twin

from automp.scaling import LossScaleConfig, LossScaler, autograd_hook, current, install, uninstall

TINY = 1e-6  # loss multiplier whose gradients underflow fp16 without scaling


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _ref_grads(model, x, y, mult=TINY):
    ref = twin(model)
    (F.mse_loss(ref(x), y) * mult).backward()
    return grads(ref)


def test_small_gradients_underflow_without_scaling_and_survive_with_it():
    torch.manual_seed(0)
    model, (x, y) = HalfMLP(), _data()
    ref = _ref_grads(model, x, y)
    (F.mse_loss(model(x), y) * TINY).backward()
    lost = max(rel(g, r) for g, r in zip(grads(model), ref))
    assert lost > 0.1  # the premise: fp16 loses these gradients
    model.zero_grad()
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 15)))
    (F.mse_loss(model(x), y) * TINY).backward()
    for g, r in zip(grads(model), ref):
        assert rel(g, r) < 5e-3
    assert current().summary() == {"scale": 2.0 ** 15, "overflow_steps": 0, "steps": 1}


def test_clip_grad_norm_sees_true_gradients():
    torch.manual_seed(1)
    model, (x, y) = HalfMLP(), _data(1)
    ref_norm = torch.cat([g.flatten() for g in _ref_grads(model, x, y, 1.0)]).norm()
    install(LossScaler(LossScaleConfig(init_scale=1024.0)))
    F.mse_loss(model(x), y).backward()
    total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    assert rel(total, ref_norm) < 5e-3


@pytest.mark.parametrize("growth_interval", [1, 1000])
def test_gradient_accumulation_unscales_only_the_new_part(growth_interval):
    """With growth_interval=1 the scale doubles between micro-batches: each part must still be unscaled by the
    scale it was computed with."""
    torch.manual_seed(2)
    model = HalfMLP()
    batches = [_data(s) for s in range(3)]
    ref = twin(model)
    for x, y in batches:
        (F.mse_loss(ref(x), y) * TINY).backward()
    scaler = install(LossScaler(LossScaleConfig(init_scale=2.0 ** 12, growth_interval=growth_interval)))
    for x, y in batches:
        (F.mse_loss(model(x), y) * TINY).backward()
    assert scaler.steps == 3 and (scaler.scale > 2.0 ** 12) == (growth_interval == 1)
    for g, r in zip(grads(model), grads(ref)):
        assert rel(g, r) < 5e-3


def test_retain_graph_second_backward_adds_again():
    torch.manual_seed(3)
    model, (x, y) = HalfMLP(), _data(3)
    ref = _ref_grads(model, x, y)
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 14)))
    loss = F.mse_loss(model(x), y) * TINY
    loss.backward(retain_graph=True)
    torch.autograd.backward(loss)
    for g, r in zip(grads(model), ref):
        assert rel(g, 2 * r) < 5e-3


def test_autograd_grad_returns_unscaled_and_leaves_dot_grad_alone():
    torch.manual_seed(4)
    model, (x, y) = HalfMLP(), _data(4)
    ref = _ref_grads(model, x, y)
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 14)))
    out = torch.autograd.grad(F.mse_loss(model(x), y) * TINY, list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    for g, r in zip(out, ref):
        assert rel(g, r) < 5e-3


def test_backward_with_inputs_and_explicit_gradient():
    torch.manual_seed(5)
    model, (x, _) = HalfMLP(), _data(5)
    ref_model = twin(model)
    out_ref = ref_model(x)
    seed = torch.randn_like(out_ref) * TINY
    out_ref.backward(seed, inputs=[ref_model.l2.weight])
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 14)))
    model(x).backward(seed, inputs=[model.l2.weight])
    assert model.l1.weight.grad is None and model.l2.bias.grad is None
    assert rel(model.l2.weight.grad, ref_model.l2.weight.grad) < 5e-3


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph")
@pytest.mark.parametrize("via", ["grad", "backward"])
def test_double_backward_gradient_penalty_matches_fp32(via):
    """create_graph=True: the unscale is differentiable, so a penalty on the gradients is in true units."""
    torch.manual_seed(6)
    model, (x, y) = HalfMLP(half=False), _data(6)
    ref = twin(model)

    def penalty(m):
        loss = F.mse_loss(m(x), y)
        if via == "grad":
            gs = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        else:
            loss.backward(create_graph=True)
            gs = [p.grad for p in m.parameters()]
            m.zero_grad()
        return sum((g ** 2).sum() for g in gs)

    pen_ref = penalty(ref)
    pen_ref.backward()
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    pen = penalty(model)
    assert rel(pen.detach(), pen_ref.detach()) < 1e-5
    pen.backward()
    for g, r in zip(grads(model), grads(ref)):
        assert rel(g, r) < 1e-5


def test_reentrant_checkpoint_passes_inner_backward_through():
    torch.manual_seed(7)
    model, (x, y) = HalfMLP(), _data(7)
    ref = _ref_grads(model, x, y)
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 14)))
    out = torch.utils.checkpoint.checkpoint(model, x.requires_grad_(), use_reentrant=True)
    (F.mse_loss(out, y) * TINY).backward()
    for g, r in zip(grads(model), ref):
        assert rel(g, r) < 5e-3
    assert current().steps == 1  # the engine's nested backward was not counted or rescaled


def test_sparse_embedding_gradients_are_unscaled():
    torch.manual_seed(8)
    emb = nn.Embedding(20, 8, sparse=True)
    idx = torch.randint(0, 20, (12,))
    ref = nn.Embedding(20, 8, sparse=True)
    ref.load_state_dict(emb.state_dict())
    (ref(idx).sum() * 1e-3).backward()
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    (emb(idx).half().sum() * 1e-3).backward()
    assert emb.weight.grad.is_sparse
    assert rel(emb.weight.grad.to_dense(), ref.weight.grad.to_dense()) < 1e-3


def test_implicit_gradient_of_a_non_scalar_still_raises_torch_error():
    install(LossScaler())
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="scalar"):
        (w * 2).backward()


def test_off_mode_patches_nothing_and_uninstall_restores_torch():
    orig = (torch.autograd.backward, torch.autograd.grad, torch.optim.Optimizer.state_dict)
    install(LossScaler.from_spec("off"))
    assert (torch.autograd.backward, torch.autograd.grad, torch.optim.Optimizer.state_dict) == orig
    install(LossScaler())
    assert torch.autograd.backward is not orig[0] and current().enabled
    uninstall()
    assert (torch.autograd.backward, torch.autograd.grad, torch.optim.Optimizer.state_dict) == orig
    assert current() is None
    with pytest.raises(TypeError, match="LossScaler"):
        autograd_hook.install("dynamic")
