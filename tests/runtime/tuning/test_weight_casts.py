"""The eager path keeps autocast's weight casts across root-module calls until a parameter changes."""
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import automp

pytestmark = pytest.mark.usefixtures("fresh_session")


class CastsOf(TorchDispatchMode):
    """Counts the dtype casts whose source is one of `params`' storage."""

    def __init__(self, params):
        super().__init__()
        self.ptrs = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 1))


def _reference(net, x):
    """What a hand-written autocast region computes with the weights as they are now."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return net(x).float()


def test_two_calls_before_backward_cast_the_weights_once():
    d = _net()
    real, fake = torch.randn(8, 24), torch.randn(8, 24)
    automp.enable(dtype="bf16", path="eager")
    with CastsOf(d.parameters()) as casts:
        a, b = d(real), d(fake)  # the GAN's D(real), D(fake.detach())
    assert casts.count == 4  # two weights and two biases, once (eight before: each call cast them again)
    (a.mean() + b.mean()).backward()
    assert d[0].weight.grad is not None and d[0].weight.grad.dtype == torch.float32
    automp.disable()


def _lazy_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.LazyLinear(1))


@pytest.mark.parametrize("change", ["optimizer", "in_place"])
@pytest.mark.parametrize("build", [_net, _lazy_net])
def test_a_changed_parameter_is_cast_again(change, build):
    """Also for a lazy module, whose parameters are recorded at its second call (the first had none to record)."""
    d = build()
    x = torch.randn(8, 24)
    automp.enable(dtype="bf16", path="eager")
    d(x).pow(2).mean().backward()
    opt = torch.optim.SGD(d.parameters(), lr=0.5)
    d(x).pow(2).mean().backward()
    before = d(x).detach().clone()
    if change == "optimizer":
        opt.step()
    else:
        with torch.no_grad():
            d[2].weight.mul_(-1.5)  # the lazy one, if lazy
    with CastsOf(d.parameters()) as casts:
        after = d(x)
    automp.disable()
    ref = _reference(d, x)
    assert casts.count >= 1
    assert not torch.equal(after, before)
    assert torch.equal(after, ref), (after - ref).abs().max()


def test_the_scripts_own_autocast_never_sees_a_stale_copy():
    d, other = _net(), nn.Linear(4, 4)
    x = torch.randn(8, 24)
    automp.enable(dtype="bf16", path="eager")
    other(torch.randn(2, 4))  # a second root stays on automp's eager path
    d(x)  # automp cached d's bf16 weights
    with torch.no_grad():
        d[0].weight.add_(1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the script takes d over (automp steps aside)
        out = d(x).float()
    automp.disable()
    assert torch.equal(out, _reference(d, x))


def test_disable_drops_the_cache():
    d = _net()
    x = torch.randn(8, 24)
    automp.enable(dtype="bf16", path="eager")
    d(x)
    automp.disable()
    with CastsOf(d.parameters()) as casts:  # no copy of automp's left for the next region to find
        _reference(d, x)
    assert casts.count == 4


def test_an_optimizer_step_drops_the_copies_before_it_runs():
    d = _net()
    opt = torch.optim.SGD(d.parameters(), lr=0.1)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append(torch.is_autocast_cache_enabled() and
                                                      bool(automp._session.casts._cast)))
    automp.enable(dtype="bf16", path="eager")
    d(torch.randn(8, 24)).mean().backward()
    assert automp._session.casts._cast  # held after the backward (the next call may reuse them)
    opt.step()  # automp's global pre-hook runs before the optimizer's own ones
    automp.disable()
    assert seen == [False]


def test_gradient_accumulation_casts_once_and_accumulates_the_same_gradients():
    import copy
    d = _net()
    ref = copy.deepcopy(d)
    xs = [torch.randn(8, 24) for _ in range(3)]
    automp.enable(dtype="bf16", path="eager")
    with CastsOf(d.parameters()) as casts:
        for x in xs:  # micro-batches, each with its backward, one optimizer step later
            d(x).pow(2).mean().backward()
    automp.disable()
    for x in xs:
        _reference(ref, x).pow(2).mean().backward()
    assert casts.count == 4  # once per optimizer step, not per micro-batch
    for p, q in zip(d.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_dropped_model_is_not_kept_alive():
    import gc
    import weakref
    d, other = _net(), _net()
    automp.enable(dtype="bf16", path="eager")
    d(torch.randn(8, 24))
    gone = weakref.ref(d[0].weight)
    del d  # the autocast cache's copies still reach the parameters (their autograd edge)
    other(torch.randn(8, 24))  # the next call finds the dropped module and lets the cache go
    gc.collect()
    assert gone() is None
    automp.disable()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_an_evaluation_without_grad_leaves_no_copy_the_next_training_step_would_use(mode):
    """A copy cast under no_grad has no autograd edge to its parameter: reused by a training forward, the weights
    would silently get no gradient."""
    import copy
    d = _net()
    ref = copy.deepcopy(d)
    x, val = torch.randn(8, 24), torch.randn(8, 24)
    automp.enable(dtype="bf16", path="eager")
    with getattr(torch, mode)():
        d(val)  # the validation pass between two epochs
    d(x).pow(2).mean().backward()
    automp.disable()
    _reference(ref, x).pow(2).mean().backward()
    for p, q in zip(d.parameters(), ref.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)


def test_a_parameter_whose_data_was_swapped_is_cast_again():
    d = _net()
    x = torch.randn(8, 24)
    automp.enable(dtype="bf16", path="eager")
    d(x)
    d[0].weight.data = torch.randn_like(d[0].weight)  # what Module.to() does, with no version bump
    out = d(x)
    automp.disable()
    assert torch.equal(out, _reference(d, x))


# bf16 keeps 8 significant bits: a gradient of this small MLP lands within ~0.5% of the float64 one (measured
# 0.3-0.4%); 3% leaves room for other seeds and BLAS orderings while still catching a wrong or missing term.
GRAD_RTOL = 0.03


def test_torch_func_grad_over_functional_call_bypasses_the_cache():
    """torch.func.grad hands the module wrapped parameters that have no storage and live for one transform: automp
    must neither record them (their data pointer does not exist) nor keep their casts, and the gradients match the
    float64 ones within bf16 accuracy, first call and later ones alike."""
    from torch.func import functional_call, grad

    d = _net()
    params = {k: v.detach() for k, v in d.named_parameters()}
    x, y = torch.randn(32, 24), torch.randn(32, 1)

    def loss_fn(p, x, y):
        return (functional_call(d, p, (x,)) - y).pow(2).mean()

    ref = grad(loss_fn)({k: v.double() for k, v in params.items()}, x.double(), y.double())
    automp.enable(dtype="bf16", path="eager")
    got = [grad(loss_fn)(params, x, y) for _ in range(3)]
    d(x).pow(2).mean().backward()  # the module's own parameters afterwards: cast and differentiated as usual
    automp.disable()
    for g in got:
        for k, r in ref.items():
            assert g[k].dtype == torch.float32
            assert ((g[k].double() - r).norm() / r.norm()).item() < GRAD_RTOL, k
    assert all(p.grad is not None for p in d.parameters())


class _NoStorage:
    """What the cache sees of a parameter with no storage of its own (a wrapper tensor subclass such as DTensor)."""

    requires_grad, _version = True, 0

    def data_ptr(self):
        raise RuntimeError("Cannot access data pointer of Tensor that doesn't have storage")


def test_parameters_without_storage_run_in_a_plain_region():
    from automp.runtime.tuning.weight_casts import SharedCasts
    casts, owner = SharedCasts(), _net()
    state = casts.enter("cpu", torch.bfloat16, owner, [_NoStorage()])
    try:
        assert torch.is_autocast_enabled("cpu") and not state[3]  # autocast on, nothing shared or recorded
        assert not casts._owners and not casts._cast
    finally:
        casts.exit("cpu", state)
    assert not torch.is_autocast_enabled("cpu")
