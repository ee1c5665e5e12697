"""The overflow flag stays on the device: a backward never reads it on the host, a fused optimizer skips on the
device (no read at all), any other optimizer reads it once per step, and the scale advances once per optimizer
step. Host reads are counted by patching every torch.Tensor method that moves a value to the host."""
import copy
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from tests.scaling.fp16_nets import HalfMLP, rel, twin

from automp.scaling import LossScaleConfig, LossScaler, install, skip

HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TOL = 5e-3  # params: fp16 compute vs the FP32 twin (as in test_overflow_skip)
STATE_TOL = 1e-4  # state vs the same fp16 run without scaling: a power-of-two scale changes (almost) no bit


@pytest.fixture
def host_reads(monkeypatch):
    """watch(): a context manager; inside it every host read of a tensor is counted in `count`."""
    class Reads:
        count = 0
        active = False

        @contextmanager
        def watch(self):
            self.active = True
            try:
                yield self
            finally:
                self.active = False

    reads = Reads()

    def counting(name):
        orig = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if reads.active:
                reads.count += 1
            return orig(self, *args, **kwargs)
        return read
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    return reads


def _batch(step: int, micro: int = 0, poison: bool = False):
    g = torch.Generator().manual_seed(100 * step + micro)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    if poison:
        x[0, 0] = float("inf")
    return x, y


def _backward(model, step: int, micro: int = 0, poison: bool = False):
    x, y = _batch(step, micro, poison)
    F.mse_loss(model(x), y).backward()


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state.get(p, {}).items()} for p in model.parameters()]
    return params, state


def _same(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    return all(torch.equal(x, y) for x, y in zip(pa, pb)) and \
        all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb))


FUSED = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
         "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
         "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True)}


@pytest.mark.parametrize("first_step", [False, True], ids=["before-any-step", "after-a-step"])
def test_backward_reads_nothing_on_the_host(host_reads, first_step):
    """Accumulation with an overflow in one micro-batch, plus an autograd.grad call: zero host reads, in both
    phases (the scale advancing per backward before any optimizer step, per step after)."""
    torch.manual_seed(0)
    model = HalfMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10, growth_interval=1)))
    if first_step:
        _backward(model, 0)
        opt.step()
        opt.zero_grad()
    with host_reads.watch():
        for micro in range(3):
            _backward(model, 1, micro, poison=micro == 1)
        x, y = _batch(2)
        torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    assert host_reads.count == 0
    before = _snapshot(model, opt)
    opt.step()
    assert _same(before, _snapshot(model, opt))  # the flag on the device still poisoned the step


def _reference_run(model, make, steps: int, skipped: int, half: bool):
    """A copy's run without loss scaling, which simply never takes the poisoned step: a snapshot after every step.
    half=False: the FP32 twin; half=True: the same fp16 compute (optimizer state averages fp16 gradients, whose
    rounding would swamp a tight comparison with FP32)."""
    ref = HalfMLP() if half else twin(model)
    ref.load_state_dict(model.state_dict())
    opt = make(ref.parameters())
    out = []
    for step in range(steps):
        if step != skipped:
            opt.zero_grad()
            _backward(ref, step)
            opt.step()
        out.append(_snapshot(ref, opt))
    return out


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_optimizer_skips_on_the_device_and_matches_fp32(host_reads, name):
    """The overflowing step leaves params and state bitwise unchanged, with no host read anywhere in the loop;
    every other step's params match the FP32 twin. Its state (exp_avg, the momentum buffer) matches the unscaled
    fp16 run: it would be off by the scale if the fused kernel unscaled a second time (Adam's params would not)."""
    bad, steps = 3, 6
    torch.manual_seed(1)
    model = HalfMLP()
    make = FUSED[name]
    ref = _reference_run(model, make, steps, bad, half=False)
    ref16 = _reference_run(model, make, steps, bad, half=True)
    opt = make(model.parameters())
    scaler = install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    for step in range(steps):
        before = _snapshot(model, opt)
        with host_reads.watch():
            opt.zero_grad()
            _backward(model, step, poison=step == bad)
            opt.step()
        assert not hasattr(opt, "found_inf")
        if step == bad:
            assert _same(before, _snapshot(model, opt))
            assert scaler.scale == 2.0 ** 9
        params, state = _snapshot(model, opt)
        for p, r in zip(params, ref[step][0]):
            assert torch.isfinite(p).all() and rel(p, r) < TOL
        for s, r in zip(state, ref16[step][1]):
            assert all(rel(s[k].float(), r[k].float()) < STATE_TOL for k in r), step
    # SGD's first step creates its momentum buffers: decided on the host (see the next test), all others not
    assert host_reads.count == (1 if name == "sgd-momentum" else 0)
    assert skip.skipped_steps() == 1
    assert scaler.summary() == {"scale": 2.0 ** 9, "overflow_steps": 1, "steps": steps}


def test_fused_sgd_first_step_overflow_leaves_no_garbage_momentum():
    """torch's fused SGD skipped on the device on its first step leaves its empty_like momentum buffers unfilled;
    that one step is decided on the host, so the run matches the FP32 twin that skips it."""
    torch.manual_seed(2)
    model = HalfMLP()
    ref_params = _reference_run(model, FUSED["sgd-momentum"], 4, 0, half=False)[-1][0]
    ref_state = _reference_run(model, FUSED["sgd-momentum"], 4, 0, half=True)[-1][1]
    opt = FUSED["sgd-momentum"](model.parameters())
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    for step in range(4):
        opt.zero_grad()
        _backward(model, step, poison=step == 0)
        opt.step()
    params, state = _snapshot(model, opt)
    for p, r, s, rs in zip(params, ref_params, state, ref_state):
        assert rel(p, r) < TOL and rel(s["momentum_buffer"], rs["momentum_buffer"]) < STATE_TOL


def test_non_fused_optimizer_reads_the_flag_once_per_step(monkeypatch):
    reads = []
    orig = skip._read
    monkeypatch.setattr(skip, "_read", lambda found: reads.append(1) or orig(found))
    torch.manual_seed(3)
    model = HalfMLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    for step in range(4):
        before = _snapshot(model, opt)
        opt.zero_grad()
        for micro in range(3):
            _backward(model, step, micro, poison=(step, micro) == (2, 1))
        assert len(reads) == step  # none in backward
        opt.step()
        assert len(reads) == step + 1
        assert _same(before, _snapshot(model, opt)) == (step == 2)
    assert skip.skipped_steps() == 1


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_overflow_in_one_micro_batch_skips_the_step_and_backs_off_once(fused):
    """After a first step the scale is held through the accumulation and moves once, at the step."""
    torch.manual_seed(4)
    model = HalfMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    scaler = install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    before = _snapshot(model, opt)
    for micro in range(4):
        _backward(model, 1, micro, poison=micro == 1)
        assert scaler.scale == 2.0 ** 10
    opt.step()
    assert _same(before, _snapshot(model, opt))
    assert scaler.summary() == {"scale": 2.0 ** 9, "overflow_steps": 1, "steps": 2}
    opt.zero_grad()
    _backward(model, 2)
    opt.step()
    assert not _same(before, _snapshot(model, opt))  # the flags went with the skipped step


def test_scale_grows_per_optimizer_step_not_per_micro_batch():
    """growth_interval=2, 3 micro-batches a step: before any optimizer step the machine counts backward calls (it
    cannot know one will come), from then on optimizer steps."""
    torch.manual_seed(5)
    model = HalfMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10, growth_interval=2)))
    seen = []
    for step in range(4):
        opt.zero_grad()
        for micro in range(3):
            _backward(model, step, micro)
        opt.step()
        seen.append((scaler.scale, scaler.steps))
    assert seen == [(2.0 ** 11, 3), (2.0 ** 12, 4), (2.0 ** 12, 5), (2.0 ** 13, 6)]


def test_two_fused_optimizers_skip_apart_and_advance_the_scale_once_per_iteration(host_reads):
    torch.manual_seed(6)
    a, b = HalfMLP(), HalfMLP()
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2, fused=True)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2, fused=True)
    scaler = install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10, growth_interval=1, max_scale=2.0 ** 20)))
    for step in range(3):
        before_a, before_b = _snapshot(a, opt_a), _snapshot(b, opt_b)
        with host_reads.watch():
            opt_a.zero_grad(), opt_b.zero_grad()
            _backward(a, step, poison=step == 2)
            _backward(b, step)
            opt_a.step(), opt_b.step()
        assert _same(before_a, _snapshot(a, opt_a)) == (step == 2)
        assert not _same(before_b, _snapshot(b, opt_b))
    assert host_reads.count == 0
    # iteration 0 ran before any step: 2 backward calls, 2 advances; then one advance per iteration
    assert scaler.summary() == {"scale": 2.0 ** 12, "overflow_steps": 1, "steps": 4}


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_gradients_accumulate_under_a_scale_beyond_fp16_range(device):
    """fp16 .grad (fp16 params) is brought to scaled units before the next micro-batch: x 2^16 must run in float32
    math, since a factor cast to fp16 first is inf (on CUDA torch's foreach multiply does that cast)."""
    torch.manual_seed(8)
    model = torch.nn.Linear(16, 4).to(device, torch.float16)
    ref = copy.deepcopy(model)
    xs = [torch.randn(8, 16, device=device, dtype=torch.float16) for _ in range(2)]
    for x in xs:
        (ref(x).float().square().mean() * 2.0 ** -8).backward()
    install(LossScaler(LossScaleConfig(init_scale=2.0 ** 16)))
    for x in xs:
        (model(x).float().square().mean() * 2.0 ** -8).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.isfinite(p.grad).all() and rel(p.grad, r.grad) < 1e-2


def test_update_is_a_device_op_that_counted_can_cancel():
    s = LossScaler(LossScaleConfig(init_scale=64.0, growth_interval=2))
    s.update(torch.ones(1), counted=torch.zeros(()))
    s.update(torch.zeros(1))
    assert (s.scale, s.growth_tracker, s.steps, s.overflow_steps) == (64.0, 1, 1, 0)
    s.update(torch.ones(1), counted=torch.ones(()))
    assert (s.scale, s.growth_tracker, s.steps, s.overflow_steps) == (32.0, 0, 2, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch's sync debug mode")
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_backward_and_fused_step_never_synchronize(fused):
    """On CUDA torch itself flags every synchronizing call: none in any backward, none in a fused step."""
    torch.manual_seed(7)
    model = HalfMLP().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused)
    scaler = install(LossScaler(LossScaleConfig(init_scale=2.0 ** 10)))
    batches = [tuple(t.cuda() for t in _batch(s, m, poison=(s, m) == (2, 1))) for s in range(4) for m in range(2)]
    for step in range(4):
        opt.zero_grad()
        for micro in range(2):
            x, y = batches[2 * step + micro]
            torch.cuda.set_sync_debug_mode("error")
            try:
                F.mse_loss(model(x), y).backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if fused and step:  # the first step's lazy state init may sync: torch's business, not ours
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert skip.skipped_steps() == 1 and scaler.overflow_steps == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
