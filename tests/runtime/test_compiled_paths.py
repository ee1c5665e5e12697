"""The compiled paths automp builds for a root module (automp.runtime.compiled_paths): stock Inductor with autocast
entered around the compiled call as a hand-written loop does, and closures that leave the model collectable."""
import pytest
import torch
import torch.nn as nn

import automp
from automp.runtime.decisions import GRAPHS_OFF

from .sessions import inject

pytestmark = pytest.mark.usefixtures("fresh_session")


def test_autocast_compiled_path_enters_autocast_outside_the_graph(monkeypatch):
    """As a hand-written `with autocast(): compiled(x)`: entered inside the compiled function instead, the graph holds
    the autocast region and compiled differently on an H100 (BERT-base MLM: GEMMs the loop runs in bf16 ran in FP32)."""
    import torch._inductor.compile_fx as compile_fx
    graphs = []

    def capture(gm, example_inputs, config_patches=None, **kwargs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(compile_fx, "compile_fx", capture)
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)), torch.randn(16, 64)
    ref = net(x)
    automp.enable(dtype="bf16", path="autocast-compile")
    out = net(x)
    automp.disable()
    (gm,) = graphs
    assert not [n for n in gm.graph.nodes if "autocast" in str(n.target).lower()]
    assert 1e-5 < (out - ref).norm() / ref.norm() < 1e-2  # the matmuls did run in bf16


def test_the_compile_cache_key_names_the_ambient_autocast_dtype(monkeypatch):
    """torch before 2.13 keys AOTAutograd's cache on autocast being on, not on its dtype: an fp16 run was served the
    graphs a bf16 run had compiled (ResNet-50 on an H100, torch 2.11). The stock path adds the dtype to the key's tag,
    and keeps the user's own."""
    import torch._inductor.compile_fx as compile_fx
    tags = []

    def capture(gm, example_inputs, config_patches=None, **kwargs):
        tags.append(torch.compiler.config.cache_key_tag)
        return gm.forward

    monkeypatch.setattr(compile_fx, "compile_fx", capture)
    net, x = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 16)
    with torch.compiler.config.patch(cache_key_tag="users-own"):
        for dtype in ("bf16", "fp16"):
            automp.enable(dtype=dtype, path="autocast-compile")
            net(x)
            automp.disable()
        assert torch.compiler.config.cache_key_tag == "users-own"
    assert tags == ["users-own|automp-autocast=cpu:torch.bfloat16", "users-own|automp-autocast=cpu:torch.float16"]


def test_fp16_after_bf16_in_one_process_computes_in_fp16():
    """The same model compiled under bf16 and then fp16, caches on: fp16's 10 mantissa bits must show in the error
    against a float64 reference (bf16 has 7), which a graph reused from the bf16 compile would not."""
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64)), torch.randn(32, 256)
    ref = net.double()(x.double())
    net.float()
    err = {}
    for dtype in ("bf16", "fp16"):
        automp.enable(dtype=dtype, path="autocast-compile")
        out = net(x)
        automp.disable()
        err[dtype] = ((out.double() - ref).norm() / ref.norm()).item()
    assert 1e-4 < err["fp16"] < err["bf16"] / 3, err


def test_a_model_that_ran_a_trial_is_freed_after_disable(monkeypatch):
    """Dynamo keeps compiled functions and backends in process-wide caches: nothing it keeps may hold the model. Before
    the fix the compile closures held the module's Root (automp.runtime.paths), whose parameter list kept the model and
    its gradients alive (H100, zoo LSTM: +0.28 GiB in the next run of the same process)."""
    import gc
    import weakref

    from automp.runtime.decisions import Route

    paths = [Route.EAGER_LOW, Route.COMPILED, Route.COMPILED_AUTOCAST, Route.GRAPHED, Route.FP32]
    inject(monkeypatch, candidates=lambda device, low: (paths, "test: every path"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(net.parameters())
    x = torch.randn(8, 16)
    automp.enable(dtype="bf16", inner="eager", spec="h100")
    ran = set()
    for _ in range(60):
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        root = automp._session.roots[net]
        ran.add(root.path or root.trial.current)
        if automp.settled():
            break
    automp.disable()
    assert set(paths) <= ran  # every path ran, the compiled ones included
    param = weakref.ref(net[0].weight)
    del net, opt, root
    gc.collect()
    assert param() is None


def test_graphed_path_hands_the_script_copies_of_what_the_graph_returns(monkeypatch):
    """A CUDA graph's replay writes its outputs into the same memory each time. Simulated here by a backend that
    returns static buffers (on a CPU Inductor runs no CUDA graphs): without the copy, the first call's output would
    silently become the second call's."""
    import torch._inductor.compile_fx as compile_fx
    from automp.runtime.compiled_paths import GRAPH_PATCHES
    patches = []

    def replayed(gm, example_inputs, config_patches=None, **kwargs):
        patches.append(config_patches)
        static = []

        def run(*args):
            outs = gm.forward(*args)
            if not static:
                static.extend(torch.empty_like(o) for o in outs)
            for buffer, o in zip(static, outs):
                buffer.copy_(o)
            return type(outs)(static)
        return run

    monkeypatch.setattr(compile_fx, "compile_fx", replayed)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    xs = [torch.randn(16, 32) for _ in range(3)]
    automp.enable(dtype="bf16", path="autocast-graphs")
    with torch.no_grad():
        outs = [net(x) for x in xs]
    rep = automp.disable()
    assert patches == [GRAPH_PATCHES]
    assert [c["path"] for c in rep["choices"]] == ["autocast-graphed"]
    with torch.no_grad():
        for out, x in zip(outs, xs):
            ref = net(x)
            assert out.dtype == torch.float32 and 1e-5 < (out - ref).norm() / ref.norm() < 1e-2


def test_graphed_path_trains_like_the_autocast_compiled_path():
    """Gradients flow through the copy; the path compiles the same graphs as autocast-compiled (on a CPU Inductor
    skips the CUDA graphs and says why), so a training step matches FP32 within bf16's tolerance."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    ref_net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    ref_net.load_state_dict(net.state_dict())
    x = torch.randn(16, 32)
    ref_net(x).pow(2).mean().backward()
    automp.enable(dtype="bf16", path="autocast-graphs")
    net(x).pow(2).mean().backward()
    automp.disable()
    for p, r in zip(net.parameters(), ref_net.parameters()):
        assert 1e-6 < (p.grad - r.grad).norm() / r.grad.norm() < 3e-2


@pytest.mark.usefixtures("eager_inductor")
@pytest.mark.parametrize("forced", [False, True])
def test_cuda_graphs_are_left_when_a_training_call_recompiles(monkeypatch, tmp_path, forced):
    """A new input shape after the verdict (padded batches of another length) would be recorded again as CUDA graphs
    for every shape: the module moves to the same graphs without them, and the cache keeps that. A path the user
    forced stays."""
    from automp.runtime.decisions import Route
    inject(monkeypatch, candidates=lambda device, low: ([Route.GRAPHED], "test: one candidate"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    automp.enable(dtype="bf16", cache_dir=str(tmp_path), path="autocast-graphs" if forced else "auto")
    for rows in (8, 8, 12, 12):
        net(torch.randn(rows, 16)).pow(2).mean().backward()
    root = automp._session.roots[net]
    rep = automp.disable()
    if forced:
        assert root.path is Route.GRAPHED and [c["path"] for c in rep["choices"]] == ["autocast-graphed"]
        return
    assert root.path is Route.COMPILED_AUTOCAST and root.graphed is None
    (choice,) = rep["choices"]  # the module's latest choice, with why
    assert choice["path"] == "autocast-compiled" and choice["rule"] == GRAPHS_OFF
    automp.enable(dtype="bf16", cache_dir=str(tmp_path))  # the next run starts without CUDA graphs
    net(torch.randn(8, 16))
    assert automp._session.roots[net].path is Route.COMPILED_AUTOCAST
    automp.disable()


def _settle_mlp(tmp_path) -> tuple[int, dict]:
    """An MLP trained under automp (bf16) until its trial settles: the graphs its root compiled, and the report."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    automp.enable(dtype="bf16", cache_dir=str(tmp_path))
    for _ in range(60):
        net(torch.randn(8, 16)).pow(2).mean().backward()
        if automp.settled():
            break
    built = automp._session.roots[net].graphs
    return built, automp.disable()


@pytest.mark.usefixtures("eager_inductor")
@pytest.mark.parametrize("share, tried", [(0.3, True), (0.8, False)])
def test_cuda_graphs_are_tried_only_where_the_scripts_memory_leaves_room_for_their_pool(monkeypatch, tmp_path, share,
                                                                                       tried):
    from automp.runtime import compiled_paths
    from automp.runtime.decisions import Route
    total = 80 * 2**30
    monkeypatch.setattr(compiled_paths, "device_memory", lambda device: (int(share * total), total))
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.GRAPHED], "test: two candidates"))
    built, rep = _settle_mlp(tmp_path)
    assert (Route.GRAPHED.value in rep["choices"][0]["timings_ms"]) == tried
    assert built == (2 if tried else 1)  # checked before their first call: not even compiled where they do not fit
    assert ("autocast-graphed not tried: the script has reserved" in rep["choices"][0]["reason"]) != tried


@pytest.mark.usefixtures("eager_inductor")
def test_graphs_whose_early_warmup_leaves_no_room_go_before_any_other_candidate_runs(monkeypatch, tmp_path):
    """With TrialConfig.early_warmup, the graphs' warm-up peaked above the share of the device graphs are tried under: they go at the next
    call, before the compiled candidate runs beside their pool, the gradients in it copied out and the pool given
    back (on the H200, a script at 70% of the card ran out of memory in a later candidate beside that pool)."""
    from automp.runtime import compiled_paths, graph_pool
    from automp.runtime.decisions import Route
    from automp.runtime.session import Session
    from automp.runtime.trial import TrialConfig
    ran, evacuated, released = [], [], []
    monkeypatch.setattr(compiled_paths, "early_pool_fits", lambda device: "autocast-graphed not tried: its warm-up")
    run = Session._run
    monkeypatch.setattr(Session, "_run", lambda self, module, root, path, *a: ran.append(path) or run(
        self, module, root, path, *a))
    evacuate = graph_pool.GradRescue.evacuate
    monkeypatch.setattr(graph_pool.GradRescue, "evacuate", lambda self: evacuated.append(len(ran)) or evacuate(self))
    monkeypatch.setattr(graph_pool.PoolRelease, "attempt",
                        lambda self: released.append(len(ran)) or graph_pool.Release.RELEASED)
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.GRAPHED], "test: two candidates"),
           trial_config=TrialConfig(early_warmup=1))
    _, rep = _settle_mlp(tmp_path)
    assert ran[0] is Route.GRAPHED and Route.GRAPHED not in ran[1:]
    assert evacuated == [1] and released[:1] == [1]  # at the second call, before it ran
    assert rep["choices"][0]["path"] == "autocast-compiled" and "not tried: its warm-up" in rep["choices"][0]["reason"]


@pytest.mark.parametrize("peak, pool, fits", [(40, 30, True), (71, 66, False), (10, 0, True), (130, 0, False)])
def test_the_early_warmups_pool_must_leave_room_for_another_step(monkeypatch, peak, pool, fits):
    """The process's peak so far (the warm-up's), once more beside the pool that stays reserved, within
    EARLY_POOL_SHARE of the device: the near-limit MLP that ran out of memory (71 GiB peak, a 66 GiB pool of 140)
    does not pass; the pool is read from the allocator's segments of private pools on that device."""
    from automp.runtime import compiled_paths as cp
    G, total = 2**30, 140 * 2**30
    monkeypatch.setattr(cp, "device_memory", lambda device: (peak * G, total))
    segments = [{"device": 0, "segment_pool_id": (0, 0), "total_size": 50 * G},  # the general pool: not counted
                {"device": 1, "segment_pool_id": (1, 2), "total_size": 99 * G},  # another device's graphs
                {"device": 0, "segment_pool_id": (1, 1), "total_size": pool * G}]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    why = cp.early_pool_fits(torch.device("cuda", 0))
    assert (why is None) == fits
    assert fits or f"keeps {pool:.1f} of the device's 140.0 GiB" in why
    assert cp.early_pool_fits(torch.device("cpu")) is None


def test_graphs_fit_names_the_memory_it_found():
    from automp.runtime.compiled_paths import graphs_fit
    assert graphs_fit(30 * 2**30, 80 * 2**30) is None
    assert "up to 50.0 of the device's 80.0 GiB" in graphs_fit(50 * 2**30, 80 * 2**30)


def _two_candidates(monkeypatch):
    from automp.runtime.decisions import Route
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.GRAPHED], "test: two candidates"))


@pytest.mark.usefixtures("eager_inductor")
def test_cuda_graphs_are_not_tried_for_two_modules_trained_together(monkeypatch, tmp_path):
    """A GAN: cudagraph trees reuse one module's graph memory when the other's backward runs (the zoo's DCGAN crashed
    on an H100), so neither module's trial builds CUDA graphs."""
    from automp.runtime.decisions import Route
    _two_candidates(monkeypatch)
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 1))
    automp.enable(dtype="bf16", cache_dir=str(tmp_path))
    for _ in range(60):
        fake = gen(torch.randn(4, 8))
        disc(fake.detach()).mean().backward()
        disc(fake).mean().backward()
        if automp.settled():
            break
    roots = automp._session.roots
    assert all(r.graphed is None and r.path is Route.COMPILED_AUTOCAST for r in roots.values())
    rep = automp.disable()
    assert all(Route.GRAPHED.value not in c["timings_ms"] for c in rep["choices"])


@pytest.mark.usefixtures("eager_inductor")
def test_a_second_module_moves_the_first_off_cuda_graphs(monkeypatch, tmp_path):
    from automp.runtime.decisions import Route
    _two_candidates(monkeypatch)
    inject(monkeypatch, candidates=lambda device, low: ([Route.GRAPHED], "test"))
    torch.manual_seed(0)
    net, head = nn.Sequential(nn.Linear(16, 32), nn.ReLU()), nn.Linear(32, 4)
    automp.enable(dtype="bf16", cache_dir=str(tmp_path))
    net(torch.randn(8, 16)).sum().backward()
    first = automp._session.roots[net]
    assert first.path is Route.GRAPHED
    head(net(torch.randn(8, 16))).sum().backward()
    assert first.path is Route.COMPILED_AUTOCAST and first.graphed is None
    assert first.verdict.rule == GRAPHS_OFF
    automp.disable()


@pytest.mark.usefixtures("eager_inductor")
def test_a_ddp_module_never_runs_cuda_graphs(monkeypatch, tmp_path):
    """Under DDP every rank runs rank 0's path; the memory check and the moves off CUDA graphs are a rank's own."""
    import automp.runtime.session as session
    import automp.runtime.starts as starts
    from automp.runtime.decisions import Route
    inject(monkeypatch, candidates=lambda device, low: (
        [Route.EAGER_LOW, Route.COMPILED_AUTOCAST, Route.GRAPHED], "test: three candidates"))
    monkeypatch.setattr(session, "distributed", lambda: True)
    monkeypatch.setattr(session, "lockstep", lambda module: type(module) is nn.Sequential)
    monkeypatch.setattr(starts, "rank0_start", lambda cached, candidates, why: (cached, candidates, why))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    automp.enable(dtype="bf16", cache_dir=str(tmp_path))
    net(torch.randn(8, 16)).sum().backward()
    root = automp._session.roots[net]
    assert root.lockstep and root.trial.candidates == [Route.EAGER_LOW, Route.COMPILED_AUTOCAST]
    automp.disable()



@pytest.mark.usefixtures("eager_inductor")
def test_cuda_graphs_off_keeps_them_out_of_the_trial_and_of_the_cache_key(monkeypatch, tmp_path):
    """enable(cuda_graphs=False), for a script that needs the memory: no candidate, and no verdict of a run that had
    them (a different cache key); forcing them then is a contradiction, refused before anything is installed."""
    from automp.runtime.decisions import Route
    from automp.config import AutoMPConfig
    inject(monkeypatch, candidates=lambda device, low: (
        [Route.EAGER_LOW, Route.COMPILED_AUTOCAST, Route.GRAPHED], "test: three candidates"))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    keys = {}
    for graphs in (True, False):
        automp.enable(dtype="bf16", cache_dir=str(tmp_path), cuda_graphs=graphs)
        net(torch.randn(8, 16)).sum().backward()
        root = automp._session.roots[net]
        keys[graphs] = root.key
        assert (Route.GRAPHED in root.trial.candidates) == graphs
        automp.disable()
    assert keys[True] != keys[False]
    with pytest.raises(ValueError, match="cuda_graphs=False"):
        AutoMPConfig(path="autocast-graphs", cuda_graphs=False)
    with pytest.raises(TypeError, match="cuda_graphs"):
        AutoMPConfig(cuda_graphs="no")


@pytest.mark.usefixtures("eager_inductor")
def test_many_compiles_in_one_process_stay_under_dynamos_recompile_limit(monkeypatch):
    """Dynamo counts recompiles per code object, up to 8: the stock path's outer function once shared one across
    modules and enable() calls, and on an H100 the ninth compile of a process ran that frame uncompiled. (Dynamo's
    warning is caught by a handler of the test's own: caplog is gone under `pytest -p no:logging`.)"""
    import logging
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        for i in range(10):
            net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            automp.enable(dtype="bf16", path="autocast-compile")
            net(torch.randn(4, 8)).sum().backward()
            automp.disable()
    finally:
        logger.removeHandler(handler)
    assert not [m for m in messages if "recompile_limit" in m or "cache_size_limit" in m]


@pytest.mark.usefixtures("eager_inductor")
@pytest.mark.parametrize("host_ms, tried", [(60.0, False), (80.0, True)])
def test_cuda_graphs_are_not_recorded_where_the_host_issues_the_compiled_step_far_ahead_of_the_device(
        monkeypatch, tmp_path, host_ms, tried):
    """A device-bound step (the host done issuing it long before the device is done running it) gains nothing from
    CUDA graphs, which shorten only the launches: they are neither compiled, recorded nor timed, and the verdict's
    bounds say why, with the measured share. A step whose host work is most of it
    keeps them in the trial."""
    from automp.runtime import paths
    from automp.runtime.decisions import GRAPHS_DEVICE_BOUND, Route
    from automp.runtime.session import Session
    clock = {"now": 0.0, "done": 0.0}  # seconds: the host's time, and when the device finishes what it was given
    run = Session._run

    def timed_run(self, module, root, path, args, kwargs):
        out = run(self, module, root, path, args, kwargs)
        clock["done"] = max(clock["done"], clock["now"]) + 0.1  # the device's 100 ms a step, on every path
        clock["now"] += host_ms / 1e3
        return out

    monkeypatch.setattr(Session, "_run", timed_run)
    monkeypatch.setattr(paths, "sync_for", lambda device: lambda: clock.update(now=max(clock["now"], clock["done"])))
    inject(monkeypatch, candidates=lambda device, low: ([Route.COMPILED_AUTOCAST, Route.GRAPHED], "test"),
           clock=lambda: clock["now"])
    built, rep = _settle_mlp(tmp_path)
    (choice,) = rep["choices"]
    assert (Route.GRAPHED.value in choice["timings_ms"]) == tried
    assert built == (2 if tried else 1)  # judged before the graphed path's first call
    if not tried:
        assert choice["path"] == Route.COMPILED_AUTOCAST.value
        assert choice["bounds"][Route.GRAPHED.value] == {"rule": GRAPHS_DEVICE_BOUND, "host_share": 0.6, "limit": 0.7}


def _float64_net():
    """A small MLP in float64, an input, and its eager gradients (what both compiled paths must reproduce)."""
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 24)).double(), torch.randn(10, 48).double()
    net(x).square().sum().backward()
    return net, x, [p.grad.clone() for p in net.parameters()]


def _trains_as_eager(compiled, net, x, ref):
    net.zero_grad(set_to_none=True)
    compiled(x).square().sum().backward()
    for p, r in zip(net.parameters(), ref):
        assert (p.grad - r).norm() / r.norm() < 1e-10


@pytest.mark.parametrize("first", ["graphed", "plain"])  # a trial warms the graphed path up first (early_warmup)
def test_the_plain_and_graphed_paths_share_one_compile_where_torch_has_graph_policies(monkeypatch, tmp_path, first):
    """A trial compiles the same graphs for the compiled and the graphed path. Keyed alike (CUDA graphs on for both,
    the plain path's policy wrapping none), the second compile is loaded from Inductor's and AOTAutograd's caches,
    and it computes what the eager model does; where torch has no policy, or off CUDA, the plain path compiles as
    torch.compile does."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    from automp.runtime import compiled_paths as cp
    assert cp.compile_patches(False, "cpu") == {} and cp.compile_patches(True, "cpu") == cp.GRAPH_PATCHES
    if cp._unwrapped_policy() is None:
        pytest.skip("torch without cudagraph_policy (before 2.13)")
    plain, graphed = cp.compile_patches(False, "cuda"), cp.compile_patches(True, "cuda")
    assert plain["cudagraph_policy"].should_wrap(None) is False and "cudagraph_policy" not in graphed
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    net, x, ref = _float64_net()
    counters.clear()
    for patches in (graphed, plain) if first == "graphed" else (plain, graphed):
        torch._dynamo.reset()
        compiled = torch.compile(net, backend=lambda gm, ex, patches=patches: compile_fx(gm, ex, config_patches=patches))
        _trains_as_eager(compiled, net, x, ref)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1  # the second path's forward and backward: loaded
    assert counters["inductor"]["fxgraph_cache_hit"] == 2 and counters["inductor"]["fxgraph_cache_miss"] == 2
    monkeypatch.setattr(cp, "_unwrapped_policy", lambda: None)
    monkeypatch.setattr(cp, "_post_compile_flag", lambda: False)  # neither way to leave graphs unwrapped
    assert cp.compile_patches(False, "cuda") == {}


@pytest.mark.parametrize("order", [(True, False), (False, True)])  # graphed first: a trial's early warm-up
def test_before_graph_policies_the_plain_path_compiles_graphed_and_is_left_unwrapped(monkeypatch, tmp_path, order):
    """torch without cudagraph_policy (2.11, 2.12; here by patching it away): the plain path compiles with CUDA graphs
    on, as the graphed one does, so that the graphed path's compile is a cache hit; `unwrapped` turns the compile's
    cudagraphs box off as each graph is post-compiled (forward and backward), and puts CompiledFxGraph back after."""
    from torch._dynamo.utils import counters
    from torch._inductor.output_code import CompiledFxGraph

    from automp.runtime import compiled_paths as cp
    monkeypatch.setattr(cp, "_unwrapped_policy", lambda: None)
    if not cp._post_compile_flag():
        pytest.skip("this torch's post_compile takes no cudagraphs box")
    assert cp.compile_patches(False, "cuda") == cp.GRAPH_PATCHES == cp.compile_patches(True, "cuda")
    assert cp.compile_patches(False, "cpu") == {}
    original = CompiledFxGraph.__dict__["post_compile"]
    boxes = []

    def spy(self, example_inputs, constants, graph_kwargs):
        boxes.append(bool(graph_kwargs["cudagraphs"]))
        return original(self, example_inputs, constants, graph_kwargs)
    monkeypatch.setattr(CompiledFxGraph, "post_compile", spy)
    monkeypatch.setattr(cp, "UNWRAPPED_FAILED", [])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    net, x, ref = _float64_net()
    counters.clear()
    seen = {}
    for graphs in order:
        torch._dynamo.reset()
        boxes.clear()
        compiled = torch.compile(net, backend=lambda gm, ex, graphs=graphs: cp.inductor_compile(gm, ex, graphs, "cuda"))
        _trains_as_eager(compiled, net, x, ref)
        seen[graphs] = list(boxes)
        assert CompiledFxGraph.__dict__["post_compile"] is spy  # put back after each compile
    assert cp.UNWRAPPED_FAILED == []  # no compile fell back
    assert seen[False] and not any(seen[False])  # every graph of the plain path: post-compiled with a box off
    # the graphed path's forward loaded from the cache: on (compiled, torch turns it off itself for a CPU graph)
    assert seen[True][0] or order[0]
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1  # the second path's forward and backward: loaded
    assert counters["inductor"]["fxgraph_cache_hit"] == 2 and counters["inductor"]["fxgraph_cache_miss"] == 2


def test_unwrapped_post_compiles_with_a_box_of_its_own_and_leaves_the_compiles_box_on(monkeypatch):
    """The compile's box is shared by its forward and its backward, which AOTAutograd compiles at its first call: turned
    off by the forward's post-compile, the backward would compile without the facts (`cudagraph_info`) that the graphed
    path needs when it loads that backward from AOTAutograd's cache (torch 2.11 asserts, then compiles both again). The
    lazy backward is compiled inside the same patch (`_unwrapped_inner`), so its post-compile wraps nothing either."""
    from torch._inductor.output_code import CompiledFxGraph
    from torch._inductor.utils import BoxedBool

    from automp.runtime import compiled_paths as cp
    got = []
    monkeypatch.setattr(CompiledFxGraph, "post_compile", lambda self, ex, consts, kw: got.append(bool(kw["cudagraphs"])))
    box = BoxedBool(True)
    with cp._post_compile_unwrapped():
        CompiledFxGraph.post_compile(None, [], None, {"cudagraphs": box, "is_backward": False})
    assert got == [False] and bool(box)

    def backward_compile(gm, example_inputs, **kwargs):  # AOTAutograd's lazy call, after the backend has returned
        return CompiledFxGraph.post_compile(None, example_inputs, None, kwargs)
    cp._unwrapped_inner(backward_compile)(None, [], cudagraphs=box, is_backward=True)
    assert got == [False, False] and bool(box)
    CompiledFxGraph.post_compile(None, [], None, {"cudagraphs": box})  # the patch is gone after each
    assert got == [False, False, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graphs")
def test_on_a_gpu_the_plain_path_records_no_cuda_graph_and_the_graphed_one_loads_its_compile(tmp_path, monkeypatch):
    """The plain path compiled with CUDA graphs on in its config (for the shared cache key) is not wrapped: no graph
    function replays into the trees after it runs; the graphed path's compile is then a cache hit and it is wrapped."""
    from torch._dynamo.utils import counters

    from automp.runtime import compiled_paths as cp
    from automp.runtime import graph_pool
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees
    reset_cudagraph_trees()
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16)).cuda(), torch.randn(32, 64).cuda()
    counters.clear()
    functions = {}
    for graphs in (False, True):
        torch._dynamo.reset()

        compiled = torch.compile(net, backend=lambda gm, ex, graphs=graphs: cp.inductor_compile(gm, ex, graphs, "cuda"))
        for _ in range(3):
            net.zero_grad(set_to_none=True)
            compiled(x).square().sum().backward()
        functions[graphs] = graph_pool.graph_functions(0)
    assert functions[False] == 0 and functions[True] > 0, functions
    # the graphed compile loads the plain one's from AOTAutograd's cache (a bypass there compiles both graphs again)
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1, (dict(counters["aot_autograd"]),
                                                                 dict(counters["inductor"]))
    torch._dynamo.reset()
    reset_cudagraph_trees()


def test_a_compile_that_fails_unwrapped_compiles_as_torch_does_and_the_process_gives_the_sharing_up(monkeypatch):
    """A torch whose post_compile is not as `unwrapped` expects costs a second compile, never the compiled path."""
    import contextlib

    from automp.runtime import compiled_paths as cp
    monkeypatch.setattr(cp, "_unwrapped_policy", lambda: None)
    monkeypatch.setattr(cp, "_post_compile_flag", lambda: True)
    monkeypatch.setattr(cp, "UNWRAPPED_FAILED", [])

    @contextlib.contextmanager
    def broken(graphs, device_type):
        raise RuntimeError("post_compile is not what it was")
        yield
    monkeypatch.setattr(cp, "unwrapped", broken)
    assert cp.compile_patches(False, "cuda") == cp.GRAPH_PATCHES
    net, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), torch.randn(4, 8)
    torch._dynamo.reset()
    compiled = torch.compile(net, backend=lambda gm, ex: cp.inductor_compile(gm, ex, False, "cuda"))
    assert torch.allclose(compiled(x), net(x), atol=1e-6)
    assert cp.UNWRAPPED_FAILED == ["RuntimeError: post_compile is not what it was"]
    assert cp.compile_patches(False, "cuda") == {}  # given up: the plain path compiles on its own from now on
    torch._dynamo.reset()
