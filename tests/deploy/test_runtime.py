import numpy as np
import pytest
from onnx import TensorProto, helper

from automp.deploy import runtime

from .util import f32, model


def test_compare_measures_known_errors():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((4, 10)).astype(np.float32)
    e = runtime.compare(ref * 1.01, ref)
    assert e.rel_l2 == pytest.approx(0.01, rel=1e-4)
    assert e.cosine == pytest.approx(1.0, abs=1e-9)
    assert e.max_abs == pytest.approx(np.abs(ref).max() * 0.01, rel=1e-4)
    flipped = runtime.compare(-ref, ref)
    assert flipped.cosine == pytest.approx(-1.0) and flipped.rel_l2 == pytest.approx(2.0)
    bad = ref.copy()
    bad[1, 3] = np.nan
    e = runtime.compare(bad, ref)
    assert e.nonfinite == 1 and np.isinf(e.rel_l2)
    with pytest.raises(ValueError, match="shape"):
        runtime.compare(ref[:2], ref)


def test_random_feeds_follow_input_types_and_run():
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])
    m = model([helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT),
               helper.make_node("Add", ["f", "x"], ["y"])],
              [ids, f32("x", ["b", 1])], [f32("y", ["b", "s"])])
    feeds = runtime.random_feeds(m, batch=3, dim=5, seed=1, int_high=7)
    assert feeds["ids"].shape == (3, 5) and feeds["ids"].dtype == np.int64 and feeds["ids"].max() < 7
    assert feeds["x"].shape == (3, 1) and feeds["x"].dtype == np.float32
    out = runtime.run(m, feeds)["y"]
    np.testing.assert_allclose(out, feeds["ids"] + feeds["x"], rtol=1e-6)


def test_cuda_request_without_cuda_provider_is_an_error():
    if "CUDAExecutionProvider" in runtime.ort.get_available_providers():
        assert runtime.providers("cuda")[0] == "CUDAExecutionProvider"
        return
    with pytest.raises(RuntimeError, match="CUDAExecutionProvider"):
        runtime.providers("cuda")
    assert runtime.providers("auto") == ["CPUExecutionProvider"]
