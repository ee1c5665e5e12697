import numpy as np
import pytest
from onnx import TensorProto, helper

from automp.deploy import runtime

from .util import f32, model


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
