"""A calibration decides every later run from the cache, so only a measurement that holds up is written: each bench
is warmed up and timed repeatedly, the median is taken, and noisy or absurd figures serve this run only."""
import json

import pytest
import torch

from automp.precision import calibrate
from tests.precision.test_calibrate import RATES, FakeTimer

CPU = torch.device("cpu")


class ScheduledTimer(FakeTimer):
    """FakeTimer's times, multiplied call by call for one bench by `schedule` (warmup first), 1x once it runs out."""

    def __init__(self, bench, schedule):
        super().__init__()
        self.bench, self.schedule = bench, list(schedule)

    def __call__(self, bench):
        t = super().__call__(bench)
        if (bench.kind, bench.dtype, bench.bucket) == self.bench and self.schedule:
            t *= self.schedule.pop(0)
        return t


FP32_SMALL = ("gemm", "float32", "small")


def test_each_bench_is_warmed_up_and_the_median_of_its_runs_is_used():
    # a 50x cold run, then five runs: two stalled ones, on either side of the median, do not move it
    timer = ScheduledTimer(FP32_SMALL, [50.0, 1.0, 30.0, 1.25, 0.8, 20.0])
    cal = calibrate.measure(CPU, timer=timer)
    assert timer.calls.count(FP32_SMALL) == 1 + calibrate.REPEATS
    assert cal.gemm_tflops["float32"]["small"] == pytest.approx(RATES["float32"] / 1.25)
    assert cal.doubts == ()  # the median is 1.56x the fastest run: within SPREAD_LIMIT


def test_a_slow_bench_is_timed_fewer_times():
    slow = calibrate.SLOW_RUN_S / (2.0 * 256 ** 3 / (RATES["float32"] * 1e12))  # makes a run take SLOW_RUN_S
    timer = ScheduledTimer(FP32_SMALL, [slow * 2] * 10)
    calibrate.measure(CPU, timer=timer)
    assert timer.calls.count(FP32_SMALL) == 1 + calibrate.SLOW_REPEATS


def test_a_sane_calibration_is_cached(tmp_path, recwarn):
    cal = calibrate.load_or_measure(CPU, tmp_path, timer=FakeTimer())
    assert cal.doubts == () and not [w for w in recwarn if "calibration" in str(w.message)]
    stored = json.loads(calibrate.cache_path(CPU, tmp_path).read_text(encoding="utf-8"))
    assert "doubts" not in stored and calibrate.from_json(stored) == cal


@pytest.mark.parametrize("bench, schedule, doubt", [
    # three of five runs stalled: the median itself is noise
    (FP32_SMALL, [1.0, 1.0, 40.0, 1.0, 40.0, 40.0], "median run took 40.0x the fastest"),
    # every bf16 run slowed 1000x (load that lasted through the whole bench): bf16 would read 1/8000 of FP32
    (("gemm", "bfloat16", "small"), [1000.0] * 6, "bfloat16 GEMMs ran 0.000125x as fast as float32"),
    (("copy", "float32", ""), [1.0, 1.0, 9.0, 9.0, 1.0, 9.0], "the copy: the median run took 9.0x"),
], ids=["spread", "ratio", "copy"])
def test_a_doubtful_calibration_is_used_for_this_run_and_not_cached(tmp_path, bench, schedule, doubt):
    with pytest.warns(RuntimeWarning, match="for this run only and not cached") as caught:
        cal = calibrate.load_or_measure(CPU, tmp_path, timer=ScheduledTimer(bench, schedule))
    assert any(doubt in d for d in cal.doubts), cal.doubts
    assert doubt in str(caught[0].message)
    assert not calibrate.cache_path(CPU, tmp_path).exists() and list(tmp_path.iterdir()) == []
    timer = FakeTimer()  # the next run measures again, and caches what holds up
    clean = calibrate.measure(CPU, timer=FakeTimer()).gemm_tflops
    assert calibrate.load_or_measure(CPU, tmp_path, timer=timer).gemm_tflops == clean
    assert timer.calls and calibrate.cache_path(CPU, tmp_path).is_file()


def test_a_cached_calibration_with_an_absurd_ratio_is_measured_again(tmp_path):
    """A file written by hand or by an older measurement that no device could have produced is not trusted."""
    cal = calibrate.measure(CPU, timer=FakeTimer())
    absurd = {**cal.gemm_tflops, "float16": {"small": cal.gemm_tflops["float32"]["small"] / 5000}}
    text = json.dumps({"schema": calibrate.SCHEMA, **{**calibrate.asdict(cal), "gemm_tflops": absurd}})
    calibrate.cache_path(CPU, tmp_path).write_text(text, encoding="utf-8")
    timer = FakeTimer()
    assert calibrate.load_or_measure(CPU, tmp_path, timer=timer).gemm_tflops == cal.gemm_tflops and timer.calls


def test_a_steadily_slow_emulated_dtype_is_cached(tmp_path):
    """bf16 emulated on a CPU without native support: 1/190 of FP32, run after run. That is the device, not noise,
    and measuring it again every run would cost seconds each time."""
    factor = RATES["bfloat16"] * 190 / RATES["float32"]  # turns FakeTimer's bf16 rate into 1/190 of FP32's
    timer = ScheduledTimer(("gemm", "bfloat16", "small"), [factor] * 6)
    cal = calibrate.load_or_measure(CPU, tmp_path, timer=timer)
    assert cal.gemm_tflops["bfloat16"]["small"] == pytest.approx(RATES["float32"] / 190)
    assert cal.doubts == () and calibrate.cache_path(CPU, tmp_path).is_file()
