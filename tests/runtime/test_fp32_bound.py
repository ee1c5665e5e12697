"""FP32 eager ruled out before it runs (automp.runtime.fp32_bound): the GEMM count on the low-precision eager path, and
sessions whose trials are driven by an injected clock and an injected FP32 rate."""
import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import flop_registry

from automp.config import AutoMPConfig
from automp.precision.calibrate import Calibration
from automp.runtime import fp32_bound
from automp.runtime.fp32_bound import Fp32Floor, GemmCount
from automp.runtime.starts import CalibratedCandidates
from automp.runtime.session import Session
from automp.runtime.decisions import Route
from automp.runtime.trial import TrialConfig

from .sessions import candidates

# nn.Sequential(Linear(16, 32), ReLU, Linear(32, 4)) on a batch of 8: 2*8*16*32 + 2*8*32*4 forward FLOPs. Backward:
# the first layer's weight gradient (its input needs none), both gradients of the second layer.
FORWARD, BACKWARD = 8192 + 2048, 8192 + 2 * 2048


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(8, 16)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_count_has_the_forward_gemms_and_the_backward_gemms_that_ran(autocast):
    net, x = _mlp()
    count = GemmCount()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = count.run(net, lambda: net(x))
    assert (count.forward, count.backward) == (FORWARD, 0)  # no backward yet: none counted
    out.float().sum().backward()
    assert (count.forward, count.backward) == (FORWARD, BACKWARD) and count.error is None


def test_calls_without_grad_count_no_backward_and_a_restricted_backward_counts_what_it_computed():
    net, x = _mlp()
    count = GemmCount()
    with torch.no_grad():
        count.run(net, lambda: net(x))
    assert (count.forward, count.backward) == (FORWARD, 0)
    count = GemmCount()
    out = count.run(net, lambda: net(x))
    torch.autograd.grad(out.sum(), [net[2].weight])  # only the last layer's weight gradient: one GEMM
    assert count.backward == 2048


def test_a_failing_flop_formula_leaves_the_forward_as_it_was_and_is_recorded(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no formula for this")

    monkeypatch.setitem(flop_registry, torch.ops.aten.addmm, broken)
    net, x = _mlp()
    count = GemmCount()
    out = count.run(net, lambda: net(x))
    assert torch.equal(out, net(x)) and count.error == "RuntimeError: no formula for this"


def test_a_root_with_parameters_that_are_not_fp32_is_not_bounded():
    net, x = _mlp()
    net[0].to(torch.bfloat16)  # a frozen half-precision part runs low precision as written too
    count = GemmCount()
    count.run(net, lambda: net[2](torch.relu(net[0](x.bfloat16()).float())))
    record, why = Fp32Floor(1.0).judge(count, 1, 0.001, 1, 1.3, Route.EAGER_LOW.value)
    assert record == {"rule": fp32_bound.MIXED_PARAMETERS} and why is None


@pytest.mark.parametrize("tflops, seconds, rule", [(1e-6, 0.010, fp32_bound.RULED_OUT),  # 22.5 ms > 1.3 x 10 ms
                                                   (1e-6, 0.020, fp32_bound.NOT_RULED_OUT),  # 22.5 ms < 26 ms
                                                   (1.0, 0.010, fp32_bound.NOT_RULED_OUT)])
def test_the_bound_against_give_up_times_the_iteration_after_the_count(tflops, seconds, rule):
    count = GemmCount()
    count.forward, count.backward = 2 * FORWARD, 2 * BACKWARD  # two iterations counted, three timed after them
    record, why = Fp32Floor(tflops).judge(count, 2, 3 * seconds, 3, 1.3, Route.EAGER_LOW.value)
    assert record["rule"] == rule and (why is not None) == (rule == fp32_bound.RULED_OUT)
    assert record["forward_gemm_flops"] == FORWARD and record["backward_gemm_flops"] == BACKWARD
    assert record["bound_ms"] == pytest.approx(1e3 * (FORWARD + BACKWARD) / (tflops * 1e12))
    assert record["against_ms"] == pytest.approx(1e3 * seconds) and record["against"] == Route.EAGER_LOW.value


def test_fp32_matmuls_in_tf32_are_not_bounded_by_the_fp32_rate(monkeypatch):
    monkeypatch.setattr(fp32_bound, "plain_fp32_matmuls", lambda: False)
    count = GemmCount()
    count.forward = 1e15
    record, _ = Fp32Floor(1.0).judge(count, 1, 0.001, 1, 1.3, Route.EAGER_LOW.value)
    assert record == {"rule": fp32_bound.REDUCED_PRECISION}


def test_the_calibrated_rate_is_the_fastest_fp32_bucket_on_cuda_only_and_never_a_doubted_one():
    def calibration(device, doubts=()):
        return Calibration(device=device, torch_version=torch.__version__, bandwidth_gbps=10.0, launch_us=5.0,
                           gemm_tflops={"float32": {"small": 20.0, "large": 51.0}, "bfloat16": {"large": 700.0}},
                           measured_at="2026-01-01T00:00:00Z", doubts=doubts)

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    calibrated = CalibratedCandidates("/nonexistent")
    assert calibrated.fp32_tflops(cuda) is None  # not calibrated yet
    calibrated.calibrations[cuda], calibrated.calibrations[cpu] = calibration("cuda: H100"), calibration("cpu: x")
    assert calibrated.fp32_tflops(cuda) == 51.0 and calibrated.fp32_tflops(cpu) is None
    calibrated.calibrations[cuda] = calibration("cuda: H100", ("the copy: the median run took 4.7x the fastest",))
    assert calibrated.fp32_tflops(cuda) is None


# per-iteration cost of each path on the fake clock: FP32 eager is the fastest, were it run
COST = {Route.EAGER_LOW: 0.010, Route.COMPILED: 0.008, Route.FP32: 0.005}


def _run_script(monkeypatch, paths, tflops: float, iterations: int, first_extra: float = 1.0):
    """A training loop under a session whose trial is of `paths`, clocked by COST, with an FP32 rate of `tflops`:
    the path each call ran, and the report. The first iteration costs `first_extra` more (a process's set-up)."""
    now = [0.0]
    session = Session(AutoMPConfig(dtype="bf16", inner="eager", spec="h100"), trial_config=TrialConfig(),
                      clock=lambda: now[0], candidates=candidates(paths), fp32_rate=lambda device: tflops)
    session.install()
    ran = []
    real_run = session._run
    monkeypatch.setattr(session, "_run", lambda module, root, path, a, k: ran.append(path) or real_run(
        module, root, path, a, k))
    net, x = _mlp()
    try:
        for i in range(iterations):
            out = net(x)
            now[0] += COST[ran[-1]] + (first_extra if i == 0 else 0.0)
            out.sum().backward()
            if session.settled():
                break
        assert session.settled()
    finally:
        report = session.uninstall()
    return ran, report


@pytest.mark.parametrize("paths", [[Route.EAGER_LOW, Route.COMPILED, Route.FP32], [Route.FP32, Route.EAGER_LOW]])
def test_fp32_eager_bounded_above_a_low_precision_iteration_never_runs(monkeypatch, fresh_session, paths):
    """22.5 kFLOP per iteration at 1e-6 TFLOP/s: at least 22.5 ms, over 1.3x low precision eager's 10 ms (its second
    warm-up iteration: the counted first one took a second here, as a process's first iteration does). FP32 eager is
    neither warmed up, timed nor re-measured (the confirmation has no FP32 timing to re-measure), even where the
    candidates list it first (a CPU's order): low precision eager warms up before it."""
    ran, report = _run_script(monkeypatch, paths, tflops=1e-6, iterations=80)
    assert Route.FP32 not in ran and ran[0] is Route.EAGER_LOW
    (choice,) = report["choices"]
    assert choice["path"] == (Route.COMPILED if Route.COMPILED in paths else Route.EAGER_LOW).value
    assert Route.FP32.value not in choice["timings_ms"]
    assert choice["confirmed"] == (Route.COMPILED in paths)  # re-measured against low precision eager only
    bound = choice["bounds"][Route.FP32.value]
    assert bound["rule"] == fp32_bound.RULED_OUT and bound["against"] == Route.EAGER_LOW.value
    assert (bound["forward_gemm_flops"], bound["backward_gemm_flops"], bound["fp32_tflops"]) == (FORWARD, BACKWARD,
                                                                                                 1e-6)
    assert bound["bound_ms"] == pytest.approx(1e3 * (FORWARD + BACKWARD) / 1e6)
    assert bound["against_ms"] == pytest.approx(10.0)


def test_fp32_eager_within_the_bound_still_runs_and_wins(monkeypatch, fresh_session):
    ran, report = _run_script(monkeypatch, [Route.EAGER_LOW, Route.COMPILED, Route.FP32], tflops=1.0, iterations=80)
    assert Route.FP32 in ran
    (choice,) = report["choices"]
    assert choice["path"] == Route.FP32.value
    assert choice["bounds"][Route.FP32.value]["rule"] == fp32_bound.NOT_RULED_OUT


def test_a_count_that_fails_keeps_fp32_eager_and_says_so(monkeypatch, fresh_session):
    def broken(*args, **kwargs):
        raise RuntimeError("no formula for this")

    monkeypatch.setitem(flop_registry, torch.ops.aten.addmm, broken)
    ran, report = _run_script(monkeypatch, [Route.EAGER_LOW, Route.FP32], tflops=1e-6, iterations=40)
    assert Route.FP32 in ran
    (choice,) = report["choices"]
    assert choice["path"] == Route.FP32.value
    assert choice["bounds"][Route.FP32.value] == {"rule": fp32_bound.UNCOUNTED,
                                                 "error": "RuntimeError: no formula for this"}
