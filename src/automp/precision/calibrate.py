"""Measure the device automp decides for, instead of trusting a table of datasheet figures.

The built-in DeviceSpecs (cost.py) are peak numbers for a few known devices; an unknown GPU gets the default GPU's
figures and every CPU gets one guess, although CPUs range from emulated bf16 (low precision is slower than FP32) to AMX
(much faster). A few short micro-benchmarks — GEMMs per dtype and size, one large copy, back-to-back tiny kernels — give
the rates this device really reaches: whether low precision can pay on it at all (`low_precision_gain`, which decides
the paths a module's trial may try: automp.runtime.starts.CalibratedCandidates) and the FP32 GEMM rate that bounds FP32
eager's step from below (automp.runtime.fp32_bound). They are cached on disk per device and torch version, so they run
once, not per script.

Whatever is cached decides every later run, so a measurement must earn its place there: each bench is warmed up and
timed several times, the median is taken, and a calibration whose runs disagree (the median far above the fastest
run: most runs were disturbed, by another process's time slice on a shared machine) or whose rates are absurd is
used for this run only, never written. Timed once and cold on a small CPU shared with other work, an FP32 256^3 GEMM's
rate varied by two orders of magnitude from run to run, and bf16 could read many times slower than FP32: cached, such
a reading kept every later run in FP32.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from automp.files import atomic_output

SCHEMA = 2  # bump when the file layout or the way of measuring changes: older files then read as corrupt and are
# re-measured (2: the median of repeated runs; files of 1 hold one cold run per bench)
BUCKETS = {"small": 256, "medium": 1024, "large": 4096}  # square GEMM sizes, smallest first
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# On a CPU, a low-precision GEMM this much slower than FP32 at one size is emulated: timing it at bigger sizes would
# blow the time budget on such CPUs and could not change the verdict (it does not pay). Not on CUDA, where every size
# takes milliseconds: there the small size is latency-bound, and on a GPU shared with other work (a parallel test
# run) its float16 rate read under a quarter of FP32's, which would have kept a real Tensor Core device in FP32 and
# cached that verdict.
EMULATED_SLOWDOWN = 4.0
LAUNCHES = 100  # tiny kernels per timed call: amortizes the timer's own overhead (a sync, a clock read)
REPEATS = 5  # timed runs per bench after the warmup; the median is the measurement
SLOW_REPEATS, SLOW_RUN_S = 3, 0.25  # a bench whose run takes longer (a CPU's emulated 1024^3 bf16 GEMM: seconds)
# is timed fewer times, to keep measure() within seconds; a stall of a few ms barely moves such a run anyway
SPREAD_LIMIT = 2.0  # median over fastest run: above it most runs were disturbed and the median is noise
# A low-precision GEMM rate this far from FP32's, either way, is no device's. The band is wide because emulation is
# slow for real: a small CPU without native bf16 ran bf16 GEMMs one to two orders of magnitude slower than FP32, run
# after run, and a figure that repeats must be cached, or every run pays for measuring it again.
RATIO_LIMIT = 1000.0


@dataclass(frozen=True)
class Calibration:
    """What one device measured: GEMM TFLOP/s by dtype name and size bucket, copy bandwidth, per-kernel cost."""

    device: str  # "cpu: <model> (<n> threads)" or "cuda: <GPU name>": the cache key, and says which kind it is
    torch_version: str
    gemm_tflops: dict[str, dict[str, float]]
    bandwidth_gbps: float  # bytes read + written per second by a large copy, in GB/s
    launch_us: float  # cost of one more tiny kernel, back to back
    measured_at: str  # ISO 8601, UTC
    # why these figures are not to be trusted beyond this run (see the module's docstring); never written to the cache
    doubts: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class Bench:
    """One timed call: `run()` does `reps` back-to-back ops. The work totals ride along so that a timer — or a
    test's fake one — can tell what it is timing without running it."""

    kind: str  # "gemm", "copy" or "launch"
    run: Callable[[], object]
    reps: int
    flops: float = 0.0
    bytes_moved: float = 0.0
    dtype: str = "float32"
    bucket: str = ""

    def __call__(self) -> None:
        self.run()


Timer = Callable[[Bench], float]  # seconds taken by one call of the bench


def device_name(device: torch.device | str) -> str:
    """The cache key of a device. A CPU's thread count is part of it: the GEMM rates scale with it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(dev)}"
    if dev.type != "cpu":
        raise ValueError(f"calibration supports cpu and cuda devices, not {dev.type!r}")
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass  # not Linux: platform's answer will do
    return f"cpu: {model} ({torch.get_num_threads()} threads)"


def default_timer(device: torch.device) -> Timer:
    """Seconds one synchronized call of a bench takes. Warmup and repeats are measure()'s: it needs every run to
    judge the measurement."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def once(bench: Bench) -> float:
        sync()
        start = time.perf_counter()
        bench()
        sync()
        return time.perf_counter() - start

    return once


def _once(timer: Timer, bench: Bench) -> float:
    t = timer(bench)
    if not _positive(t):
        raise ValueError(f"timer returned {t!r} for a {bench.kind} bench: expected positive seconds")
    return float(t)


def timed_median(timer: Timer, bench: Bench) -> tuple[float, float]:
    """(median seconds, median over fastest) of REPEATS runs of `bench` (SLOW_REPEATS for a slow one) after one
    warmup run, which pays for the allocator, kernel selection, page faults and oneDNN's JIT (on a CPU the first bf16
    GEMM can take far longer than every later one). The median, not the fastest: one lucky run would make a rate nobody
    reaches; and the ratio says whether the median can be trusted."""
    _once(timer, bench)
    first = _once(timer, bench)
    runs = [first] + [_once(timer, bench) for _ in range((REPEATS if first < SLOW_RUN_S else SLOW_REPEATS) - 1)]
    median = statistics.median(runs)
    return median, median / min(runs)


class _Doubts(list):
    """What made this calibration untrustworthy, in words, as measure() finds it."""

    def timed(self, timer: Timer, bench: Bench, what: str) -> float:
        seconds, spread = timed_median(timer, bench)
        if spread > SPREAD_LIMIT:
            self.append(f"{what}: the median run took {spread:.1f}x the fastest")
        return seconds


def _repeat(op: Callable[[], object], reps: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(reps):
            op()
    return run


def _gemm(device: torch.device, dtype: str, bucket: str, reps: int, gen: torch.Generator) -> Bench:
    n = BUCKETS[bucket]
    a, b = (torch.randn(n, n, device=device, generator=gen).to(DTYPES[dtype]) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=DTYPES[dtype])
    return Bench("gemm", _repeat(lambda: torch.mm(a, b, out=out), reps), reps, flops=2.0 * n ** 3 * reps,
                 dtype=dtype, bucket=bucket)


def _plan(device: torch.device) -> tuple[list[str], dict[str, int], int]:
    """dtypes, {bucket: reps per call}, copy size in elements. A GPU gets the large bucket and more reps per call
    (its small GEMMs take microseconds); a CPU skips 4096^3 (seconds) and copies 32 MB: beyond L2, though a big L3
    may hold it (the bandwidth is then an upper bound; a larger copy costs more in page faults than it would tell)."""
    if device.type == "cuda":
        dtypes = ["float32", "float16"] + (["bfloat16"] if torch.cuda.is_bf16_supported(False) else [])
        return dtypes, {"small": 20, "medium": 10, "large": 3}, 1 << 26
    return ["float32", "bfloat16", "float16"], {"small": 1, "medium": 1}, 1 << 23


def emulated(device: torch.device, rate: float, fp32_rate: float) -> bool:
    """Whether a low-precision GEMM rate marks the dtype as emulated, so that bigger sizes are not timed
    (EMULATED_SLOWDOWN says why only on a CPU)."""
    return device.type != "cuda" and rate * EMULATED_SLOWDOWN < fp32_rate


def _measure_gemms(device: torch.device, timer: Timer, doubts: _Doubts) -> dict[str, dict[str, float]]:
    dtypes, reps, _ = _plan(device)
    gen = torch.Generator(device=device).manual_seed(0)  # keeps the user's RNG stream untouched
    rates: dict[str, dict[str, float]] = {}
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # FP32 means plain FP32: the baseline automp compares against
    try:
        for name in dtypes:
            rates[name] = {}
            for bucket, r in reps.items():
                bench = _gemm(device, name, bucket, r, gen)
                seconds = doubts.timed(timer, bench, f"{name} GEMM at {BUCKETS[bucket]}^3")
                rates[name][bucket] = bench.flops / seconds / 1e12
                fp32 = rates["float32"][bucket]
                if emulated(device, rates[name][bucket], fp32):
                    break
    finally:
        torch.set_float32_matmul_precision(precision)
    return rates


def measure(device: torch.device | str, timer: Timer | None = None) -> Calibration:
    """Run the micro-benchmarks on `device` (about a second on a CPU or a data-centre GPU, CUDA's start aside; more on a
    CPU that emulates bf16). `timer(bench)` returns the seconds one call of `bench` takes (default_timer: one
    synchronized call); each bench is warmed up and timed repeatedly (timed_median). The result's `doubts` say why its
    figures should not outlive this run, if they should not."""
    dev = torch.device(device)
    name = device_name(dev)
    timer = timer or default_timer(dev)
    doubts = _Doubts()
    gemm = _measure_gemms(dev, timer, doubts)

    _, _, n = _plan(dev)
    src = torch.ones(n, device=dev)
    dst = torch.zeros_like(src)  # written once here, so the timed copies do not pay for first-touch page faults
    copies = 3 if dev.type == "cuda" else 1
    copy = Bench("copy", _repeat(lambda: dst.copy_(src), copies), copies, bytes_moved=2.0 * src.nbytes * copies)
    bandwidth = copy.bytes_moved / doubts.timed(timer, copy, "the copy") / 1e9

    x = torch.zeros(1, device=dev)
    tiny = Bench("launch", _repeat(lambda: x.add_(1), LAUNCHES), LAUNCHES)
    launch_us = doubts.timed(timer, tiny, "the tiny kernels") / tiny.reps * 1e6

    doubts += _implausible(gemm)
    doubts += [f"{what} is {v!r}" for what, v in (("the copy bandwidth", bandwidth), ("the launch cost", launch_us))
               if not _positive(v)]
    return Calibration(device=name, torch_version=torch.__version__, gemm_tflops=gemm, bandwidth_gbps=bandwidth,
                       launch_us=launch_us, measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       doubts=tuple(doubts))


def _implausible(gemm: dict[str, dict[str, float]]) -> list[str]:
    """GEMM rates no device has: not a positive finite number, or a low-precision rate more than RATIO_LIMIT times
    off FP32's at the same size."""
    bad = [f"the {d} GEMM rate at {BUCKETS[b]}^3 is {r!r}" for d, per in gemm.items() for b, r in per.items()
           if not _positive(r)]
    if bad:
        return bad
    fp32 = gemm.get("float32", {})
    return [f"{d} GEMMs ran {r / fp32[b]:.3g}x as fast as float32 at {BUCKETS[b]}^3"
            for d, per in gemm.items() if d != "float32" for b, r in per.items()
            if b in fp32 and not 1 / RATIO_LIMIT <= r / fp32[b] <= RATIO_LIMIT]


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def from_json(obj: object) -> Calibration | None:
    """The Calibration a cache file holds, or None when it is not one this version wrote (any field missing, of
    the wrong type, or a rate that is not a positive finite number): the caller then measures again."""
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        return None
    if not all(isinstance(obj.get(k), str) for k in ("device", "torch_version", "measured_at")):
        return None
    try:
        datetime.fromisoformat(obj["measured_at"])
    except ValueError:
        return None
    gemm = obj.get("gemm_tflops")
    if not isinstance(gemm, dict) or not isinstance(gemm.get("float32"), dict):
        return None
    for dtype, buckets in gemm.items():
        if dtype not in DTYPES or not isinstance(buckets, dict) or not buckets:
            return None
        if not all(b in BUCKETS and _positive(v) for b, v in buckets.items()):
            return None
    if not (_positive(obj.get("bandwidth_gbps")) and _positive(obj.get("launch_us"))) or _implausible(gemm):
        return None
    return Calibration(device=obj["device"], torch_version=obj["torch_version"],
                       gemm_tflops={d: {b: float(v) for b, v in bs.items()} for d, bs in gemm.items()},
                       bandwidth_gbps=float(obj["bandwidth_gbps"]), launch_us=float(obj["launch_us"]),
                       measured_at=obj["measured_at"])


def cache_path(device: torch.device | str, cache_dir: str | os.PathLike) -> Path:
    """One file per device and torch version (a new torch can bring new kernels), under `cache_dir`: the caller's
    (AutoMPConfig.cache_dir resolves the default, so that every cache agrees on it)."""
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a directory path (AutoMPConfig.cache_dir), got {cache_dir!r}")
    root = Path(cache_dir)
    key = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{device_name(device)}-torch{torch.__version__}").strip("_")
    return root / f"calibration-{key}.json"


def _write(path: Path, cal: Calibration) -> None:
    """Atomically: a reader (another process calibrating at the same time) sees the old file or the new one, never
    half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump({"schema": SCHEMA, **{k: v for k, v in asdict(cal).items() if k != "doubts"}}, f, indent=1)


def load_or_measure(device: torch.device | str, cache_dir: str | os.PathLike,
                    timer: Timer | None = None) -> Calibration:
    """The cached calibration of `device` under `cache_dir`, measured (and cached) when missing, corrupt or stale.
    A measurement with doubts is used for this run only and not cached: it warns, and the next run measures again.
    A cache that cannot be written only costs a re-measure next time, so it warns rather than fails."""
    dev = torch.device(device)
    path = cache_path(dev, cache_dir)
    try:
        cached = from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):  # missing, unreadable, not JSON, not UTF-8
        cached = None
    if cached is not None and cached.device == device_name(dev) and cached.torch_version == torch.__version__:
        return cached
    cal = measure(dev, timer)
    if cal.doubts:
        warnings.warn(f"automp: the calibration of {cal.device} is unreliable ({'; '.join(cal.doubts)}); it is used "
                      f"for this run only and not cached", RuntimeWarning, stacklevel=2)
        return cal
    try:
        _write(path, cal)
    except OSError as e:
        warnings.warn(f"automp: cannot cache the device calibration in {path.parent} ({e}); it will be measured "
                      f"again next time (point the cache directory, the cache_dir setting, at a writable one)",
                      RuntimeWarning, stacklevel=2)
    return cal


def low_precision_gain(cal: Calibration, dtype: torch.dtype) -> float:
    """Measured GEMM throughput of `dtype` over FP32 at the largest size both were measured at: below 1 low
    precision cannot pay on this device whatever the graph; 0.0 when the device was not measured in `dtype`."""
    name = next((k for k, v in DTYPES.items() if v == dtype), None)
    if name is None:
        raise ValueError(f"no GEMM calibration for {dtype}: expected one of {list(DTYPES.values())}")
    low, fp32 = cal.gemm_tflops.get(name, {}), cal.gemm_tflops["float32"]
    common = [b for b in reversed(BUCKETS) if b in low and b in fp32]
    return low[common[0]] / fp32[common[0]] if common else 0.0
