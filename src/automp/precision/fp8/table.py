"""Per-device table of what a linear layer's three training GEMMs cost in bf16 and in FP8, for deciding per layer
whether FP8 pays.

FP8 halves the bytes and doubles the tensor-core rate of a GEMM, but pays for it with an amax and a cast of every
operand (and transposed copies for the backward): a small or skinny layer can come out slower than in bf16. Whether
it does depends on the GPU, the cuBLAS version and the shape, so the GEMMs are timed on the device itself, once per
shape bucket (shapes a few percent apart share one measurement), and cached per device and torch version like the
device calibration (calibrate.py): a timing earns its place in the cache only when its repeats agree.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from automp.files import atomic_output
from automp.precision.calibrate import device_name
from automp.precision.fp8.layers import (ALIGN, E4M3, E5M2, FORWARD_FAST_ACCUM, RECIPES, cast, check_recipe,
                                        col_major, fits)

SCHEMA = 2  # bump when the file layout, the bucketing or the way of measuring changes: older files are re-measured
REPEATS = 5  # timed samples per measurement; the median is the measurement
WARMUP = 3  # untimed calls first: cuBLAS heuristics, workspace allocation, the caching allocator
GRAPH_CALLS = 10  # calls captured in one CUDA graph: its own launch is amortized over them
TARGET_MS = 2.0  # a sample replays the graph until it takes about this long, so event overhead vanishes
MAX_REPLAYS = 100
SPREAD_LIMIT = 2.0  # median over fastest sample: above it most samples were disturbed and the median is noise
COPY_BYTES = 1 << 28  # bandwidth copy: 256 MB, far beyond any L2


@dataclass(frozen=True)
class GemmShape:
    """y(m,n) = x(m,k) @ w(n,k).T: m rows of the activation (tokens: batch*seq), k in_features, n out_features."""

    m: int
    k: int
    n: int

    def __post_init__(self) -> None:
        for name in ("m", "k", "n"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GemmShape.{name} must be a positive int, got {v!r}")


def _bucket_dim(d: int) -> int:
    """d rounded up to a multiple of 2**(floor(log2 d) - 2): four steps per octave, so at most 25% (and typically a
    few percent) of padding; 16 at least, the smallest size an FP8 GEMM takes."""
    if d <= ALIGN:
        return ALIGN
    step = 1 << (d.bit_length() - 3)
    return -(-d // step) * step


def bucket(shape: GemmShape) -> GemmShape:
    """The shape measured for `shape`, and the table's key for it. Idempotent, never smaller than `shape`, and a
    shape whose dimensions are multiples of 16 gets a bucket whose dimensions are too (the step is 16 or more from
    64 on; below it rounding to a step of 4 or 8 leaves a multiple of 16 unchanged)."""
    return GemmShape(_bucket_dim(shape.m), _bucket_dim(shape.k), _bucket_dim(shape.n))


def unsupported(shape: GemmShape) -> str | None:
    """Why torch._scaled_mm cannot run this shape's GEMMs (one line), or None where it can."""
    if fits(shape.m, shape.k, shape.n):
        return None
    bad = [f"{name}={getattr(shape, name)}" for name in ("m", "k", "n") if getattr(shape, name) % ALIGN]
    return f"FP8 GEMMs need m, k and n multiples of {ALIGN}; {', '.join(bad)} is not"


def extra_bytes(shape: GemmShape, recipe: str) -> float:
    """Bytes the FP8 path moves beyond the bf16 path's for one training step of the layer.

    Model, per operand, assuming Inductor fuses each amax with its cast: read the source once for the amax, once for
    the cast, write FP8 once, and for tensorwise read and write an FP8 transposed copy for the backward (1 + 1 bytes):
      x (m*k, bf16 source):         2 + 2 + 1 + 2
      w (n*k, fp32 master weight):  (4 + 4 + 1 + 2) - 6, as bf16 pays its own autocast cast of the weight (read 4,
                                    write 2) and only the difference is FP8's
      g (m*n, bf16 grad_out):       2 + 2 + 1 + 2
    Rowwise scales each operand along a different axis in each GEMM that uses it, so x, w and g are cast twice (the
    cast part, amax + cast + write, counts twice); the second cast writes the transposed layout itself, so there is
    no separate transposed copy.

    Why modeled rather than timed: the GEMMs are measured, but eager-timed casts run about six unfused kernels each
    and would overstate what compiled code pays. The whole-model trial that follows the per-layer choice measures
    the truth, casts included.
    """
    check_recipe(recipe)
    mk, nk, mn = shape.m * shape.k, shape.n * shape.k, shape.m * shape.n
    if recipe == "tensorwise":
        return float(mk * (2 + 2 + 1 + 2) + nk * ((4 + 4 + 1 + 2) - 6) + mn * (2 + 2 + 1 + 2))
    return float(mk * 2 * (2 + 2 + 1) + nk * (2 * (4 + 4 + 1) - 6) + mn * 2 * (2 + 2 + 1))


@dataclass(frozen=True)
class Fp8Timing:
    """One layer shape's training GEMMs (forward, grad-input, grad-weight), in milliseconds per step."""

    bf16_ms: float  # the 3 GEMMs in bf16 (torch.mm in the layouts autograd runs them)
    fp8_gemm_ms: float  # the 3 GEMMs in FP8 via torch._scaled_mm with the recipe's dtypes, scales and layouts
    cast_ms: float  # modeled: extra_bytes(shape, recipe) / measured copy bandwidth

    @property
    def predicted_gain(self) -> float:
        """bf16 time over FP8 time, casts included: above 1 FP8 is predicted to pay for this layer."""
        return self.bf16_ms / (self.fp8_gemm_ms + self.cast_ms)


def _cast_ms(shape: GemmShape, recipe: str, bandwidth_gbps: float) -> float:
    return extra_bytes(shape, recipe) / (bandwidth_gbps * 1e9) * 1e3


class Fp8Table:
    """Timings of one device, keyed by (recipe, bucket)."""

    def __init__(self, device: str, torch_version: str, bandwidth_gbps: float,
                 entries: dict[tuple[str, GemmShape], Fp8Timing]):
        self.device = device
        self.torch_version = torch_version
        self.bandwidth_gbps = bandwidth_gbps
        self.entries = dict(entries)

    def get(self, shape: GemmShape, recipe: str) -> Fp8Timing | None:
        """The timing of `shape`'s bucket under `recipe`; None when not measured, or when the shape itself cannot
        run FP8 GEMMs (unsupported): a timing of its padded bucket would promise a speed-up that shape cannot have."""
        check_recipe(recipe)
        if unsupported(shape) is not None:
            return None
        return self.entries.get((recipe, bucket(shape)))


# (bucket, recipe) -> (bf16 samples, fp8 samples): the milliseconds of each timed run of the three GEMMs. Samples,
# not one figure, so that load_or_measure can judge whether they agree before caching their median.
Measure = Callable[[GemmShape, str], tuple[Sequence[float], Sequence[float]]]
# -> GB/s (bytes read + written) of each timed run of a large device copy; samples for the same reason
Bandwidth = Callable[[], Sequence[float]]


def bf16_operands(shape: GemmShape, device: torch.device | str, dtype: torch.dtype = torch.bfloat16
                  ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(a, b) of the forward x @ w.t(), grad-input g @ w and grad-weight g.t() @ x, as autograd runs F.linear: the
    transposes are views, as torch.mm gets them. Random normal, seeded, at the magnitudes of training (activations
    about 1, weights 0.02, gradients 1e-3), so that operands mixed up or scaled by another tensor's scale show."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)  # keeps the user's RNG stream untouched
    x, w, g = (torch.randn(r, c, device=dev, generator=gen).mul_(std).to(dtype)
               for r, c, std in ((shape.m, shape.k, 1.0), (shape.n, shape.k, 0.02), (shape.m, shape.n, 1e-3)))
    return (x, w.t()), (g, w), (g.t(), x)


def fp8_operands(shape: GemmShape, recipe: str, device: torch.device | str
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...]:
    """(a, b, scale_a, scale_b) of the forward, grad-input and grad-weight GEMMs for torch._scaled_mm: a row-major,
    b column-major, fp32 inverse scales. Tensorwise: e4m3 x and w, e5m2 g, scalar scales, and the backward's operands
    are transposed FP8 copies of the forward's. Rowwise: e4m3 everywhere, scale_a (rows, 1) and scale_b (1, cols),
    each tensor cast along the axis the GEMM reduces over. The same random tensors as bf16_operands'."""
    check_recipe(recipe)
    (x, _), (g, w), _ = bf16_operands(shape, device, torch.float32)
    if recipe == "tensorwise":
        (x8, sx), (w8, sw), (g8, sg) = cast(x, E4M3), cast(w, E4M3), cast(g, E5M2)
        return ((x8, w8.t(), sx, sw),
                (g8, col_major(w8), sg, sw),
                (g8.t().contiguous(), col_major(x8), sg, sx))
    x8r, sxr = cast(x, E4M3, dim=1)  # per row of x: (m, 1)
    w8r, swr = cast(w, E4M3, dim=1)  # per output channel: (n, 1)
    g8r, sgr = cast(g, E4M3, dim=1)  # per row of g: (m, 1)
    w8c, swc = cast(w, E4M3, dim=0)  # per column of w: (1, k)
    gt8, sgt = cast(g.t().contiguous(), E4M3, dim=1)  # per row of g.t(), an output channel: (n, 1)
    x8c, sxc = cast(x, E4M3, dim=0)  # per column of x: (1, k)
    return ((x8r, w8r.t(), sxr, swr.reshape(1, -1).contiguous()),
            (g8r, col_major(w8c), sgr, swc),
            (gt8, col_major(x8c), sgt, sxc))


def run_fp8(operands: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
            ) -> list[torch.Tensor]:
    """The scaled GEMMs of fp8_operands, in bf16 (the one output rowwise scaling has on Hopper), the forward's
    accumulated as the FP8 layers accumulate it (layers.FORWARD_FAST_ACCUM)."""
    return [torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                             use_fast_accum=FORWARD_FAST_ACCUM and i == 0) for i, (a, b, sa, sb) in enumerate(operands)]


def run_bf16(operands: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.mm(a, b) for a, b in operands]


def _time_cuda(fn: Callable[[], object], device: torch.device) -> list[float]:
    """Milliseconds per call of `fn`, REPEATS samples, by CUDA events. The calls are replayed from a CUDA graph of
    GRAPH_CALLS back-to-back calls: launched one by one from Python, a layer's GEMMs at a few thousand tokens finish
    faster than the CPU issues them (three such GEMMs took well over twice as long launched eagerly as replayed from
    a graph), so eager timing would measure dispatch overhead, which is larger for torch._scaled_mm than for
    torch.mm and which compiled code does not pay per GEMM. Each sample replays the graph for about TARGET_MS."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warmed up off the capture's stream, as torch.cuda.graph asks
            for _ in range(WARMUP):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def sample(replays: int) -> float:
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / (replays * GRAPH_CALLS)

        sample(1)  # the first replay uploads the graph
        replays = max(1, min(MAX_REPLAYS, math.ceil(TARGET_MS / GRAPH_CALLS / max(sample(1), 1e-4))))
        return [sample(replays) for _ in range(REPEATS)]


def _cuda(device: torch.device | str | None) -> torch.device:
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"FP8 GEMM timing needs a CUDA device, got {dev}")
    return dev


def measure_cuda(shape: GemmShape, recipe: str, device: torch.device | str | None = None
                 ) -> tuple[list[float], list[float]]:
    """(bf16 samples, FP8 samples), in ms, of the three training GEMMs of `shape` back to back on `device` (the
    current CUDA device by default). Operands are made once, outside the timed region."""
    dev = _cuda(device)
    bf16 = bf16_operands(shape, dev)
    fp8 = fp8_operands(shape, recipe, dev)
    return _time_cuda(lambda: run_bf16(bf16), dev), _time_cuda(lambda: run_fp8(fp8), dev)


def bandwidth_cuda(device: torch.device | str | None = None) -> list[float]:
    """GB/s (bytes read + written) of each timed run of a COPY_BYTES device-to-device copy: the rate the casts'
    memory traffic runs at."""
    dev = _cuda(device)
    src = torch.ones(COPY_BYTES // 4, device=dev)
    dst = torch.empty_like(src)
    return [2.0 * src.nbytes / (ms * 1e-3) / 1e9 for ms in _time_cuda(lambda: dst.copy_(src), dev)]


# -- the cache ---------------------------------------------------------------------------------------------------
def cache_path(device: torch.device | str, cache_dir: str | os.PathLike) -> Path:
    """cache_dir/fp8-<device name>.json; the torch version is inside the file (another one's file is replaced)."""
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a directory path (AutoMPConfig.cache_dir), got {cache_dir!r}")
    return Path(cache_dir) / f"fp8-{re.sub(r'[^A-Za-z0-9._-]+', '_', device_name(device)).strip('_')}.json"


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


class _Corrupt(ValueError):
    """A cache file that is no table this version could have written."""


def _read(path: Path) -> dict | None:
    """The file's JSON object; None when it does not exist. _Corrupt when it cannot be read or parsed."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise _Corrupt(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    if not isinstance(obj, dict):
        raise _Corrupt("not a JSON object")
    return obj


def _parse(obj: dict) -> tuple[float, dict[tuple[str, GemmShape], tuple[float, float]]]:
    """(bandwidth GB/s, {(recipe, bucket): (bf16_ms, fp8_gemm_ms)}) of a current file; _Corrupt otherwise."""
    bandwidth, rows = obj.get("bandwidth_gbps"), obj.get("entries")
    if not _positive(bandwidth) or not isinstance(rows, list):
        raise _Corrupt("no bandwidth_gbps or entries")
    entries = {}
    for row in rows:
        try:
            shape = GemmShape(row["m"], row["k"], row["n"])
            recipe, times = row["recipe"], (row["bf16_ms"], row["fp8_gemm_ms"])
        except (TypeError, KeyError, ValueError) as e:
            raise _Corrupt(f"bad entry {row!r:.80}: {e}") from None
        if recipe not in RECIPES or bucket(shape) != shape or not all(_positive(t) for t in times):
            raise _Corrupt(f"bad entry {row!r:.80}")
        entries[(recipe, shape)] = (float(times[0]), float(times[1]))
    return float(bandwidth), entries


def _write(path: Path, table: Fp8Table, keys: Iterable[tuple[str, GemmShape]]) -> None:
    """The measured figures of `keys` (cast_ms is derived on reading, so a change of the model needs no new
    measurement), atomically: a concurrent reader sees the old file or the new one, never half of one."""
    rows = [{"recipe": r, "m": s.m, "k": s.k, "n": s.n, "bf16_ms": table.entries[(r, s)].bf16_ms,
             "fp8_gemm_ms": table.entries[(r, s)].fp8_gemm_ms}
            for r, s in sorted(keys, key=lambda key: (key[0], key[1].m, key[1].k, key[1].n))]
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump({"schema": SCHEMA, "device": table.device, "torch_version": table.torch_version,
                   "bandwidth_gbps": table.bandwidth_gbps, "entries": rows}, f, indent=1)


def _median(samples: Sequence[float], what: str, doubts: list[str]) -> float:
    """The median of time `samples`; notes in `doubts` when it is more than SPREAD_LIMIT times the fastest."""
    if not samples or not all(_positive(s) for s in samples):
        raise ValueError(f"{what}: expected positive finite samples, got {list(samples)!r:.120}")
    median = statistics.median(samples)
    if median > SPREAD_LIMIT * min(samples):
        doubts.append(f"{what}: the median run took {median / min(samples):.1f}x the fastest")
    return median


def load_or_measure(device: torch.device | str, shapes: Iterable[GemmShape], recipe: str,
                    cache_dir: str | os.PathLike, measure: Measure | None = None,
                    bandwidth: Bandwidth | None = None) -> Fp8Table:
    """The table of `device` with every bucket of `shapes` under `recipe`: read from the cache, and the buckets it
    lacks measured and added to it. Shapes FP8 cannot run (unsupported) are not measured.

    The cache file is per device; a file of another torch version or schema is ignored (a new torch can bring new
    kernels) and replaced. A corrupt one warns, naming it, and is replaced. A measurement whose samples disagree
    (median over fastest above SPREAD_LIMIT: another process's work disturbed most of them) is used for this call
    and not written; so is everything measured with a disturbed bandwidth. Two processes adding different buckets
    at once may each write only their own: the other's are measured again later, nothing worse.
    `measure` and `bandwidth` default to measure_cuda and bandwidth_cuda on `device`.
    """
    check_recipe(recipe)
    dev = torch.device(device)
    if measure is None or bandwidth is None:
        _cuda(dev)
    measure = measure or (lambda s, r: measure_cuda(s, r, dev))
    bandwidth = bandwidth or (lambda: bandwidth_cuda(dev))
    name, path = device_name(dev), cache_path(dev, cache_dir)
    cached_bw, cached = None, {}
    try:
        obj = _read(path)
        if obj is not None and (obj.get("schema"), obj.get("device"), obj.get("torch_version")) == (
                SCHEMA, name, torch.__version__):
            cached_bw, cached = _parse(obj)
    except _Corrupt as e:
        warnings.warn(f"automp: the FP8 timing cache {path} is corrupt ({e}); measuring again", RuntimeWarning,
                      stacklevel=2)
    doubts: list[str] = []
    bw = cached_bw if cached_bw is not None else _median_rate(bandwidth(), doubts)
    trusted = not doubts  # a doubtful bandwidth spoils every cast time derived from it: nothing new gets written
    entries = {key: Fp8Timing(b, f, _cast_ms(key[1], key[0], bw)) for key, (b, f) in cached.items()}
    new: list[tuple[str, GemmShape]] = []
    for b in sorted({bucket(s) for s in shapes if unsupported(s) is None}, key=lambda s: (s.m, s.k, s.n)):
        if (recipe, b) in entries:
            continue
        before = len(doubts)
        bf16_samples, fp8_samples = measure(b, recipe)
        what = f"{recipe} m={b.m} k={b.k} n={b.n}"
        timing = Fp8Timing(_median(bf16_samples, f"bf16 GEMMs {what}", doubts),
                           _median(fp8_samples, f"FP8 GEMMs {what}", doubts), _cast_ms(b, recipe, bw))
        entries[(recipe, b)] = timing
        if trusted and len(doubts) == before:
            new.append((recipe, b))
    table = Fp8Table(name, torch.__version__, bw, entries)
    if doubts:
        warnings.warn(f"automp: FP8 GEMM timings on {name} are unreliable ({'; '.join(doubts)}); they are used for "
                      f"this run only and not cached", RuntimeWarning, stacklevel=2)
    if new:
        try:
            _write(path, table, list(cached) + new)
        except OSError as e:
            warnings.warn(f"automp: cannot cache the FP8 timings in {path.parent} ({e}); they will be measured "
                          f"again next time", RuntimeWarning, stacklevel=2)
    return table


def _median_rate(samples: Sequence[float], doubts: list[str]) -> float:
    """The median of bandwidth samples (GB/s): the same test as for times, on their reciprocals."""
    if not samples or not all(_positive(s) for s in samples):
        raise ValueError(f"bandwidth: expected positive finite GB/s samples, got {list(samples)!r:.120}")
    return 1.0 / _median([1.0 / s for s in samples], "the copy bandwidth", doubts)
