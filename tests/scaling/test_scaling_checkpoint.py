"""The scaler state rides in the optimizer's state_dict: save -> load -> continue == never interrupted."""
import io

import torch
import torch.nn.functional as F
from tests.scaling.fp16_nets import HalfMLP

from automp.scaling import LossScaleConfig, LossScaler, autograd_hook, install, uninstall

STEPS, SAVE_AT, BAD_STEP = 10, 5, 3


def _batch(step: int):
    g = torch.Generator().manual_seed(7 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    if step == BAD_STEP:
        x[1, 2] = float("nan")
    return x, y


def _config():
    return LossScaleConfig(init_scale=2.0 ** 10, growth_interval=2)  # the scale moves often: state matters


def _train(model, opt, steps):
    losses = []
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _fresh():
    torch.manual_seed(0)
    model = HalfMLP()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def test_resume_from_checkpoint_matches_uninterrupted_run():
    model, opt = _fresh()
    scaler = install(LossScaler(_config()))
    straight = _train(model, opt, range(STEPS))
    straight_summary = scaler.summary()
    assert straight_summary["overflow_steps"] == 1  # the run does exercise a skip and several scale changes

    model, opt = _fresh()
    install(LossScaler(_config()))
    first = _train(model, opt, range(SAVE_AT))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    uninstall()

    model, opt = _fresh()
    resumed = install(LossScaler(LossScaleConfig()))  # defaults: everything must come from the checkpoint
    buf.seek(0)
    ckpt = torch.load(buf)
    assert autograd_hook.STATE_KEY in ckpt["opt"]
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    assert autograd_hook.STATE_KEY in ckpt["opt"]  # the caller's dict is not mutated
    second = _train(model, opt, range(SAVE_AT, STEPS))
    a, b = torch.stack(straight), torch.stack(first + second)
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])  # bitwise
    assert all(torch.isfinite(torch.stack(second)))
    assert resumed.summary() == straight_summary


def test_checkpoint_loads_into_plain_torch_after_uninstall():
    model, opt = _fresh()
    install(LossScaler(_config()))
    _train(model, opt, range(2))
    sd = opt.state_dict()
    uninstall()
    assert autograd_hook.STATE_KEY not in opt.state_dict()
    model2, opt2 = _fresh()
    opt2.load_state_dict(sd)  # torch ignores the extra key
    assert int(opt2.state[model2.l1.weight]["step"]) == 2
