"""An enabled session with real scripts' habits: their own autocast, half-precision models, their own exceptions,
bad arguments, enable() called twice, chdir, a GAN's call pattern, activation checkpointing, report headers."""
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import automp
import automp.runtime.session
from automp.precision import capture
from automp.runtime.decisions import FORCED, GRAPH_BREAK, HALF_MODEL, NO_ROOTS, SCRIPTS_AUTOCAST
from automp.scaling import autograd_hook

from .sessions import candidates, inject


pytestmark = pytest.mark.usefixtures("fresh_session")


def _compile(**kw):
    automp.enable(inner="eager", path="compile", spec="h100", **kw)


def test_script_with_its_own_autocast_runs_and_automp_steps_aside():
    torch.manual_seed(0)
    net, x = nn.Linear(64, 32), torch.randn(16, 64)
    _compile(dtype="fp16")
    assert autograd_hook.current() is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x)
    out.float().pow(2).mean().backward()  # crashed with "expected m1 and m2 to have the same dtype" before
    assert out.dtype == torch.bfloat16 and net.weight.grad.dtype == torch.float32
    rep = automp.disable()
    (choice,) = rep["choices"]
    assert choice["path"] == "as-written" and choice["rule"] == SCRIPTS_AUTOCAST
    assert autograd_hook.current() is None  # the script's own GradScaler would otherwise scale twice
    assert rep["graphs"] == []


def test_module_under_the_scripts_autocast_is_not_reported_as_an_unfinished_trial(monkeypatch):
    from automp.runtime.decisions import Route
    inject(monkeypatch, candidates=lambda device, low: ([Route.FP32, Route.EAGER_LOW], "test: a trial"))
    net, x = nn.Linear(8, 8), torch.randn(4, 8)
    automp.enable(dtype="bf16")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(x)
    rep = automp.disable()
    (choice,) = rep["choices"]  # stepped aside; its trial (joined at its first call) is not left "unsettled"
    assert choice["path"] == "as-written"


class Fragile(nn.Module):
    """Counts its forwards and raises on a batch the user marked bad (after BatchNorm has seen it)."""

    def __init__(self):
        super().__init__()
        self.bn, self.fc = nn.BatchNorm1d(32), nn.Linear(32, 8)
        self.calls = 0

    def forward(self, x, bad=False):
        self.calls += 1
        h = self.bn(x)
        if bad:
            raise ValueError("bad batch")
        return self.fc(h)


def test_users_exception_propagates_once_and_the_module_stays_compiled():
    torch.manual_seed(0)
    net, x = Fragile(), torch.randn(16, 32)
    _compile(dtype="bf16")
    net(x).sum().backward()
    before = (net.calls, int(net.bn.num_batches_tracked))
    with pytest.raises(ValueError, match="bad batch"):
        net(x, bad=True)
    assert (net.calls, int(net.bn.num_batches_tracked)) == (before[0] + 1, before[1] + 1)  # not run twice
    net(x).sum().backward()
    rep = automp.disable()
    assert [(c["path"], c["rule"]) for c in rep["choices"]] == [("automp-compiled", FORCED)]  # not demoted
    assert not [f for f in rep["fallbacks"] if f["where"] == "Fragile"]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_model_keeps_its_dtypes_and_the_report_says_so(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).half()
    _compile(dtype=dtype)
    out = net(torch.randn(4, 64).half())
    assert out.dtype == torch.float16
    rep = automp.disable()
    (choice,) = rep["choices"]
    assert choice["path"] == "as-written" and choice["rule"] == HALF_MODEL
    assert rep["graphs"] == []  # no pass claimed anything about a model it did not touch


@pytest.mark.parametrize("kw", [{"loss_scale": -5}, {"loss_scale": [1, 2]}, {"loss_scale": float("nan")},
                                {"loss_scale": "big"}, {"inner": "bogus"}, {"path": "warp"}, {"dtype": "int3"},
                                {"dtype": "bf16", "loss_scale": -1.0}])
def test_failed_enable_changes_nothing(kw):
    with pytest.raises((ValueError, TypeError)):
        automp.enable(**kw)
    assert not automp.is_enabled()
    assert nn.Module.__call__ is automp.runtime.session.ORIG_CALL and autograd_hook.current() is None
    automp.enable(dtype="bf16", inner="eager")  # and automp still works afterwards
    assert automp.is_enabled()
    assert automp.disable() is not None


def test_enable_inside_an_enabled_session_keeps_the_report(tmp_path):
    path = tmp_path / "launcher.json"
    automp.enable(dtype="bf16", report=str(path), inner="eager", path="compile", spec="h100")
    net = nn.Linear(128, 128)
    automp.enable(dtype="bf16", inner="eager", path="compile", spec="h100")  # the script's own call
    net(torch.randn(256, 128)).sum().backward()
    automp.disable()
    rep = json.loads(path.read_text())
    assert rep["choices"] and rep["graphs"]


def test_relative_report_path_does_not_follow_the_scripts_chdir(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    automp.enable(dtype="bf16", report="r.json", inner="eager")
    os.chdir(tmp_path / "b")
    automp.disable()
    assert (tmp_path / "a" / "r.json").exists() and not (tmp_path / "b" / "r.json").exists()


def test_dynamo_restart_signal_is_not_a_failure(monkeypatch):
    def restarting_inner(gm, example_inputs):
        raise torch._dynamo.exc.RestartAnalysis()  # Dynamo's "trace again", raised from inside a backend

    monkeypatch.setattr(capture, "_eager_aot", lambda precision_pass: restarting_inner)
    rec = automp.runtime.report.Recorder()
    backend = capture.make_backend(capture.PrecisionConfig(), rec, inner="eager")
    with pytest.raises(torch._dynamo.exc.RestartAnalysis):
        backend(torch.fx.symbolic_trace(nn.Linear(2, 2)), [torch.randn(1, 2)])
    assert rec.fallbacks == []  # was: reported as an FP32 fallback with a blank reason


def test_gan_pattern_compiles_a_bounded_number_of_graphs():
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh())
    d = nn.Sequential(nn.Linear(32, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
    _compile(dtype="bf16")
    for step in range(12):
        fake = g(torch.randn(8, 16))
        ld = (F.binary_cross_entropy_with_logits(d(torch.randn(8, 32)), ones)
              + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros))
        od.zero_grad()
        ld.backward()
        od.step()
        lg = F.binary_cross_entropy_with_logits(d(fake), ones)
        og.zero_grad()
        lg.backward()
        og.step()
        if step % 3 == 2:  # a periodic evaluation: train/eval flips
            g.eval(), d.eval()
            with torch.no_grad():
                d(g(torch.randn(8, 16)))
            g.train(), d.train()
    rep = automp.disable()
    # generator: train + eval; discriminator: input without grad, input with grad, eval — and no more
    assert sorted(rep["compiles"].values()) == [2, 3], rep["compiles"]


def test_cpu_default_path_never_compiles_and_keeps_fp32_numerics_when_fp32_wins():
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 32)
    automp.enable(dtype="bf16")
    for _ in range(30):
        net(x).sum().backward()
        if automp.settled():
            break
    rep = automp.report()
    automp.disable()
    assert automp.settled() and rep["graphs"] == [] and rep["compiles"] == {}
    (choice,) = rep["choices"]
    assert choice["path"] in ("fp32-eager", "low-precision-eager") and choice["reason"]


def test_autocast_compiled_path_keeps_fp32_outputs_and_close_numerics():
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), torch.randn(16, 64)
    ref = net(x)
    automp.enable(dtype="bf16", path="autocast-compile")
    out = net(x)
    out.sum().backward()
    rep = automp.disable()
    assert out.dtype == torch.float32 and net[0].weight.grad.dtype == torch.float32
    assert (out - ref).norm() / ref.norm() < 1e-2  # bf16 inputs to the matmuls
    assert [c["path"] for c in rep["choices"]] == ["autocast-compiled"] and rep["compiles"] == {"Sequential": 1}



class _Breaks(nn.Module):
    """A forward with a graph break in the middle that records whether it ran under autocast."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.seen = nn.Linear(16, 16), nn.Linear(16, 4), []

    def forward(self, x):
        h = self.a(x)
        self._eager(h)
        return self.b(h)

    @torch._dynamo.disable
    def _eager(self, h):
        self.seen.append(torch.is_autocast_enabled("cpu"))


@pytest.mark.parametrize("path,how,under_autocast", [("autocast-compile", "under torch.autocast", True),
                                                     ("compile", "in FP32", False)])
@pytest.mark.usefixtures("eager_inductor")
def test_graph_break_report_says_how_the_eager_part_ran(monkeypatch, path, how, under_autocast):
    net = _Breaks()
    automp.enable(dtype="bf16", path=path, inner="eager")
    net(torch.randn(8, 16)).sum().backward()
    rep = automp.disable()
    assert net.seen == [under_autocast]
    (fallback,) = [f for f in rep["fallbacks"] if f.get("rule") == GRAPH_BREAK]
    assert f"runs eagerly {how} between compiled graphs" in fallback["reason"]


def test_loss_scaling_is_taken_off_when_every_module_runs_fp32():
    net = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    automp.enable(dtype="fp16", path="fp32")
    assert autograd_hook.current() is not None  # fp16 asked for: scaling installed until a module's path is known
    net(torch.randn(4, 16)).sum().backward()
    assert autograd_hook.current() is None  # FP32 gradients: nothing to scale, no extra kernels per backward
    rep = automp.disable()
    assert any(f["where"] == "loss scaling" for f in rep["fallbacks"])
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_loss_scaling_stays_on_for_a_low_precision_path():
    """The first module decided (fp16, compiled) must not switch scaling off: its backward runs scaled, by the
    initial dynamic scale, and hands the script unscaled gradients."""
    import copy
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 16)
    ref = copy.deepcopy(net)
    ref(x).mean().backward()  # gradients of ~0.1: scaled by 2**16, they stay within fp16's range
    _compile(dtype="fp16")
    seen = []
    net[2].weight.register_hook(lambda g: seen.append(g.detach().clone()))  # inside the backward: scaled units
    net(x).mean().backward()
    scaler = autograd_hook.current()
    assert scaler is not None and scaler.enabled and scaler.steps == 1  # this backward went through the scaler
    (inside,) = seen
    assert torch.allclose(inside, 2.0 ** 16 * ref[2].weight.grad, rtol=1e-2)
    assert torch.allclose(net[2].weight.grad, ref[2].weight.grad, rtol=1e-2, atol=1e-3)  # unscaled afterwards
    assert automp.disable()["loss_scale"]["steps"] == 1


def test_session_switches_default_adam_to_fused_reports_it_and_disable_removes_the_hook(monkeypatch):
    """The switch runs through enable(): reported once per optimizer, off with fuse_optimizers=False, and gone after
    disable(). No CUDA here, so why_not's CUDA clause is lifted (torch runs fused Adam on a CPU too)."""
    import automp.runtime.tuning.fused_optimizers as fo
    real = fo.why_not
    monkeypatch.setattr(fo, "why_not", lambda o, g, s=False: None if "CUDA" in (real(o, g, s) or "") else real(o, g, s))

    def train(opt_kw=None, **enable_kw):
        torch.manual_seed(0)
        net = nn.Linear(8, 4)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3, **(opt_kw or {}))
        automp.enable(path="fp32", **enable_kw)
        for _ in range(2):
            opt.zero_grad()
            net(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
        return opt, automp.disable()

    opt, rep = train()
    assert opt.param_groups[0]["fused"] is True
    assert [(o["optimizer"], o["groups"]) for o in rep["optimizers"]] == [("AdamW", 1)]
    opt, rep = train(fuse_optimizers=False)
    assert opt.param_groups[0]["fused"] is None and rep["optimizers"] == []
    opt, rep = train({"foreach": True})  # the script chose: left alone, nothing reported
    assert opt.param_groups[0]["fused"] is None and rep["optimizers"] == []
    later = torch.optim.AdamW(nn.Linear(8, 4).parameters())  # after disable(): the global hook is gone
    later.param_groups[0]["params"][0].grad = torch.randn(4, 8)
    later.step()
    assert later.param_groups[0]["fused"] is None


def test_compiled_paths_that_lose_the_trial_are_dropped(monkeypatch):
    """A trial compiles every candidate; the losers' graphs (and the device memory they hold) must not stay alive
    for the rest of the run beside the winner's."""
    from automp.runtime.decisions import Route
    from automp.runtime.trial import TrialConfig
    from automp.config import AutoMPConfig
    from automp.runtime.session import Session

    cost = {Route.FP32: 0.010, Route.COMPILED: 0.020, Route.COMPILED_AUTOCAST: 0.030}
    now = [0.0]
    session = Session(AutoMPConfig(dtype="bf16", inner="eager", spec="h100"),
                      trial_config=TrialConfig(give_up=10, give_up_first=10), clock=lambda: now[0],
                      candidates=candidates(cost))
    session.install()
    try:
        net, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16)
        seen = set()
        for _ in range(40):
            out = net(x)
            root = session.roots[net]
            path = root.path or root.trial.current  # the path this call ran on
            seen.add((root.compiled is not None, root.stock is not None))
            now[0] += cost[path]
            out.sum().backward()
        assert root.path is Route.FP32
        assert (True, True) in seen  # both compiled paths existed during the trial
        assert root.compiled is None and root.stock is None
    finally:
        session.uninstall()


@pytest.mark.parametrize("dtype, name", [("fp16", "float16"), ("bf16", "bfloat16")])
def test_the_report_names_the_runs_dtype_when_no_graph_compiles(dtype, name, fresh_session):
    net = nn.Linear(8, 4)
    automp.enable(dtype=dtype, path="eager", loss_scale="off")
    net(torch.randn(2, 8)).sum().backward()
    rep = automp.disable()
    assert rep["graphs"] == [] and rep["dtype"] == name and rep["device"] == "cpu"


class _Checkpointed(nn.Module):
    """Two blocks under activation checkpointing: their forward runs again inside the backward."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recompute_is_not_the_scripts_autocast(reentrant, fresh_session):
    """The recompute runs the blocks again during the backward, under the autocast state the forward had (automp's
    own): it must not register them as modules the script runs under its own autocast, which would also take
    automp's fp16 loss scaling off."""
    torch.manual_seed(0)
    net, x = _Checkpointed(reentrant), torch.randn(8, 16, requires_grad=True)
    ref = _Checkpointed(reentrant)
    ref.load_state_dict(net.state_dict())
    with torch.autocast("cpu", dtype=torch.float16):
        ref(x).float().pow(2).mean().backward()
    automp.enable(dtype="fp16", path="eager", loss_scale="dynamic")
    for _ in range(2):
        net.zero_grad()
        net(x).pow(2).mean().backward()
        assert autograd_hook.current() is not None  # loss scaling still on
    rep = automp.disable()
    assert [c["module"] for c in rep["choices"]] == ["_Checkpointed"]
    for p, q in zip(net.parameters(), ref.parameters()):
        assert (p.grad - q.grad).norm() / q.grad.norm() < 1e-2  # fp16 autocast's own gradient, unscaled


def test_a_script_that_calls_forward_directly_is_told_why_nothing_changed(fresh_session):
    net = nn.Linear(8, 4)
    automp.enable(dtype="bf16")
    net.forward(torch.randn(2, 8)).sum().backward()  # bypasses nn.Module.__call__, and so automp
    rep = automp.disable()
    assert rep["choices"] == [] and [f["rule"] for f in rep["fallbacks"]] == [NO_ROOTS]
    assert "model.forward(x)" in rep["fallbacks"][0]["reason"]
    automp.enable(dtype="bf16", path="eager")
    net(torch.randn(2, 8)).sum().backward()
    assert all(f["where"] != "modules" for f in automp.disable()["fallbacks"])


class _SeesFastpath(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.seen = nn.Linear(4, 4), []

    def forward(self, x):
        self.seen.append(torch.backends.mha.get_fastpath_enabled())
        return self.lin(x)


@pytest.mark.parametrize("path, seen", [("fp32", True), ("eager", True), ("compile", False)])
def test_attention_fast_path_is_off_only_while_a_compiled_path_runs(path, seen):
    """The fused inference fast path of nn.MultiheadAttention is opaque to the pass: off while compiled paths trace.
    The script's own calls keep it as the user set it (an evaluation of a Transformer in FP32 stays as fast)."""
    if not hasattr(torch.backends, "mha"):
        pytest.skip("no torch.backends.mha in this torch")
    net = _SeesFastpath()
    automp.enable(dtype="bf16", inner="eager", path=path)
    with torch.no_grad():
        net(torch.randn(2, 4))
    assert torch.backends.mha.get_fastpath_enabled()  # outside the module's call: as the user set it
    automp.disable()
    assert net.seen == [seen] and torch.backends.mha.get_fastpath_enabled()


def test_a_transformer_evaluated_on_the_compiled_path_is_traced_layer_by_layer():
    layer = nn.TransformerEncoderLayer(256, 4, 512, dropout=0.0, batch_first=True)  # GEMMs worth bf16
    net = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()  # eval + no_grad: the fast path's case
    _compile(dtype="bf16")
    with torch.no_grad():
        net(torch.randn(8, 64, 256))
    rep = automp.disable()
    ops = {n["op"] for g in rep["graphs"] for n in g["nodes"]}
    assert not any("transformer_encoder_layer" in op or "native_multi_head" in op for op in ops), sorted(ops)
    assert any(n["dtype"] == "bfloat16" and n["op"] in ("mm", "addmm", "bmm") for g in rep["graphs"]
               for n in g["nodes"])


@pytest.mark.parametrize("path", ["eager", "auto"])
def test_a_lazy_module_runs_its_first_call_with_uninitialized_parameters(path, fresh_session):
    """nn.LazyLinear has no shape (nor storage) until its first call: the verdict's key and the eager path's weight
    casts must not read them then. Its output is the autocast loop's, and its weights get gradients."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.LazyLinear(3))
    x = torch.randn(4, 6)
    automp.enable(dtype="bf16", path=path)
    try:
        out = net(x)
        out.sum().backward()
        out2 = net(x)
    finally:
        automp.disable()
    assert all(p.grad is not None for p in net.parameters())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = net(x).float()
    if path == "eager":
        assert (out2 - ref).norm() / ref.norm() < 1e-2
    assert out2.dtype == torch.float32


def test_the_report_and_the_line_count_the_calls_each_path_ran_in_a_run_that_kept_fp32(fresh_session):
    """A run that ends on FP32 ran its trial's calls in bf16 too: the report counts the calls of each path, in the
    trial and on the verdict, and the line says how many ran in which precision."""
    from automp.launcher import summary
    from automp.config import AutoMPConfig
    from automp.runtime.decisions import Route
    from automp.runtime.session import Session

    cost = {Route.FP32: 0.010, Route.EAGER_LOW: 0.020}
    now = [0.0]
    config = AutoMPConfig(dtype="bf16", inner="eager")
    session = Session(config, clock=lambda: now[0], candidates=candidates(cost))
    session.install()
    ran = []
    try:
        net, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16)
        for _ in range(30):
            out = net(x)
            root = session.roots[net]
            path = root.path or root.trial.current
            ran.append((root.path is None, path.value))
            now[0] += cost[path]
            out.sum().backward()
    finally:
        report = session.uninstall()
    (choice,) = report["choices"]
    assert choice["path"] == Route.FP32.value
    trial = {p: sum(1 for t, q in ran if t and q == p) for p in {q for t, q in ran if t}}
    chosen = sum(1 for t, _ in ran if not t)
    assert choice["calls"] == {"trial": trial, "chosen": {"fp32-eager": chosen}}
    low, fp32 = trial["low-precision-eager"], trial["fp32-eager"]
    assert low > 0 and fp32 > 0 and chosen > 0
    assert f"Sequential fp32-eager: kept FP32 as written (trial: {low} calls bf16, {fp32} FP32)" in summary(
        report, config)
