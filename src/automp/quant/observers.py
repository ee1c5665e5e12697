"""Range observers: turn the values a tensor takes into int8/uint8 quantization parameters.

All observers share one contract so PTQ (calibration over ONNX activations) and QAT (initial scales of
fake-quant modules) pick ranges the same way:

    obs = make_observer(ObserverConfig(method="entropy"))
    for batch in batches: obs.update(batch)
    scale, zero_point = obs.qparams()       # numpy arrays: shape [] per-tensor, [C] per-channel

Why four methods: MinMax is exact for weights and well-behaved activations but one outlier stretches the
range and wastes levels; Percentile, Entropy (TensorRT-style KL divergence) and MSE trade clipping a few
outliers for a finer step on the bulk. The clip search of the histogram methods runs on |x| (one threshold T);
an asymmetric range is then the observed [min, max] clipped to [-T, T], which is exact for one-sided (ReLU)
activations - the case asymmetric uint8 is for.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

QRANGES = {"int8": (-128, 127), "uint8": (0, 255)}
_SYMMETRIC_QMAX = 127  # symmetric int8 uses [-127, 127] so that -x quantizes to -q exactly


@dataclass
class ObserverConfig:
    """How to pick a range.

    method: minmax | percentile | entropy | mse.
    dtype: int8 or uint8 (the integer type the range is mapped onto).
    symmetric: zero point 0 (int8 only); asymmetric adds a zero point so [min, max] fills every level.
    axis: None for one scale per tensor, else the channel axis (one scale per slice along it).
    percentile: the |x| percentile kept by method="percentile".
    bins: histogram resolution for percentile / entropy / mse.
    """
    method: str = "minmax"
    dtype: str = "int8"
    symmetric: bool = True
    axis: int | None = None
    percentile: float = 99.99
    bins: int = 2048

    def __post_init__(self) -> None:
        if self.method not in _OBSERVERS:
            raise ValueError(f"unknown observer method {self.method!r}; expected one of {sorted(_OBSERVERS)}")
        if self.dtype not in QRANGES:
            raise ValueError(f"unsupported quantized dtype {self.dtype!r}; expected int8 or uint8")
        if self.symmetric and self.dtype != "int8":
            raise ValueError("symmetric quantization needs dtype='int8' (uint8 is asymmetric, zero point > 0)")
        if not 50.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {self.percentile}")
        if self.bins < 256:
            raise ValueError(f"bins must be >= 256 for a meaningful clip search, got {self.bins}")


def _as_channels(x: np.ndarray, axis: int | None) -> np.ndarray:
    """View x as [C, N] (C = 1 per-tensor) in float64 so every observer reduces along axis 1."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"observers take floating-point arrays, got dtype {x.dtype}")
    if axis is None:
        return x.reshape(1, -1).astype(np.float64)
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"channel axis {axis} out of range for array of shape {x.shape}")
    return np.moveaxis(x, axis, 0).reshape(x.shape[axis], -1).astype(np.float64)


def range_to_qparams(lo: np.ndarray, hi: np.ndarray, cfg: ObserverConfig) -> tuple[np.ndarray, np.ndarray]:
    """Map a float range onto the integer grid; the range always includes 0 so zero is exactly representable."""
    lo = np.minimum(np.asarray(lo, np.float64), 0.0)
    hi = np.maximum(np.asarray(hi, np.float64), 0.0)
    qmin, qmax = QRANGES[cfg.dtype]
    if cfg.symmetric:
        scale = np.maximum(-lo, hi) / _SYMMETRIC_QMAX
        zero = np.zeros_like(scale)
    else:
        scale = (hi - lo) / (qmax - qmin)
    scale = np.where(scale > 0, scale, 1.0)  # an all-zero tensor: any scale is exact
    if not cfg.symmetric:
        zero = np.clip(np.round(qmin - lo / scale), qmin, qmax)
    shape = () if cfg.axis is None else scale.shape
    return scale.astype(np.float32).reshape(shape), zero.astype(cfg.dtype).reshape(shape)


def fake_quantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, axis: int | None = None,
                  qrange: tuple[int, int] | None = None) -> np.ndarray:
    """Quantize then dequantize (numpy reference used by tests and the sensitivity search)."""
    zp = np.asarray(zero_point)
    qmin, qmax = qrange or QRANGES[str(zp.dtype)]
    s, z = np.asarray(scale, np.float64), zp.astype(np.float64)
    if axis is not None:
        shape = [1] * x.ndim
        shape[axis] = -1
        s, z = s.reshape(shape), z.reshape(shape)
    q = np.clip(np.round(x / s) + z, qmin, qmax)
    return ((q - z) * s).astype(x.dtype)


class Observer:
    """Base: tracks running min/max per channel; subclasses choose the range inside it."""

    def __init__(self, config: ObserverConfig) -> None:
        self.config = config
        self.lo: np.ndarray | None = None
        self.hi: np.ndarray | None = None

    def update(self, x: np.ndarray) -> None:
        c = _as_channels(x, self.config.axis)
        if c.size == 0:
            raise ValueError("observer got an empty array")
        if not np.all(np.isfinite(c)):
            raise ValueError("observer got NaN/Inf values; calibration data or model output is broken")
        if self.lo is not None and self.lo.shape[0] != c.shape[0]:
            raise ValueError(f"channel count changed between updates: {self.lo.shape[0]} -> {c.shape[0]}")
        lo, hi = c.min(axis=1), c.max(axis=1)
        self.lo = lo if self.lo is None else np.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else np.maximum(self.hi, hi)
        self._accumulate(c)

    def _accumulate(self, c: np.ndarray) -> None:
        pass

    def _check_ready(self) -> None:
        if self.lo is None:
            raise RuntimeError(f"{type(self).__name__}.qparams() called before any update()")

    def qparams(self) -> tuple[np.ndarray, np.ndarray]:
        self._check_ready()
        return range_to_qparams(self.lo, self.hi, self.config)


class MinMaxObserver(Observer):
    """The full observed range: no clipping error, coarsest step."""


class _HistogramObserver(Observer):
    """Keeps a per-channel histogram of |x| over [0, amax]; subclasses pick a clip threshold T from it."""

    def __init__(self, config: ObserverConfig) -> None:
        super().__init__(config)
        self.counts: np.ndarray | None = None  # [C, bins]
        self.top: np.ndarray | None = None     # [C] upper edge of each channel's histogram

    def _accumulate(self, c: np.ndarray) -> None:
        a = np.abs(c)
        amax = a.max(axis=1)
        bins = self.config.bins
        if self.counts is None:
            self.counts = np.zeros((c.shape[0], bins))
            self.top = np.where(amax > 0, amax, 1.0)
        factor = 2 ** np.ceil(np.log2(np.maximum(amax / self.top, 1.0)))  # the range grows by powers of 2
        for ch in np.nonzero(factor > 1)[0]:
            self.counts[ch] = self._widen(self.counts[ch], int(min(factor[ch], bins)))  # >= bins: all in bin 0
        self.top = self.top * factor
        idx = np.minimum((a / self.top[:, None] * bins).astype(np.int64), bins - 1)
        offsets = np.arange(c.shape[0])[:, None] * bins
        self.counts += np.bincount((idx + offsets).ravel(), minlength=c.shape[0] * bins).reshape(-1, bins)

    @staticmethod
    def _widen(counts: np.ndarray, factor: int) -> np.ndarray:
        """Range x factor: merge each run of `factor` bins into one - exact, no smearing or empty-bin comb
        (the KL search reads empty bins as "no data here", so interpolated rebinning would bias it)."""
        return np.bincount(np.arange(len(counts)) // factor, weights=counts, minlength=len(counts))

    def _threshold(self, counts: np.ndarray, top: float) -> float:
        raise NotImplementedError

    def _levels(self) -> int:
        """Positive quantization levels available to |x| <= T."""
        if self.config.symmetric or np.any(self.lo < 0):
            return _SYMMETRIC_QMAX
        qmin, qmax = QRANGES[self.config.dtype]
        return qmax - qmin

    def qparams(self) -> tuple[np.ndarray, np.ndarray]:
        self._check_ready()
        t = np.array([self._threshold(self.counts[ch], self.top[ch]) for ch in range(len(self.top))])
        return range_to_qparams(np.maximum(self.lo, -t), np.minimum(self.hi, t), self.config)


class PercentileObserver(_HistogramObserver):
    """T = the given percentile of |x| (interpolated inside the bin where the cumulative count crosses it)."""

    def _threshold(self, counts: np.ndarray, top: float) -> float:
        cdf = np.cumsum(counts) / counts.sum()
        k = int(np.searchsorted(cdf, self.config.percentile / 100.0))
        k = min(k, len(counts) - 1)
        before = cdf[k - 1] if k > 0 else 0.0
        frac = (self.config.percentile / 100.0 - before) / max(cdf[k] - before, 1e-12)
        return float((k + np.clip(frac, 0.0, 1.0)) * top / len(counts))


class EntropyObserver(_HistogramObserver):
    """TensorRT-style calibration: T minimises KL(P || Q) between the clipped |x| histogram P (outliers folded
    into the last bin) and Q, the same histogram merged down to the number of quantization levels and spread
    back uniformly over the bins that were non-empty."""

    def _threshold(self, counts: np.ndarray, top: float) -> float:
        bins, levels = len(counts), self._levels() + 1
        best_kl, best_i = np.inf, bins
        for i in range(levels, bins + 1, max(1, (bins - levels) // 256)):
            p = counts[:i].copy()
            p[-1] += counts[i:].sum()
            if p.sum() == 0:
                continue
            chunk = np.arange(i) * levels // i
            nonempty = counts[:i] > 0
            mass = np.bincount(chunk, weights=counts[:i], minlength=levels)
            width = np.bincount(chunk, weights=nonempty, minlength=levels)
            q = np.where(nonempty, mass[chunk] / np.maximum(width[chunk], 1), 0.0)
            kl = _kl(p, q)
            if kl < best_kl:
                best_kl, best_i = kl, i
        return best_i * top / bins


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    p = p / p.sum()
    q = q / max(q.sum(), 1e-12)
    m = p > 0
    if np.any(q[m] == 0):
        return np.inf
    return float(np.sum(p[m] * np.log(p[m] / q[m])))


class MSEObserver(_HistogramObserver):
    """T minimises the expected squared quantization error of |x| (bin centres weighted by counts)."""

    candidates: int = 200

    def _threshold(self, counts: np.ndarray, top: float) -> float:
        bins, levels = len(counts), self._levels()
        centres = (np.arange(bins) + 0.5) * top / bins
        ts = np.linspace(top / self.candidates, top, self.candidates)[:, None]
        step = ts / levels
        err = (np.clip(np.round(centres / step), 0, levels) * step - centres) ** 2
        return float(ts[np.argmin(err @ counts), 0])


def activation_qparams(obs: Observer) -> tuple[np.ndarray, np.ndarray]:
    """qparams for an activation: a symmetric int8 request on one-sided data (ReLU outputs) becomes asymmetric
    uint8 with zero point 0, which doubles the resolution instead of wasting the negative half."""
    obs._check_ready()
    if obs.config.symmetric and np.all(obs.lo >= 0):
        obs.config = replace(obs.config, dtype="uint8", symmetric=False)
    return obs.qparams()


_OBSERVERS = {"minmax": MinMaxObserver, "percentile": PercentileObserver,
              "entropy": EntropyObserver, "mse": MSEObserver}


def make_observer(config: ObserverConfig) -> Observer:
    return _OBSERVERS[config.method](config)
