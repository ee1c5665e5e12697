"""Distiller: the KD loss against a float64 formula, gradients reach only the student (and projections), feature
matching through a projection, export, the errors, and training under automp's fp16 + loss scaling and with QAT."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import automp
import automp.runtime.session
from automp.compress.distill import DistillConfig, Distiller, kd_kl
from automp.quant.qat import QATLinear, convert_qat, prepare_qat
from automp.scaling import autograd_hook


def _rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def _kl_ref(s, t, temp):
    """KL(softmax(t/T) || softmax(s/T)) * T^2 in float64, mean over every position but the class axis."""
    c = s.shape[-1]
    ls = torch.log_softmax(s.double().reshape(-1, c) / temp, -1)
    lt = torch.log_softmax(t.double().reshape(-1, c) / temp, -1)
    return (lt.exp() * (lt - ls)).sum(-1).mean() * temp ** 2


def mlp(widths, seed):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 16, generator=g)
    teacher = mlp([16, 64, 64, 5], seed=1)
    with torch.no_grad():
        y = teacher(x).argmax(-1)
    return x, y, teacher


@pytest.mark.parametrize("shape,temp", [((32, 10), 1.0), ((32, 10), 4.0), ((4, 7, 13), 2.5)])
def test_kd_term_matches_float64_reference(shape, temp):
    g = torch.Generator().manual_seed(0)
    s, t = 3 * torch.randn(shape, generator=g), 3 * torch.randn(shape, generator=g)
    assert _rel(kd_kl(s, t, temp), _kl_ref(s, t, temp)) < 1e-5


def test_kd_term_is_float32_for_half_logits():
    g = torch.Generator().manual_seed(1)
    s, t = (4 * torch.randn(64, 50, generator=g)).half(), (4 * torch.randn(64, 50, generator=g)).bfloat16()
    out = kd_kl(s, t, 3.0)
    assert out.dtype == torch.float32
    assert _rel(out, _kl_ref(s, t, 3.0)) < 1e-5  # the reference from the same (rounded) logits


def test_combined_loss_fixed_and_balanced(data):
    x, y, teacher = data
    for balance in (False, True):
        student = mlp([16, 8, 5], seed=2)
        d = Distiller(student, teacher, DistillConfig(temperature=2.0, alpha=0.3, balance=balance))
        out = d(x)
        ce = F.cross_entropy(out, y)
        kd = _kl_ref(out.detach(), teacher(x).detach(), 2.0)
        loss = d.kd_loss(ce)
        if balance:  # the KD term scaled to the student loss's magnitude: 0.3 * |ce| + 0.7 * ce
            ref = torch.tensor(float(ce.detach()), dtype=torch.float64)
        else:
            ref = 0.3 * kd + 0.7 * float(ce.detach())
        assert _rel(loss.detach(), ref) < 1e-5, balance
        assert set(d.last_losses) == {"logits", "student"}
    d(x)
    assert _rel(d.kd_loss().detach(), _kl_ref(student(x).detach(), teacher(x), 2.0)) < 1e-5  # KD alone


def test_balance_rescales_kd_gradient_by_a_detached_factor(data):
    x, y, teacher = data
    grads = {}
    for balance in (False, True):
        student = mlp([16, 8, 5], seed=2)
        d = Distiller(student, teacher, DistillConfig(temperature=2.0, alpha=1.0, balance=balance))
        out = d(x)
        d.kd_loss(F.cross_entropy(out, y)).backward()
        grads[balance] = student[0].weight.grad.clone()
        kd = _kl_ref(out.detach(), teacher(x), 2.0)
        ce = F.cross_entropy(out.detach(), y)
    factor = float(ce) / float(kd)
    assert _rel(grads[True], factor * grads[False].double()) < 1e-4


def test_only_student_and_projection_train_and_teacher_stays(data):
    x, y, teacher = data
    before = copy.deepcopy(teacher.state_dict())
    student = mlp([16, 8, 5], seed=2)
    d = Distiller(student, teacher, DistillConfig(features=[("0", "2")]))
    trainable = {id(p) for p in d.trainable_parameters()}
    assert trainable == {id(p) for p in list(student.parameters()) + list(d.projections.parameters())}
    assert len(d.projections) == 1 and d.projections["0"].weight.shape == (64, 8)
    assert {id(p) for p in teacher.parameters()} <= {id(p) for p in d.parameters()}  # nn.Module's meaning
    assert not any(p.requires_grad for p in teacher.parameters())
    opt = torch.optim.SGD(d.parameters(), lr=0.1)  # given everything: the frozen teacher still cannot move
    d.train()
    assert not teacher.training
    for _ in range(3):
        loss = d.kd_loss(F.cross_entropy(d(x), y))
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None for p in teacher.parameters())
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.trainable_parameters())
        opt.step()
    after = teacher.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_feature_loss_with_projection_matches_reference(data):
    x, _, teacher = data
    student = mlp([16, 8, 5], seed=2)
    d = Distiller(student, teacher, DistillConfig(features=[("0", "2")], feature_weight=0.5, alpha=1.0))
    out = d(x)
    loss = d.kd_loss()
    proj = d.projections["0"]
    s_feat = student[0](x).double()
    t_feat = teacher[1](teacher[0](x)).double()
    t_feat = teacher[2](t_feat.float()).double()
    feat = F.mse_loss(s_feat @ proj.weight.double().T + proj.bias.double(), t_feat)
    ref = _kl_ref(out.detach(), teacher(x), d.config.temperature) + 0.5 * feat
    assert _rel(loss.detach(), ref.detach()) < 1e-5
    assert _rel(d.last_losses["features"], feat.detach()) < 1e-5
    loss.backward()
    assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0


def test_conv_feature_maps_project_along_channels():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                            nn.Linear(16, 4))
    student = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                            nn.Linear(4, 4))
    d = Distiller(student, teacher, DistillConfig(features=[("0", "0")], feature_dim=1))
    x = torch.randn(8, 3, 6, 6)
    d(x)
    loss = d.kd_loss()
    w, b = d.projections["0"].weight.double(), d.projections["0"].bias.double()
    s = student[0](x).double()
    ref_feat = F.mse_loss(torch.einsum("nchw,oc->nohw", s, w) + b.view(1, -1, 1, 1), teacher[0](x).double())
    assert _rel(d.last_losses["features"], ref_feat.detach()) < 1e-5
    assert torch.isfinite(loss)


def test_export_returns_the_plain_student(data):
    x, _, teacher = data
    student = mlp([16, 8, 5], seed=2)
    d = Distiller(student, teacher, DistillConfig(features=[("0", "2")]))
    out = d(x)
    exported = d.export()
    assert exported is student
    assert torch.equal(exported(x), out)
    assert all(not m._forward_hooks for m in exported.modules())
    teacher_modules = {id(m) for m in teacher.modules()}
    assert not any(id(m) in teacher_modules for m in exported.modules())
    with pytest.raises(RuntimeError, match="exported"):
        d(x)


def test_errors(data):
    x, y, teacher = data
    with pytest.raises(ValueError, match=r"student \(16, 3\), teacher \(16, 5\)"):
        Distiller(mlp([16, 8, 3], seed=2), teacher)(x[:16])
    with pytest.raises(ValueError, match="no layer named 'fc1'.*close names"):
        Distiller(mlp([16, 8, 5], seed=2), teacher, DistillConfig(features=[("fc1", "2")]))
    with pytest.raises(ValueError, match="teacher has no layer named '22'.*close names: 2"):
        Distiller(mlp([16, 8, 5], seed=2), teacher, DistillConfig(features=[("0", "22")]))
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            DistillConfig(temperature=bad)
    with pytest.raises(ValueError, match="alpha"):
        DistillConfig(alpha=1.5)
    d = Distiller(mlp([16, 8, 5], seed=2), teacher)
    with pytest.raises(RuntimeError, match="before forward"):
        d.kd_loss()
    d(x)
    with pytest.raises(ValueError, match="scalar"):
        d.kd_loss(torch.ones(3))
    d.kd_loss(F.cross_entropy(d(x), y))  # the bad call above did not consume the forward
    with pytest.raises(RuntimeError, match="before forward"):
        d.kd_loss()  # each forward's teacher outputs are used once
    with pytest.raises(ValueError, match="share parameters"):
        Distiller(teacher, teacher)
    with pytest.raises(ValueError, match="width of student layer '1'"):
        Distiller(mlp([16, 8, 5], seed=2), teacher, DistillConfig(features=[("1", "2")]))
    d = Distiller(mlp([16, 8, 5], seed=2), teacher, DistillConfig(features=[("1", "3")]),
                  example_inputs=(x[:2],))  # a ReLU's width, read from one probe forward
    assert d.projections["0"].weight.shape == (64, 8)


def _train(d, x, y, steps, lr=1e-2, opt=None):
    opt = opt or torch.optim.Adam(d.trainable_parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = d.kd_loss(F.cross_entropy(d(x), y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("path", ["eager", "compile"])
def test_trains_under_automp_fp16_with_loss_scaling(data, path, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    x, y, teacher = data
    teacher_state = copy.deepcopy(teacher.state_dict())
    d = Distiller(mlp([16, 8, 5], seed=2), teacher, DistillConfig(features=[("0", "2")], temperature=2.0))
    extra = {"inner": "eager", "spec": "h100"} if path == "compile" else {}
    automp.enable(dtype="fp16", loss_scale="dynamic", path=path, **extra)
    try:
        losses = _train(d, x, y, steps=40)
    finally:
        rep = automp.disable()
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
    (choice,) = rep["choices"]  # one root: the Distiller, teacher and student inside its call
    assert choice["module"] == "Distiller" and choice["path"] != "as-written"
    assert rep["loss_scale"]["steps"] == 40
    if path == "compile":
        assert rep["compiles"] == {"Distiller": 1}, "the forward recompiled (captured layers guarded?)"
    assert nn.Module.__call__ is automp.runtime.session.ORIG_CALL and autograd_hook.current() is None
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in teacher_state.items())


def test_qat_student_trains_and_converts(data):
    x, y, teacher = data
    student = prepare_qat(mlp([16, 8, 5], seed=2))
    d = Distiller(student, teacher, DistillConfig(features=[("0", "2")], temperature=2.0))
    # LSQ scales get a small learning rate of their own: Adam normalizes away LSQ's gradient scaling, and at the
    # weights' 1e-2 a weight scale of ~2e-3 turns negative within a few steps (QAT alone does the same)
    scales = [p for n, p in d.named_parameters() if n.endswith("fq.scale")]
    rest = [p for p in d.trainable_parameters() if all(p is not q for q in scales)]
    assert len(scales) == 4 and len(rest) == 6  # student's 2 weights + 2 biases, the projection's weight + bias
    opt = torch.optim.Adam([{"params": rest}, {"params": scales, "lr": 1e-4}], lr=1e-2)
    losses = _train(d, x, y, steps=60, opt=opt)
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses
    layer = student[0]
    assert isinstance(layer, QATLinear) and layer.weight_fq.scale.grad is not None
    exported = convert_qat(d.export())
    with torch.no_grad():
        acc = float((exported(x).argmax(-1) == y).float().mean())
    assert acc > 0.5  # 5 classes: chance is about 0.2


def test_layer_replaced_after_wrapping_is_reported(data):
    x, _, teacher = data
    student = mlp([16, 8, 5], seed=2)
    d = Distiller(student, teacher, DistillConfig(features=[("0", "2")]))
    prepare_qat(student)  # replaces the hooked Linear: its hook never fires
    d(x)
    with pytest.raises(RuntimeError, match="did not run.*prepare the student first"):
        d.kd_loss()
