"""automp.runtime.graph_pool: gradients copied out of CUDA graphs' pool before a replay frees them, and the pool given
back once automp leaves its graphs. On a CPU there are no cudagraph trees: their state is faked at the two functions
graph_pool reads it through (live_storages, _containers)."""
import types

import pytest
import torch
import torch.nn as nn

import automp
from automp.runtime import graph_pool

from .sessions import candidates, inject

pytestmark = pytest.mark.usefixtures("fresh_session")


def _params(n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [nn.Parameter(torch.randn(5, 7, generator=gen)) for _ in range(n)]
    for p in ps:
        p.grad = torch.randn(5, 7, generator=gen)
    return ps


def _pool_holds(monkeypatch, tensors):
    live = {t.untyped_storage().data_ptr() for t in tensors}
    monkeypatch.setattr(graph_pool, "live_storages", lambda index: live)


def _call(rescue):
    """One call of the module by the script, replayed: what the session does, then the graphed path."""
    rescue.observe()
    return rescue.before_replay()


def test_gradients_in_the_pool_are_copied_out_and_others_left(monkeypatch):
    ps = _params()
    pooled, own = ps[:2], ps[2]
    _pool_holds(monkeypatch, [p.grad for p in pooled])
    before = [p.grad for p in ps]
    assert _call(graph_pool.GradRescue(0, ps)) == 2
    for p, old in zip(pooled, before):
        assert p.grad is not old and p.grad.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
        assert torch.equal(p.grad, old)
    assert own.grad is before[2]


def test_unknown_pool_state_copies_every_gradient(monkeypatch):
    ps = _params()
    monkeypatch.setattr(graph_pool, "live_storages", lambda index: None)
    before = [p.grad for p in ps]
    assert _call(graph_pool.GradRescue(0, ps)) == 3
    assert all(p.grad is not old and torch.equal(p.grad, old) for p, old in zip(ps, before))


def test_evacuate_copies_the_pools_gradients_out_even_after_copies_stopped(monkeypatch):
    """Graphs dropped after their warm-up: their pool goes back at once, so whatever the loop was learned to do, the
    gradients in it are copied out (values kept) and the others left as they are."""
    ps = _params()
    rescue = graph_pool.GradRescue(0, ps)
    rescue.copying = False  # the loop was learned to drop them: before_replay would copy nothing
    _pool_holds(monkeypatch, [p.grad for p in ps[:2]])
    before = [p.grad for p in ps]
    assert rescue.before_replay() == 0 and rescue.evacuate() == 2
    for p, old in zip(ps[:2], before):
        assert p.grad is not old and torch.equal(p.grad, old)
        assert p.grad.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
    assert ps[2].grad is before[2]


def test_sparse_gradients_are_left_alone(monkeypatch):
    """nn.Embedding(sparse=True) gives a sparse gradient: it has no storage to look up, and the pool holds none."""
    ps = _params()
    ps[0].grad = ps[0].grad.to_sparse()
    sparse = ps[0].grad
    monkeypatch.setattr(graph_pool, "live_storages", lambda index: None)
    assert _call(graph_pool.GradRescue(0, ps)) == 2 and ps[0].grad is sparse


def _backward(ps, seed):
    """A new backward's gradients, set to None before it (the loop's zero_grad): the last ones are dropped."""
    gen = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(5, 7, generator=gen)


def test_copies_stop_once_the_loop_drops_them_unread(monkeypatch):
    """The tutorial loop (forward, zero_grad, backward, step) reaches each forward with last step's gradients alive
    and drops them right after: copying them is wasted."""
    ps, copied = _params(), []
    rescue = graph_pool.GradRescue(0, ps)
    for step in range(6):
        _backward(ps, step)  # in the pool; the copies of the last step are gone
        _pool_holds(monkeypatch, [p.grad for p in ps])
        copied.append(_call(rescue))
    assert copied[:graph_pool.LEARN] == [3] * graph_pool.LEARN and copied[graph_pool.LEARN:] == [0] * (
        6 - graph_pool.LEARN)


def test_the_loop_is_learned_on_paths_without_graphs_and_their_first_replay_copies_nothing(monkeypatch):
    """One rescue per module: the trial's compiled steps come first, and what the loop did with the gradients there
    decides before any replay; a candidate graphed after another starts from what that one learned."""
    ps = _params()
    rescue = graph_pool.GradRescue(0, ps)
    for step in range(graph_pool.LEARN + 1):  # compiled steps: gradients in ordinary memory, dropped each step
        _backward(ps, step)
        rescue.observe()
    _backward(ps, 99)
    _pool_holds(monkeypatch, [p.grad for p in ps])
    assert _call(rescue) == 0 and not rescue.copying


def test_copies_go_on_while_the_script_accumulates_into_them(monkeypatch):
    """Accumulation: the first micro-batch's gradients (in the pool) are copied, the next backward adds into the copy,
    and a new cycle starts from gradients set to None."""
    ps, copied = _params(), []
    rescue = graph_pool.GradRescue(0, ps)
    for cycle in range(5):
        _pool_holds(monkeypatch, [p.grad for p in ps])  # cycle's first backward stole pool memory
        copied.append(_call(rescue))  # second micro-batch's forward
        _pool_holds(monkeypatch, [])
        copied.append(_call(rescue))  # third: the copies are ordinary memory now
        _backward(ps, cycle)
    assert copied == [3, 0] * 5


def test_copies_go_on_for_a_loop_that_zeroes_at_its_top_and_accumulates(monkeypatch):
    """zero_grad, then two micro-batches, then the step: each step's copies are dropped by the next zero_grad, but
    the next forward finds no gradient at all, which says nothing about the loop (an H100 run stopped copying here
    after two steps when it counted as a drop)."""
    ps, copied = _params(), []
    rescue = graph_pool.GradRescue(0, ps)
    for step in range(5):
        for p in ps:
            p.grad = None  # zero_grad()
        copied.append(_call(rescue))  # first micro-batch
        _backward(ps, step)  # its backward, into the pool
        _pool_holds(monkeypatch, [p.grad for p in ps])
        copied.append(_call(rescue))  # second micro-batch
    assert copied == [0, 3] * 5


class _Node:
    def __init__(self, live):
        self.live = live

    def path_live_weakrefs(self):
        return [types.SimpleNamespace(data_ptr=lambda p=p: p) for p in self.live]


def _trees(monkeypatch, fns, live=(), other_fns=None):
    """Fakes this thread's cudagraph trees: `fns` graph functions on device 0, `live` pool storages alive."""
    c0 = types.SimpleNamespace(live_cudagraphify_fns=fns, tree_manager=types.SimpleNamespace(current_node=_Node(live)))
    containers = {0: c0}
    if other_fns is not None:
        containers[1] = types.SimpleNamespace(live_cudagraphify_fns=other_fns, tree_manager=None)
    monkeypatch.setattr(graph_pool, "_containers", lambda: containers)
    return c0


@pytest.fixture
def resets(monkeypatch):
    import torch._inductor.cudagraph_trees as trees
    calls = []
    monkeypatch.setattr(trees, "reset_cudagraph_trees", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return calls


def test_pool_released_once_its_tensors_are_dead(monkeypatch, resets):
    c0 = _trees(monkeypatch, 0)
    pool = graph_pool.PoolRelease(0)
    c0.live_cudagraphify_fns = 2  # automp's forward and backward graphs
    pool.seen()
    c0.tree_manager.current_node.live = [123]  # last backward's gradients
    assert pool.attempt() is graph_pool.Release.PENDING and resets == []
    c0.tree_manager.current_node.live = []
    assert pool.attempt() is graph_pool.Release.RELEASED and resets == ["reset"]


@pytest.mark.parametrize("case", ["before", "after", "other-device", "unknown"])
def test_pool_kept_where_the_script_has_cuda_graphs_of_its_own(monkeypatch, resets, case):
    c0 = _trees(monkeypatch, 1 if case == "before" else 0, other_fns=1 if case == "other-device" else None)
    pool = graph_pool.PoolRelease(0)
    c0.live_cudagraphify_fns += 2
    pool.seen()
    if case == "after":  # the script compiled reduce-overhead graphs of its own since automp's
        c0.live_cudagraphify_fns += 1
    if case == "unknown":  # torch's internals are not as automp knows them
        monkeypatch.setattr(graph_pool, "_containers", lambda: None)
    assert pool.attempt() is graph_pool.Release.KEPT and resets == []


@pytest.mark.usefixtures("eager_inductor")
def test_session_gives_the_pool_back_when_it_leaves_cuda_graphs(monkeypatch, tmp_path):
    """A training call that recompiles after the verdict moves the module off CUDA graphs: their pool is given back
    once the last graphed backward's gradients are gone, and the report says so."""
    from automp.runtime.decisions import Route
    inject(monkeypatch, candidates=lambda device, low: ([Route.GRAPHED], "test: one candidate"))
    R = graph_pool.Release
    outcomes = iter([R.PENDING, R.PENDING, R.RELEASED])
    attempts = []
    monkeypatch.setattr(graph_pool.PoolRelease, "attempt", lambda self: attempts.append(1) or next(outcomes))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    automp.enable(dtype="bf16", cache_dir=str(tmp_path))
    for rows in (8, 8, 12, 12, 12):
        net(torch.randn(rows, 16)).pow(2).mean().backward()
    session = automp._session
    assert session.roots[net].path is Route.COMPILED_AUTOCAST and session.paths.releasing is None
    rep = automp.disable()
    assert len(attempts) == 3
    (setting,) = [s for s in rep["settings"] if s["setting"] == "CUDA graphs memory pool"]
    assert setting["value"] == "released"


@pytest.mark.usefixtures("eager_inductor")
def test_graphed_calls_copy_pool_gradients_before_the_replay(monkeypatch):
    """Accumulating over two micro-batches on CUDA graphs: with every gradient taken for pool memory, the second
    forward copies them out first, and the accumulated gradients match a plain loop's."""
    monkeypatch.setattr(graph_pool, "live_storages", lambda index: None)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    ref.load_state_dict(net.state_dict())
    xs = [torch.randn(8, 16) for _ in range(2)]
    for x in xs:
        ref(x).pow(2).mean().backward()
    automp.enable(dtype="bf16", path="autocast-graphs")
    net(xs[0]).pow(2).mean().backward()
    first = [p.grad for p in net.parameters()]
    net(xs[1]).pow(2).mean().backward()
    automp.disable()
    for p, old, r in zip(net.parameters(), first, ref.parameters()):
        assert p.grad is not old  # copied out before the second replay, then accumulated into
        assert 1e-6 < (p.grad - r.grad).norm() / r.grad.norm() < 3e-2


@pytest.mark.usefixtures("eager_inductor")
def test_disable_gives_back_the_pool_of_a_module_still_on_cuda_graphs(monkeypatch):
    """automp.disable(): nothing replays automp's CUDA graphs any more, so their pool goes back (or the report says
    why it stays)."""
    attempts = []
    monkeypatch.setattr(graph_pool.PoolRelease, "attempt",
                        lambda self: attempts.append(1) or graph_pool.Release.PENDING)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    automp.enable(dtype="bf16", path="autocast-graphs")
    net(torch.randn(8, 16)).pow(2).mean().backward()
    rep = automp.disable()
    assert attempts == [1]  # once: disable does not wait
    (setting,) = [s for s in rep["settings"] if s["setting"] == "CUDA graphs memory pool"]
    assert setting["value"] == "kept" and "still alive" in setting["reason"]


@pytest.mark.usefixtures("eager_inductor")
def test_cached_memory_goes_back_before_cuda_graphs_record_and_once_they_win(monkeypatch, tmp_path):
    """The caching allocator keeps the other candidates' activations; CUDA graphs' pool cannot reuse them, so they are
    given back before the graphs record in a trial, and again once the graphs win (they do not come back)."""
    from automp.runtime import compiled_paths
    from automp.runtime.decisions import Route
    from automp.runtime.trial import TrialConfig
    from automp.config import AutoMPConfig
    from automp.runtime.session import Session
    cost = {Route.FP32: 0.030, Route.GRAPHED: 0.010}
    released = []
    monkeypatch.setattr(compiled_paths, "release_cached", lambda device: released.append(device))
    monkeypatch.setattr(graph_pool.PoolRelease, "attempt", lambda self: graph_pool.Release.RELEASED)
    now = [0.0]
    session = Session(AutoMPConfig(dtype="bf16", inner="eager", spec="h100", cache_dir=str(tmp_path)),
                      trial_config=TrialConfig(), clock=lambda: now[0], candidates=candidates(cost))
    session.install()
    net, x = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16)
    graphed, decided_at = 0, None
    try:
        for i in range(80):
            out = net(x)
            root = session.roots[net]
            path = root.trial.current if root.path is None else root.path
            graphed += path is Route.GRAPHED
            if path is Route.GRAPHED and graphed == 2:  # its recording (the first call: the trees' warm-up)
                before = len(released)
            if root.path is not None and decided_at is None:
                decided_at, at_verdict = i, len(released)
            now[0] += cost[path]
            out.sum().backward()
    finally:
        session.uninstall()
    assert root.path is Route.GRAPHED
    assert before == 1  # on the graphed candidate's recording call, before it ran
    assert at_verdict == 2 and len(released) == 2  # once more at its verdict, and never again


@pytest.mark.usefixtures("eager_inductor")
def test_graphs_dropped_after_their_one_warmup_call_give_their_pool_back(monkeypatch, resets, tmp_path):
    """The early warm-up is the graphs' only call: its forward's graph exists when the call returns, its backward's is
    compiled after it. Dropped at the next call (no room beside their pool), both are counted as automp's and the
    pool goes back (counted by the call alone, the backward's graph looked like the script's, and the pool stayed:
    on the H200 the near-limit test then ran out of memory beside it)."""
    from automp.runtime import compiled_paths
    from automp.runtime.decisions import Route
    state = {"n": 0}  # graph functions replaying into the tree
    monkeypatch.setattr(graph_pool, "graph_functions", lambda index: state["n"])
    node = types.SimpleNamespace(current_node=_Node([]))
    monkeypatch.setattr(graph_pool, "_containers", lambda: {0: types.SimpleNamespace(
        live_cudagraphify_fns=state["n"], tree_manager=node)})
    monkeypatch.setattr(compiled_paths, "early_pool_fits", lambda device: "autocast-graphed not tried: no room")
    before_replay = graph_pool.GradRescue.before_replay
    monkeypatch.setattr(graph_pool.GradRescue, "before_replay",
                        lambda self: state.update(n=max(state["n"], 1)) or before_replay(self))
    from automp.runtime.trial import TrialConfig
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.GRAPHED], "test"),
           trial_config=TrialConfig(early_warmup=1))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    automp.enable(dtype="bf16", cache_dir=str(tmp_path))
    for _ in range(3):
        net(torch.randn(8, 16)).pow(2).mean().backward()
        state["n"] = 2 if state["n"] else 0  # the backward's graph, compiled at its first call
    rep = automp.disable()
    assert resets == ["reset"]
    (setting,) = [s for s in rep["settings"] if s["setting"] == "CUDA graphs memory pool"]
    assert setting["value"] == "released"


def test_release_waits_for_the_loop_to_be_learned_then_sets_its_gradients_to_none():
    """release frees nothing while the loop is unknown (it may accumulate), then, once learned to drop them after its
    forward, sets every gradient to None at the call and says how many bytes that was."""
    ps = _params()
    rescue = graph_pool.GradRescue(0, ps)
    rescue.observe()
    held = [p.grad for p in ps]
    assert rescue.release() == 0 and all(p.grad is g for p, g in zip(ps, held))
    del held  # the loop holds no reference of its own: zero_grad drops them
    for step in range(graph_pool.LEARN):
        _backward(ps, step)
        rescue.observe()
    assert not rescue.copying
    assert rescue.release() == sum(p.numel() * p.element_size() for p in ps)
    assert all(p.grad is None for p in ps)
    assert rescue.release() == 0  # nothing left to free


def test_release_never_frees_what_an_accumulating_loop_keeps():
    """Two micro-batches per step with zero_grad after the first one's forward: the gradients alive at the second
    forward are the first backward's and are added to, so the loop is never learned and nothing is released."""
    ps = _params()
    rescue = graph_pool.GradRescue(0, ps)
    for step in range(6):
        rescue.observe()
        assert rescue.release() == 0 and all(p.grad is not None for p in ps)
        if step % 2 == 0:
            _backward(ps, step)  # zero_grad after the first micro-batch's forward, then its backward
        else:
            for p in ps:
                p.grad.add_(1.0)  # the second backward accumulates into them
    assert rescue.copying


def _grads_at_forward(net: nn.Module) -> list[bool]:
    """Per training call of `net`: whether every parameter's gradient was None while its forward ran."""
    seen: list[bool] = []
    net[0].register_forward_pre_hook(lambda m, a: seen.append(all(p.grad is None for p in net.parameters()))
                                     if torch.is_grad_enabled() else None)
    return seen


@pytest.mark.parametrize("release", [True, False])
def test_a_trial_runs_without_the_gradients_its_loop_drops_after_the_forward(monkeypatch, tmp_path, release):
    """The tutorial loop's order (forward, zero_grad, backward, step): once learned, each of the trial's forwards
    starts with the gradients already None, as zero_grad would leave them a line later, and the run trains exactly
    as without the release. release_grads=False keeps them until the script's zero_grad."""
    from automp.runtime.decisions import Route
    from automp.runtime.trial import TrialConfig
    from .sessions import train_mlp
    # no candidate dropped, whatever the timings: both runs take the same paths at the same steps
    inject(monkeypatch, candidates=candidates([Route.EAGER_LOW, Route.FP32]),
           trial_config=TrialConfig(give_up=100.0, give_up_first=100.0, measure=8))
    runs = []
    for on in (release, not release):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        seen = _grads_at_forward(net)
        automp.enable(dtype="bf16", cache_dir=str(tmp_path / str(on)), path="auto", release_grads=on)
        losses = train_mlp(net, steps=8)
        in_trial = automp._session.roots[net].path is None
        rep = automp.disable()
        runs.append((losses, [p.detach().clone() for p in net.parameters()]))
        if on is release:
            mine, settings, trial_left = seen, {s["setting"] for s in rep["settings"]}, in_trial
    assert trial_left, "the trial must still run for every call of this test"
    first = graph_pool.LEARN + 1  # the first call has no gradient, and LEARN drops teach the loop
    assert mine[first + 1:] == [release] * len(mine[first + 1:]) and not any(mine[1:first])
    assert ("gradients set to None as a trial's forward starts" in settings) is release
    assert runs[0][0] == runs[1][0] and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
