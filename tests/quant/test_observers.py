import numpy as np
import pytest

from automp.quant.observers import (ObserverConfig, activation_qparams, fake_quantize, make_observer,
                                             range_to_qparams)


def _observe(method: str, *arrays: np.ndarray, **cfg):
    obs = make_observer(ObserverConfig(method=method, **cfg))
    for a in arrays:
        obs.update(a)
    return obs


def _mse(x, method, **cfg):
    s, z = _observe(method, x, **cfg).qparams()
    return float(np.mean((fake_quantize(x, s, z) - x).astype(np.float64) ** 2)), float(s)


def test_minmax_symmetric_scale_is_exact():
    s, z = _observe("minmax", np.array([-2.0, 0.5, 1.27], np.float32)).qparams()
    assert s.shape == () and z.dtype == np.int8
    assert s == np.float32(2.0 / 127) and z == 0


def test_minmax_asymmetric_uint8_hand_case():
    s, z = _observe("minmax", np.array([-1.0, 3.0], np.float32), dtype="uint8", symmetric=False).qparams()
    assert s == np.float32(4.0 / 255)
    assert z.dtype == np.uint8 and z == 64  # round(0 - (-1) / (4/255)) = round(63.75)
    # both ends of the range are representable to within half a step
    fq = fake_quantize(np.array([-1.0, 0.0, 3.0], np.float32), s, z)
    assert np.all(np.abs(fq - [-1.0, 0.0, 3.0]) <= s / 2 + 1e-7) and fq[1] == 0.0


def test_minmax_per_channel_accumulates_over_batches():
    obs = _observe("minmax", np.array([[1.0, -3.0], [0.5, 0.25]], np.float32),
                   np.array([[-4.0, 0.0], [0.1, 0.1]], np.float32), axis=0)
    s, z = obs.qparams()
    np.testing.assert_array_equal(s, np.array([4.0 / 127, 0.5 / 127], np.float32))
    np.testing.assert_array_equal(z, [0, 0])


def test_relu_activation_becomes_uint8_with_zero_point_zero():
    x = np.maximum(np.random.default_rng(0).normal(size=1000), 0).astype(np.float32)
    s, z = activation_qparams(_observe("minmax", x))  # asked symmetric int8; data is one-sided
    assert z.dtype == np.uint8 and z == 0
    np.testing.assert_allclose(s, x.max() / 255, rtol=1e-6)


def test_minmax_round_trip_error_is_at_most_half_a_step():
    x = np.random.default_rng(1).uniform(-3, 5, size=(4, 1000)).astype(np.float32)
    for cfg in (dict(), dict(dtype="uint8", symmetric=False), dict(axis=0)):
        s, z = _observe("minmax", x, **cfg).qparams()
        err = np.abs(fake_quantize(x, s, z, axis=cfg.get("axis")) - x)
        step = s if np.ndim(s) == 0 else s[:, None]
        assert np.all(err <= step / 2 * (1 + 1e-5)), cfg


def test_percentile_clips_outliers():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(size=200_000), np.full(20, 1000.0)]).astype(np.float32)
    s, _ = _observe("percentile", x, percentile=99.9).qparams()
    threshold = s * 127
    assert threshold < 10.0  # not the outlier
    # |N(0,1)| 99.9th percentile is 3.29; the 20 outliers shift it only marginally
    assert abs(threshold - 3.29) < 0.1, threshold


def test_histogram_widening_is_exact_when_grids_align():
    """Batch 1 spans |x| <= 1, batch 2 reaches 4: widening merges runs of 4 bins, which must give the very
    histogram (and thresholds) a single update over all the data gives."""
    rng = np.random.default_rng(3)
    a = np.concatenate([rng.uniform(-1, 1, 5000), [1.0]]).astype(np.float32)
    b = np.concatenate([rng.laplace(0, 0.7, 5000).clip(-4, 4), [4.0]]).astype(np.float32)
    for method in ("percentile", "mse", "entropy"):
        one = _observe(method, np.concatenate([a, b]))
        many = _observe(method, a, b)
        assert many.top[0] == one.top[0] == 4.0
        assert np.abs(many.counts - one.counts).sum() <= 4  # at most a few values sitting on a bin edge
        np.testing.assert_allclose(many.qparams()[0], one.qparams()[0], rtol=1e-3, err_msg=method)


def test_percentile_is_stable_across_batching():
    x = np.random.default_rng(3).standard_t(4, size=40_000).astype(np.float32)
    parts = sorted(np.array_split(x, 8), key=lambda p: np.abs(p).max())  # every batch widens the range
    one, _ = _observe("percentile", x).qparams()
    many, _ = _observe("percentile", *parts).qparams()
    assert abs(float(many) - float(one)) / float(one) < 0.01


@pytest.mark.parametrize("method", ["mse", "entropy"])
def test_clip_search_clips_heavy_tails_and_beats_minmax(method):
    """Laplace tails: the rare largest values cost more resolution than clipping them costs error."""
    x = np.random.default_rng(4).laplace(size=50_000).astype(np.float32)
    mse_minmax, s_minmax = _mse(x, "minmax")
    mse_clip, s_clip = _mse(x, method)
    assert s_clip < 0.9 * s_minmax
    assert mse_clip < 0.9 * mse_minmax


@pytest.mark.parametrize("method", ["percentile", "mse", "entropy"])
def test_per_channel_equals_per_tensor_on_each_channel(method):
    rng = np.random.default_rng(7)
    w = (rng.laplace(size=(3, 4000)) * np.array([[0.5], [1.0], [3.0]])).astype(np.float32)
    s, z = _observe(method, w, axis=0).qparams()
    assert s.shape == (3,) and z.shape == (3,)
    for c in range(3):
        np.testing.assert_allclose(s[c], _observe(method, w[c]).qparams()[0], rtol=1e-6)


@pytest.mark.parametrize("method", ["entropy", "mse"])
def test_clip_search_keeps_the_range_of_uniform_data(method):
    """No tails to trade away: clipping a uniform distribution only piles mass on the last level."""
    x = np.random.default_rng(8).uniform(-1, 1, 100_000).astype(np.float32)
    s, _ = _observe(method, x).qparams()
    assert s * 127 > 0.95 * np.abs(x).max()


def test_percentile_hand_case_on_uniform_data():
    x = np.random.default_rng(9).uniform(-1, 1, 200_000).astype(np.float32)
    s, _ = _observe("percentile", x, percentile=99.0).qparams()
    assert s * 127 == pytest.approx(0.99, abs=2e-3)  # P(|x| <= t) = t for |x| ~ U(0, 1)


def test_mse_never_worse_than_minmax_on_gaussian():
    x = np.random.default_rng(5).normal(size=20_000).astype(np.float32)
    assert _mse(x, "mse")[0] <= _mse(x, "minmax")[0] * 1.01


def test_entropy_on_one_sided_data_uses_uint8_levels():
    x = np.abs(np.random.default_rng(6).laplace(size=20_000)).astype(np.float32)
    s, z = _observe("entropy", x, dtype="uint8", symmetric=False).qparams()
    assert z == 0 and 0 < s * 255 < x.max()


def test_all_zero_tensor_gets_a_usable_scale():
    s, z = _observe("minmax", np.zeros(8, np.float32)).qparams()
    assert s > 0 and np.all(fake_quantize(np.zeros(8, np.float32), s, z) == 0)


def test_range_to_qparams_includes_zero():
    s, z = range_to_qparams(np.array(1.0), np.array(2.0), ObserverConfig(dtype="uint8", symmetric=False))
    assert z == 0 and s == np.float32(2.0 / 255)


@pytest.mark.parametrize("cfg,err", [
    (dict(method="kmeans"), ValueError), (dict(dtype="int4"), ValueError),
    (dict(dtype="uint8", symmetric=True), ValueError), (dict(percentile=30.0), ValueError),
    (dict(bins=16), ValueError)])
def test_bad_config_is_rejected(cfg, err):
    with pytest.raises(err):
        ObserverConfig(**cfg)


def test_bad_input_is_rejected():
    obs = make_observer(ObserverConfig())
    with pytest.raises(RuntimeError, match="before any update"):
        obs.qparams()
    with pytest.raises(ValueError, match="NaN"):
        obs.update(np.array([1.0, np.nan], np.float32))
    with pytest.raises(TypeError, match="int32"):
        obs.update(np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="axis 3"):
        make_observer(ObserverConfig(axis=3)).update(np.ones((2, 2), np.float32))
    per_ch = make_observer(ObserverConfig(axis=0))
    per_ch.update(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="channel count"):
        per_ch.update(np.ones((4, 3), np.float32))
