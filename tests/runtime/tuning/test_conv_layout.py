"""channels_last activations for eager convolutions as a measured choice (automp.runtime.tuning.conv_layout), with an
injected clock whose iteration cost depends on the layout in force. A CPU stands in for the CUDA device
(conv_tuning.tunable): its convolutions run channels_last too, so the numerics are checked for real."""
import copy

import pytest
import torch
import torch.nn as nn

from automp.runtime.tuning import allocator, conv_tuning
from automp.runtime.trial import TrialConfig
from automp.config import AutoMPConfig
from automp.runtime.tuning.conv_layout import CL, Layout, LayoutTuning
from automp.runtime.verdicts import VerdictCache

from .timed_session import train

DEV = torch.device("cuda")  # only its type is read: nothing runs on it


@pytest.fixture
def cuda_convs(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    monkeypatch.setattr(conv_tuning, "tunable", lambda device: True)


class Net(nn.Module):
    """Convolutions (a depthwise one among them), a norm, and a 4-d result; `view` flattens an activation with
    .view, which channels_last cannot serve."""

    def __init__(self, view: bool = False):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.dw, self.c2 = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 4, 1)
        self.view = view
        self.seen: list[bool] = []  # whether c2's input was channels_last, per call
        self.c2.register_forward_pre_hook(lambda m, a: self.seen.append(a[0].is_contiguous(memory_format=CL)))

    def forward(self, x):
        y = self.c2(self.dw(torch.relu(self.bn(self.c1(x)))))
        return y.view(y.shape[0], -1) if self.view else y


def _tuning(tmp_path, now, reports, cache="cache") -> LayoutTuning:
    return LayoutTuning(TrialConfig(), lambda: now[0], VerdictCache(tmp_path / cache), reports.append,
                        sync=lambda: None)


def _drive(tuning: LayoutTuning, net: nn.Module, cost: dict[bool, float], now: list[float], calls: int,
           eager: bool = True) -> list[bool]:
    """As the session does: the tuning sees the call, then the call runs (and costs) under the layout it left."""
    layouts = []
    for _ in range(calls):
        x = torch.randn(2, 3, 8, 8)
        tuning.call(net, DEV, "key", (x,), {}, eager=eager)
        out = tuning.run(net, DEV, lambda: net(x)) if eager and tuning.on else net(x)
        out.sum().backward()
        layouts.append(tuning.on)
        now[0] += cost[tuning.on]
    return layouts


@pytest.mark.parametrize("cl_ms, kept", [(0.6, True), (0.99, False), (1.3, False)])
def test_channels_last_is_kept_only_when_it_leads_by_more_than_the_margin(tmp_path, cuda_convs, cl_ms, kept):
    now, reports = [0.0], []
    tuning, net = _tuning(tmp_path, now, reports), Net()
    layouts = _drive(tuning, net, {True: cl_ms, False: 1.0}, now, 80)
    assert set(layouts[:10]) == {True, False} and tuning.done and tuning.on is kept
    assert net.seen[-1] is kept  # what the convolutions ran in after the decision
    (entry,) = reports
    assert entry["value"] == (Layout.CHANNELS_LAST if kept else Layout.DEFAULT).value and not entry["cached"]
    assert entry["timings_ms"]["channels-last"] == pytest.approx(1e3 * cl_ms)
    if not kept:  # nothing left behind on the script's modules
        assert all(not m._forward_pre_hooks for m in (net.c1, net.dw))
    second = _tuning(tmp_path, now, reports)  # a second run starts on the cached outcome
    assert _drive(second, Net(), {True: cl_ms, False: 1.0}, now, 2) == [kept] * 2 and reports[-1]["cached"]
    # a root first called once the layout is decided (a GAN's second network) runs it too: the session no longer
    # tells an idle tuning of calls, it only runs them through it
    late, x = Net(), torch.randn(2, 3, 8, 8)
    assert second.idle
    second.run(late, DEV, lambda: late(x)) if second.on else late(x)
    assert late.seen == [kept]


def test_results_and_gradients_match_the_scripts_layout_and_parameters_keep_theirs(tmp_path, cuda_convs):
    """Only the activations change layout: the result comes back in the default layout, values and gradients
    within fp32 rounding of the script's own run, and the entry convolution alone keeps a hook."""
    torch.manual_seed(0)
    ref, net = Net(), Net()
    net.load_state_dict(ref.state_dict())
    now, reports = [0.0], []
    tuning = _tuning(tmp_path, now, reports)
    tuning.applies(net, DEV, True)
    tuning.put(Layout.CHANNELS_LAST)
    for _ in range(2):
        x = torch.randn(4, 3, 9, 7)
        out, want = tuning.run(net, DEV, lambda: net(x)), ref(x)
        assert out.is_contiguous() and net.seen[-1]  # inside: channels_last; the script gets its layout back
        assert ((out - want).norm() / want.norm()).item() < 1e-5
        out.square().sum().backward()
        want.square().sum().backward()
    assert all(p.is_contiguous() for p in net.parameters())
    # all gradients as one vector: c1's bias has a gradient of rounding noise only (the norm right after cancels it)
    got, want = (torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (net, ref))
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    assert [m for m in net.modules() if m._forward_pre_hooks] == [net.c1, net.c2]  # c2: the test's own hook
    tuning.restore()
    assert [m for m in net.modules() if m._forward_pre_hooks] == [net.c2]


def test_a_call_that_raises_under_channels_last_runs_again_in_the_scripts_layout(tmp_path, cuda_convs):
    torch.manual_seed(0)
    now, reports = [0.0], []
    tuning, net = _tuning(tmp_path, now, reports), Net(view=True)
    tuning.applies(net, DEV, True)
    tuning.key = "key:layout"
    tuning.put(Layout.CHANNELS_LAST)
    x, ref = torch.randn(2, 3, 8, 8), copy.deepcopy(net)
    out, want = tuning.run(net, DEV, lambda: net(x)), ref(x)
    assert ((out - want).norm() / want.norm()).item() < 1e-6
    assert tuning.done and not tuning.on and not net.c1._forward_pre_hooks
    assert reports[-1]["value"] == "contiguous" and "raised under channels_last" in reports[-1]["reason"]
    assert VerdictCache(tmp_path / "cache").get("key:layout", kind=Layout).path is Layout.DEFAULT


def test_the_scripts_own_error_still_raises(tmp_path, cuda_convs):
    now, reports = [0.0], []
    tuning, net = _tuning(tmp_path, now, reports), Net()
    tuning.applies(net, DEV, True)
    tuning.put(Layout.CHANNELS_LAST)
    with pytest.raises(RuntimeError, match="channels"):  # 5 channels where the convolution takes 3
        tuning.run(net, DEV, lambda: net(torch.randn(2, 5, 8, 8)))


def test_left_alone_where_the_script_chose_channels_last_or_a_path_compiles(tmp_path, cuda_convs):
    now, reports = [0.0], []
    tuning, net = _tuning(tmp_path, now, reports), Net()
    _drive(tuning, net, {True: 0.5, False: 1.0}, now, 5, eager=False)  # a compiled path: Inductor picks layouts
    assert tuning.trial is None and not reports and not tuning.pending([(net, DEV, False)])
    net.to(memory_format=CL)
    _drive(tuning, net, {True: 0.5, False: 1.0}, now, 5)
    assert tuning.idle and "channels_last already" in reports[0]["reason"] and not tuning.on


def test_a_session_times_the_layout_then_cudnns_flag(monkeypatch, fresh_session, cuda_convs):
    """The layout's trial first, then the flag's on the layout that stays; settled() waits for both; disable()
    takes every hook off the script's modules."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 3, 8, 8)
    report, settled = train(AutoMPConfig(dtype="bf16", path="eager"), net, x, 200, [0.0], lambda s: (
        (0.7 if s.layout.on else 1.0) * (0.8 if torch.backends.cudnn.benchmark else 1.0)))
    assert settled[0] is False and settled[-1] is True
    layout, flag = [s for s in report["settings"] if s["setting"] != allocator.SETTING]  # CUDA's own: see allocator
    assert layout["value"] == "channels-last" and flag["setting"] == "torch.backends.cudnn.benchmark"
    assert flag["value"] is True and set(flag["timings_ms"]) == {"cudnn-benchmark", "cudnn-heuristics"}
    assert not any(m._forward_pre_hooks for m in (net.c1, net.bn, net.dw))
    with pytest.raises(TypeError, match="tune_layout"):
        AutoMPConfig(tune_layout=1)
