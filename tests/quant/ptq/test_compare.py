"""The one error measure: relative L2, cosine, max abs and non-finite count of an output against its reference."""
import numpy as np
import pytest

from automp.quant.ptq.compare import compare


def test_compare_measures_known_errors():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((4, 10)).astype(np.float32)
    e = compare(ref * 1.01, ref)
    assert e.rel_l2 == pytest.approx(0.01, rel=1e-4)
    assert e.cosine == pytest.approx(1.0, abs=1e-9)
    assert e.max_abs == pytest.approx(np.abs(ref).max() * 0.01, rel=1e-4)
    flipped = compare(-ref, ref)
    assert flipped.cosine == pytest.approx(-1.0) and flipped.rel_l2 == pytest.approx(2.0)
    bad = ref.copy()
    bad[1, 3] = np.nan
    e = compare(bad, ref)
    assert e.nonfinite == 1 and np.isinf(e.rel_l2)
    with pytest.raises(ValueError, match="shape"):
        compare(ref[:2], ref)
