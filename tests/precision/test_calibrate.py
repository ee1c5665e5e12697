import dataclasses
import json
import math
import os

import pytest
import torch

from automp.precision import calibrate

CPU = torch.device("cpu")
# TFLOP/s the fake timer pretends each dtype runs at; bf16 is "emulated" (8x slower than FP32)
RATES = {"float32": 2.0, "bfloat16": 0.25, "float16": 3.0}
BANDWIDTH_GBPS = 50.0
LAUNCH_US = 4.0


class FakeTimer:
    """Times proportional to the work of each bench, so measure() must report exactly RATES & co; counts calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, bench):
        self.calls.append((bench.kind, bench.dtype, bench.bucket))
        if bench.kind == "gemm":
            return bench.flops / (RATES[bench.dtype] * 1e12)
        if bench.kind == "copy":
            return bench.bytes_moved / (BANDWIDTH_GBPS * 1e9)
        return bench.reps * LAUNCH_US * 1e-6


def calibration(gemm, device="cpu: test (1 threads)", bandwidth=100.0, launch=2.0):
    return calibrate.Calibration(device=device, torch_version=torch.__version__, gemm_tflops=gemm,
                                 bandwidth_gbps=bandwidth, launch_us=launch, measured_at="2026-01-01T00:00:00+00:00")


def test_measure_with_fake_timer_reports_the_rates_it_was_given():
    timer = FakeTimer()
    cal = calibrate.measure(CPU, timer=timer)
    assert cal.gemm_tflops["float32"] == pytest.approx({"small": 2.0, "medium": 2.0}, rel=1e-12)
    assert cal.gemm_tflops["float16"] == pytest.approx({"small": 3.0, "medium": 3.0}, rel=1e-12)
    # bf16 is 8x slower than FP32 at the small size: emulated, so the medium size is not timed at all
    assert cal.gemm_tflops["bfloat16"] == pytest.approx({"small": 0.25}, rel=1e-12)
    assert ("gemm", "bfloat16", "medium") not in timer.calls
    assert not any(bucket == "large" for _, _, bucket in timer.calls)  # 4096^3 is GPU-only
    assert cal.bandwidth_gbps == pytest.approx(BANDWIDTH_GBPS, rel=1e-12)
    assert cal.launch_us == pytest.approx(LAUNCH_US, rel=1e-12)
    assert cal.device == calibrate.device_name(CPU) and cal.device.startswith("cpu: ")
    assert cal.torch_version == torch.__version__


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "1 ms"])
def test_measure_rejects_a_timer_that_returns_nonsense(bad):
    with pytest.raises(ValueError, match="timer returned"):
        calibrate.measure(CPU, timer=lambda bench: bad)


def test_measure_leaves_fp32_matmul_precision_and_rng_as_they_were():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        torch.manual_seed(1)
        expected = torch.rand(3)
        torch.manual_seed(1)
        calibrate.measure(CPU, timer=FakeTimer())
        assert torch.equal(torch.rand(3), expected)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_cache_round_trip_does_not_measure_again(tmp_path):
    first = calibrate.load_or_measure(CPU, tmp_path, timer=FakeTimer())
    timer = FakeTimer()
    again = calibrate.load_or_measure(CPU, tmp_path, timer=timer)
    assert again == first and timer.calls == []
    assert [p.name for p in tmp_path.iterdir()] == [calibrate.cache_path(CPU, tmp_path).name]  # no temp file left


def test_cache_dir_defaults_to_env(tmp_path, monkeypatch):
    from automp.config import AutoMPConfig  # the one place that reads the variable
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "sub"))
    cache_dir = AutoMPConfig().cache_dir
    calibrate.load_or_measure(CPU, cache_dir, timer=FakeTimer())
    assert calibrate.cache_path(CPU, cache_dir).parent == tmp_path / "sub"
    assert calibrate.cache_path(CPU, cache_dir).is_file()


def test_cache_dir_is_required(tmp_path, monkeypatch):
    """The directory is resolved in one place (automp.config), not again here from the environment."""
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path))
    with pytest.raises(TypeError, match="cache_dir"):
        calibrate.load_or_measure(CPU, None, timer=FakeTimer())
    assert list(tmp_path.iterdir()) == []


def valid_file_content():
    cal = calibrate.measure(CPU, timer=FakeTimer())
    return {"schema": calibrate.SCHEMA, **dataclasses.asdict(cal)}


def corrupt(field, value):
    obj = valid_file_content()
    if isinstance(field, tuple):
        obj[field[0]][field[1]][field[2]] = value
    else:
        obj[field] = value
    return json.dumps(obj)


@pytest.mark.parametrize("text", [
    "\x00garbage{",
    "[1, 2, 3]",
    json.dumps({"device": "cpu"}),
    corrupt("schema", 0),
    corrupt("bandwidth_gbps", -5.0),
    corrupt("launch_us", float("nan")),  # json writes NaN, Python's json reads it back
    corrupt("launch_us", True),
    corrupt("bandwidth_gbps", "fast"),
    corrupt("measured_at", "yesterday"),
    corrupt("gemm_tflops", []),
    corrupt("gemm_tflops", {"bfloat16": {"small": 1.0}}),  # no FP32 baseline
    corrupt(("gemm_tflops", "float32", "small"), -1.0),
    corrupt(("gemm_tflops", "float32", "huge"), 1.0),
    corrupt(("gemm_tflops", "float16", "small"), float("inf")),
], ids=["garbage", "list", "missing-fields", "schema", "negative", "nan", "bool", "str", "date", "gemm-list",
        "no-fp32", "negative-rate", "unknown-bucket", "inf-rate"])
def test_corrupt_cache_is_measured_again_and_rewritten(tmp_path, text):
    path = calibrate.cache_path(CPU, tmp_path)
    path.write_text(text, encoding="utf-8")
    timer = FakeTimer()
    cal = calibrate.load_or_measure(CPU, tmp_path, timer=timer)
    assert timer.calls, "a corrupt cache must be re-measured"
    assert calibrate.from_json(json.loads(path.read_text(encoding="utf-8"))) == cal


@pytest.mark.parametrize("field, value", [("torch_version", "0.0.1"), ("device", "cpu: another CPU (64 threads)")])
def test_stale_cache_is_measured_again(tmp_path, field, value):
    path = calibrate.cache_path(CPU, tmp_path)
    path.write_text(corrupt(field, value), encoding="utf-8")
    timer = FakeTimer()
    cal = calibrate.load_or_measure(CPU, tmp_path, timer=timer)
    assert timer.calls and cal.torch_version == torch.__version__ and cal.device == calibrate.device_name(CPU)
    assert json.loads(path.read_text(encoding="utf-8"))[field] == getattr(cal, field)


def test_cache_dir_that_cannot_be_created_measures_and_warns(tmp_path):
    (tmp_path / "file").write_text("")  # a directory cannot be made under a file, not even by root
    with pytest.warns(RuntimeWarning, match="cannot cache"):
        cal = calibrate.load_or_measure(CPU, tmp_path / "file" / "automp", timer=FakeTimer())
    assert cal.gemm_tflops["float32"]["medium"] == pytest.approx(2.0)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs POSIX permissions, not root")
def test_read_only_cache_dir_measures_and_warns(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.warns(RuntimeWarning, match="cannot cache"):
            cal = calibrate.load_or_measure(CPU, tmp_path, timer=FakeTimer())
    finally:
        tmp_path.chmod(0o700)
    assert cal.bandwidth_gbps == pytest.approx(BANDWIDTH_GBPS)
    assert list(tmp_path.iterdir()) == []  # no temp file left behind either


def test_low_precision_gain_at_largest_common_bucket():
    cal = calibration({"float32": {"small": 1.0, "medium": 2.0, "large": 4.0},
                       "bfloat16": {"small": 8.0, "medium": 30.0, "large": 60.0}, "float16": {"small": 0.5}})
    assert calibrate.low_precision_gain(cal, torch.bfloat16) == 15.0
    assert calibrate.low_precision_gain(cal, torch.float16) == 0.5
    assert calibrate.low_precision_gain(cal, torch.float32) == 1.0
    cpu = calibration({"float32": {"small": 1.0, "medium": 2.0}})
    assert calibrate.low_precision_gain(cpu, torch.float16) == 0.0  # never measured: cannot pay
    with pytest.raises(ValueError):
        calibrate.low_precision_gain(cal, torch.int8)


def check_real(cal, buckets):
    assert set(cal.gemm_tflops["float32"]) == buckets
    rates = [r for per in cal.gemm_tflops.values() for r in per.values()]
    assert all(math.isfinite(x) and x > 0 for x in rates + [cal.bandwidth_gbps, cal.launch_us])
    assert calibrate.from_json(json.loads(json.dumps({"schema": calibrate.SCHEMA, **dataclasses.asdict(cal)}))) == cal


def test_real_measure_on_cpu():
    cal = calibrate.measure(CPU)
    check_real(cal, {"small", "medium"})
    assert {"float32", "bfloat16"} <= set(cal.gemm_tflops)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_measure_on_gpu():
    cal = calibrate.measure(torch.device("cuda"))
    check_real(cal, {"small", "medium", "large"})
    # every low-precision dtype measured in every bucket. How fast Tensor Cores are is a benchmark's question, not
    # a test's: with other work on the GPU (a parallel test run) the float16 rate read 0.2x of FP32's (H100)
    assert {dt: set(per) for dt, per in cal.gemm_tflops.items()} == {
        dt: {"small", "medium", "large"} for dt in ("float32", "float16", "bfloat16")}


def test_default_timer_is_not_sized_by_a_jit_in_the_warmup(monkeypatch):
    # warmup 50 ms (a JIT), then two stalled runs of 8 ms, then the GEMM's own 0.2 ms: sized by the warmup, the timer
    # took two runs and reported 8 ms (a CPU's bf16 measured at 0.06x FP32 that way); it must find the 0.2 ms
    from automp.precision.calibrate import Bench, default_timer
    now = [0.0]
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: now[0])
    durations = iter([0.05, 0.008, 0.008] + [0.0002] * 10)
    bench = Bench("gemm", lambda: now.__setitem__(0, now[0] + next(durations)), 1)
    assert calibrate.timed_median(default_timer(torch.device("cpu")), bench)[0] == pytest.approx(0.0002)


def test_only_a_cpu_is_taken_for_emulating_a_slow_dtype():
    """A CUDA device's small GEMMs are latency-bound and slow under other work: that must not end its measurement."""
    slow, fp32 = 0.2, 1.0  # the float16 rate a shared H100 read at the small size, relative to FP32
    assert calibrate.emulated(torch.device("cpu"), slow, fp32)
    assert not calibrate.emulated(torch.device("cuda"), slow, fp32)
    assert not calibrate.emulated(torch.device("cpu"), 0.5, fp32)  # within EMULATED_SLOWDOWN: timed on
