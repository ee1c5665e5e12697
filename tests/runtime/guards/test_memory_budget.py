"""The trial's memory budget: once the anchor's path (autocast-compiled) has run one iteration, an eager candidate whose
first forward holds more than that iteration's peak leaves the trial; the call runs again on the next candidate, no
step is lost, buffers are updated once, and the report names the rule and the figures. Without an anchor, under the
floor, or for the trial's last candidate, nothing is dropped.

The device is emulated: its peak is a number the test sets, its allocated memory 0 (or a number the test sets), so
twice the largest output of the eager forward's modules (real CPU tensors) is measured against it; the anchor's
compiled path is an autocast call of the module (compiling is not what is tested)."""
import pytest
import torch
import torch.nn as nn

import automp
from automp.runtime import compiled_paths
from automp.runtime.decisions import TRIAL_OOM, TRIAL_OVER_MEMORY, Route
from automp.runtime.guards.memory_budget import DeviceMemory, MemoryBudget, OverBudget
from automp.runtime.starts import GPU_CANDIDATES, candidate_paths
from automp.runtime.trial import TrialConfig
from tests.runtime.sessions import inject, train_mlp as _train

pytestmark = pytest.mark.usefixtures("fresh_session")
CPU = torch.device("cpu")


def _memory(peak: int, total: int = 10_000) -> DeviceMemory:
    return DeviceMemory(allocated=lambda: 0, peak=lambda: peak, total=total, device=CPU)


def _stock_as_autocast(monkeypatch, oom_after: int | None = None):
    """The stock path, run as an autocast call (optionally out of memory from its call number `oom_after` on)."""
    def stock(module, root, **kwargs):
        calls = [0]

        def call(*args, **kw):
            calls[0] += 1
            if oom_after is not None and calls[0] >= oom_after:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")
            with torch.autocast("cpu", dtype=root.low):
                return compiled_paths.ORIG_CALL(module, *args, **kw)
        return call
    monkeypatch.setattr(compiled_paths, "stock", stock)


def _net(bn: bool = False):
    torch.manual_seed(0)
    layers = [nn.BatchNorm1d(16)] if bn else []
    return nn.Sequential(*layers, nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _run(monkeypatch, peak, bn=False, total=10_000, cache_dir=None, steps=6):
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.EAGER_LOW], "test"),
           memory=lambda d: _memory(peak, total),
           trial_config=TrialConfig(warmup={Route.COMPILED_AUTOCAST: 1, Route.EAGER_LOW: 1}))
    automp.enable(dtype="bf16", **({"cache_dir": str(cache_dir)} if cache_dir else {}))
    net = _net(bn)
    losses = _train(net, steps)
    return losses, automp.disable(), net


def _forced_stock(monkeypatch, bn=False):
    automp.enable(dtype="bf16", path="autocast-compile")
    net = _net(bn)
    losses = _train(net)
    automp.disable()
    return losses, net


@pytest.mark.parametrize("bn", [False, True])
def test_an_eager_candidate_over_the_anchors_peak_leaves_the_trial_and_no_step_is_lost(monkeypatch, bn):
    _stock_as_autocast(monkeypatch)
    ref, ref_net = _forced_stock(monkeypatch, bn)
    losses, report, net = _run(monkeypatch, peak=1000, bn=bn)  # the first Linear's saves alone are over 1000 bytes
    assert losses == ref  # every step ran, on the anchor's path as the forced run did
    (choice,) = report["choices"]
    assert choice["path"] == "autocast-compiled"
    over = [f for f in report["fallbacks"] if f.get("rule") == TRIAL_OVER_MEMORY]
    assert len(over) == 1 and over[0]["reason"].startswith("low-precision-eager held")
    bound = choice["bounds"][Route.EAGER_LOW.value]
    assert bound["rule"] == TRIAL_OVER_MEMORY and bound["limit_gib"] == round(1000 / 2**30, 3)
    if bn:  # the aborted call had updated the running statistics: they were put back, so they were updated once
        bn_layer, ref_bn = net[0], ref_net[0]
        assert torch.equal(bn_layer.running_mean, ref_bn.running_mean)
        assert torch.equal(bn_layer.num_batches_tracked, ref_bn.num_batches_tracked)


def test_within_the_budget_or_under_the_floor_the_eager_candidate_is_timed(monkeypatch, tmp_path):
    _stock_as_autocast(monkeypatch)
    for peak, total in ((10**9, 2 * 10**9), (100, 10_000)):  # far above its saves; 1% of the device, under the floor
        _, report, _ = _run(monkeypatch, peak=peak, total=total, cache_dir=tmp_path / str(peak),
                            steps=12)  # no cached verdict; steps enough for a sample of each
        assert not [f for f in report["fallbacks"] if f.get("rule") == TRIAL_OVER_MEMORY]
        assert Route.EAGER_LOW.value in report["choices"][0]["timings_ms"]


@pytest.mark.parametrize("fp32", [False, True])
def test_without_a_compiled_candidate_left_the_eager_ones_run_without_a_budget(monkeypatch, fp32):
    """The anchor sets the budget in its first iteration, then runs out of memory. Low precision eager, over the
    budget, is then the last candidate, or has only FP32 eager beside it (which holds more): it stays, the budget is
    off, every call runs, and the script sees no error."""
    _stock_as_autocast(monkeypatch, oom_after=2)
    paths = [Route.COMPILED_AUTOCAST, Route.EAGER_LOW] + ([Route.FP32] if fp32 else [])
    inject(monkeypatch, candidates=lambda device, low: (paths, "test"), memory=lambda d: _memory(1000),
           trial_config=TrialConfig(warmup={Route.COMPILED_AUTOCAST: 2, Route.EAGER_LOW: 1, Route.FP32: 1}))
    automp.enable(dtype="bf16")
    losses = _train(_net(), 30)
    report = automp.disable()
    (choice,) = report["choices"]
    assert len(losses) == 30 and choice["path"] in ("low-precision-eager", "fp32-eager")
    if fp32:  # both eager paths were timed: neither left for memory
        assert {Route.EAGER_LOW.value, Route.FP32.value} <= set(choice["timings_ms"])
    rules = [f.get("rule") for f in report["fallbacks"]]
    assert TRIAL_OOM in rules and TRIAL_OVER_MEMORY not in rules


def test_an_anchor_call_that_fails_sets_no_budget(monkeypatch):
    """The anchor runs out of memory in its first call: that call's peak is no iteration's, so the eager candidates
    after it run without a budget (both are timed, neither leaves for memory)."""
    _stock_as_autocast(monkeypatch, oom_after=1)
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.EAGER_LOW, Route.FP32], "test"),
           memory=lambda d: _memory(1000),
           trial_config=TrialConfig(warmup={Route.COMPILED_AUTOCAST: 1, Route.EAGER_LOW: 1, Route.FP32: 1}))
    automp.enable(dtype="bf16")
    _train(_net(), 12)
    report = automp.disable()
    rules = [f.get("rule") for f in report["fallbacks"]]
    assert TRIAL_OOM in rules and TRIAL_OVER_MEMORY not in rules


def test_eager_calls_are_checked_at_every_modules_entry_and_exit_and_compiled_ones_not():
    peak, alloc = [4096], [100]
    budget = MemoryBudget(DeviceMemory(lambda: alloc[0], lambda: peak[0], 8192, CPU))
    budget.begin(Route.COMPILED_AUTOCAST)
    assert budget.limit is None  # the anchor's iteration has not ended yet
    budget.begin(Route.EAGER_LOW)
    assert budget.limit == 4096 and budget.record["anchor_peak_gib"] == round(4096 / 2**30, 3)
    net = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), nn.Linear(8, 8))
    grow = net[1].register_forward_pre_hook(lambda mod, args: alloc.__setitem__(0, alloc[0] + 1500))
    x = torch.randn(4, 8)  # module outputs of 128 bytes: 256 on top of what is allocated
    with budget.guard(Route.EAGER_LOW, net):
        net(x).sum().backward()  # 1600 + 256 at most: within
    assert Route.EAGER_LOW in budget.passed
    budget.passed.clear()
    alloc[0] = 2500  # the middle module takes the device to 4000: stopped at its exit, before the last Linear ran
    ran = []
    net[2].register_forward_pre_hook(lambda mod, args: ran.append(1))
    with pytest.raises(OverBudget, match="low-precision-eager held") as e:
        with budget.guard(Route.EAGER_LOW, net):
            net(x)
    assert e.value.used == 4000 + 256 and not ran and Route.EAGER_LOW not in budget.passed
    assert not torch.nn.modules.module._global_forward_hooks  # the checks are gone with the call
    assert not torch.nn.modules.module._global_forward_pre_hooks
    grow.remove()
    alloc[0] = 10**6
    with budget.guard(Route.COMPILED_AUTOCAST, net):  # compiled candidates are not guarded
        net(x)


def test_the_anchors_peak_is_read_as_its_gradients_arrive_not_lost_to_a_reset_of_the_peak_statistics():
    """A script that resets torch's peak statistics at each step leaves, when the next call begins, only what is
    allocated between steps: the backward's peak must be read before that."""
    peak = [0]
    budget = MemoryBudget(DeviceMemory(lambda: 100, lambda: peak[0], 100_000, CPU))
    net = nn.Linear(8, 8)
    budget.begin(Route.COMPILED_AUTOCAST)
    with budget.guard(Route.COMPILED_AUTOCAST, net):
        out = net(torch.randn(4, 8)).sum()
    budget.returned(Route.COMPILED_AUTOCAST, out)
    peak[0] = 5000  # the backward's peak, read when the backward has passed the output
    out.backward()
    peak[0] = 100  # the script resets the statistics before its next step
    budget.begin(Route.EAGER_LOW)
    assert budget.limit == 5000 and budget.record["anchor_peak_gib"] == round(5000 / 2**30, 3)
    reads = [0]
    budget.memory.peak = lambda: reads.__setitem__(0, reads[0] + 1) or 10**9
    out = net(torch.randn(4, 8)).sum()
    budget.returned(Route.COMPILED_AUTOCAST, out)  # the anchor's first iteration is over: no hooks
    out.backward()
    assert reads == [0] and budget.limit == 5000


def test_the_estimate_counts_the_largest_module_output_twice_more():
    budget = MemoryBudget(DeviceMemory(lambda: 0, lambda: 0, 10**6, CPU), limit=6 * 1024)
    with pytest.raises(OverBudget) as e:  # a 4 KiB output: its gradient and cast, 8 KiB
        with budget.guard(Route.EAGER_LOW):
            nn.Identity()(torch.randn(32, 32))
    assert e.value.used == 8 * 1024
    with budget.guard(Route.EAGER_LOW):  # a 2 KiB output: 4 KiB estimated, within it
        nn.Identity()(torch.randn(16, 32))
    assert Route.EAGER_LOW in budget.passed


def test_a_stopped_forward_keeps_none_of_its_activations():
    """Stopped in the middle, an eager forward has no backward: nothing may tie what it saved to autograd's graph
    (a saved-tensor hook handing back an op's own output does, and GPT-2's stopped forward kept 4 GiB that way)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    budget = MemoryBudget(DeviceMemory(lambda: 0, lambda: 0, 10**6, CPU), limit=3000)
    outputs = []
    net = nn.Sequential(nn.Linear(16, 16), nn.Sigmoid(), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 64))
    for m in net:  # the Sigmoid and Tanh save their outputs for the backward
        m.register_forward_hook(lambda mod, args, out: outputs.append(StorageWeakRef(out.untyped_storage())))
    with pytest.raises(OverBudget):  # 1 KiB outputs pass; the last Linear's 4 KiB is over
        with budget.guard(Route.EAGER_LOW, net):
            net(torch.randn(16, 16, requires_grad=True))
    import gc
    gc.collect()
    assert len(outputs) == 4 and all(r.expired() for r in outputs)  # the last Linear was stopped before its hook


def test_buffers_are_put_back_only_when_the_budget_aborts_the_call():
    budget = MemoryBudget(DeviceMemory(lambda: 0, lambda: 10**6, 10**7, CPU), limit=10**6)
    bn = nn.BatchNorm1d(4)
    with budget.guard(Route.EAGER_LOW, bn):
        bn(torch.randn(8, 4, requires_grad=True))
    assert bn.num_batches_tracked.item() == 1 and Route.EAGER_LOW in budget.passed
    budget.passed.clear()
    before = bn.running_mean.clone()
    with pytest.raises(OverBudget):
        with budget.guard(Route.EAGER_LOW, bn):
            bn(torch.randn(8, 4, requires_grad=True))
            raise OverBudget(Route.EAGER_LOW, 2, 1)
    assert torch.equal(bn.running_mean, before) and bn.num_batches_tracked.item() == 1


def test_a_gpu_trial_runs_the_anchor_first_and_not_automps_own_pass():
    paths, _ = candidate_paths("cuda", 10.0, "bf16")
    assert paths == list(GPU_CANDIDATES) and paths[0] is Route.COMPILED_AUTOCAST and Route.COMPILED not in paths


def test_the_aborted_calls_tensors_are_freed_before_the_call_runs_again(monkeypatch):
    """An eager candidate stopped inside its forward leaves its activations in the frames of the error's traceback,
    and in the reference cycles around it. The call runs again on the next candidate only once they are gone:
    otherwise the re-run holds both, and a step that fits as written could run out of memory."""
    import weakref
    temps, alive_at_rerun = [], []

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(16, 32)

        def forward(self, x):
            temp = torch.randn(64, 64)  # a local of this frame when the budget stops the forward inside `inner`
            temps.append(weakref.ref(temp))
            cache = {"temp": temp}
            cache["self"] = cache  # held in a reference cycle too, as transformers' key/value caches are
            return self.inner(x) + 0 * temp[0, :32]

    def stock(module, root, **kwargs):
        def call(*args, **kw):
            alive_at_rerun.append(sum(r() is not None for r in temps))
            with torch.autocast("cpu", dtype=root.low):
                return compiled_paths.ORIG_CALL(module, *args, **kw)
        return call
    monkeypatch.setattr(compiled_paths, "stock", stock)
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.EAGER_LOW], "test"),
           memory=lambda d: _memory(1000),
           trial_config=TrialConfig(warmup={Route.COMPILED_AUTOCAST: 1, Route.EAGER_LOW: 1}))
    automp.enable(dtype="bf16")
    torch.manual_seed(0)
    net = nn.Sequential(Holder(), nn.GELU(), nn.Linear(32, 4))
    import gc
    gc.disable()  # only automp's own collections: a cycle that survives one lands in the oldest generation, which
    try:  # Python collects rarely, so in a real script it would outlive the re-run
        _train(net, 2)
    finally:
        gc.enable()
    report = automp.disable()
    assert [f["rule"] for f in report["fallbacks"]].count(TRIAL_OVER_MEMORY) == 1
    assert len(temps) >= 3 and len(alive_at_rerun) >= 2
    assert temps[1]() is None  # the aborted forward's: collected before the re-run (and so before the next step)
    assert alive_at_rerun[1] <= 1  # at the re-run at most the first call's, whose cycle nothing had to collect yet


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's own allocator")
def test_on_a_gpu_a_stopped_forward_gives_back_all_it_allocated():
    """On the device's own counters: an eager forward stopped by the budget leaves the device's allocated memory
    where it was before the call (a stopped forward's saved activations kept alive were 4 GiB on GPT-2)."""
    import gc
    from automp.runtime.guards.memory_budget import cuda_memory
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(1024, 1024), nn.Sigmoid(), nn.Tanh())]).to(device)
    x = torch.randn(4096, 1024, device=device, requires_grad=True)
    with torch.no_grad():
        net(x)  # cuBLAS's workspace, kept by the allocator once made: before the count, not in it
    gc.collect()
    before = torch.cuda.memory_allocated(device)
    budget = MemoryBudget(cuda_memory(device), limit=before + 3 * 4096 * 1024 * 4 * 3)  # three layers' outputs or so
    with pytest.raises(OverBudget):
        with budget.guard(Route.EAGER_LOW, net):
            net(x)
    gc.collect()
    assert torch.cuda.memory_allocated(device) == before
