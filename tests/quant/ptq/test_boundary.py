"""The float32 boundary of a converted model, and calibration batches as model calls."""
import numpy as np
import pytest
import torch
import torch.nn as nn

from automp.quant.ptq.boundary import (QuantizedModel, calib_calls, describe, float_outputs, run_checked,
                                      stack_outputs)

from tests.quant.torch_helpers import randn


class Probe(nn.Module):
    """Records the dtypes it is called with; returns a nested structure of float and integer tensors."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, dtype=torch.float16))
        self.seen: list[torch.dtype] = []

    def forward(self, x, ids, mask=None):
        self.seen += [x.dtype, ids.dtype, mask.dtype]
        return {"y": x * self.w, "pair": (ids, x.sum(-1)), "mask": mask}


def test_float32_in_and_out_integers_untouched():
    probe = Probe()
    model = QuantizedModel(probe, torch.float16, torch.float32)
    x = randn(2, 3, seed=0)
    ids = torch.arange(6).view(2, 3)
    out = model(x, ids, mask=x > 0)
    assert probe.seen == [torch.float16, torch.int64, torch.bool]
    assert out["y"].dtype == out["pair"][1].dtype == torch.float32
    assert out["pair"][0].dtype == torch.int64 and out["mask"].dtype == torch.bool
    assert torch.allclose(out["y"], x, rtol=1e-3)


def test_float_outputs_are_named_by_path():
    t = torch.ones(2)
    assert list(float_outputs(t)) == ["output"]
    assert list(float_outputs({"a": t, "b": (torch.ones(2, dtype=torch.long), t)})) == ["a", "b.1"]
    with pytest.raises(ValueError, match="no floating-point tensor"):
        float_outputs((torch.ones(2, dtype=torch.long),))


def test_stack_outputs_concatenates_batches_or_flattens_ragged_ones():
    same = stack_outputs([{"h": torch.ones(2, 4)}, {"h": torch.zeros(3, 4)}])
    assert same["h"].shape == (5, 4)
    ragged = stack_outputs([{"h": torch.ones(2, 4)}, {"h": torch.zeros(2, 5)}])  # sequence length differs
    assert ragged["h"].shape == (18,) and ragged["h"].dtype == np.float32


def test_calib_calls_accept_tensors_tuples_and_dicts():
    x, ids = randn(2, 3, seed=1), torch.zeros(2, 3, dtype=torch.long)
    assert calib_calls([x], torch.device("cpu"), 8)[0][0][0] is x
    assert calib_calls([(x, ids)], torch.device("cpu"), 8)[0] == ((x, ids), {})
    (args, kwargs), = calib_calls([{"x": x, "ids": ids}], torch.device("cpu"), 8)
    assert args == () and set(kwargs) == {"x", "ids"}
    assert len(calib_calls((x for _ in range(10)), torch.device("cpu"), 3)) == 3  # the rest is not read
    assert describe(((x,), {"ids": ids})) == "(2x3 float32, ids=2x3 int64)"


def test_calib_calls_errors_name_the_batch():
    x = randn(2, 3, seed=2)
    with pytest.raises(TypeError, match="calibration batch 1: expected a tensor"):
        calib_calls([x, "text"], torch.device("cpu"), 8)
    with pytest.raises(ValueError, match="calibration batch 1 .* does not match batch 0"):
        calib_calls([{"x": x}, {"y": x}], torch.device("cpu"), 8)
    with pytest.raises(ValueError, match="holds no tensor"):
        calib_calls([(1, 2)], torch.device("cpu"), 8)
    with pytest.raises(ValueError, match=r"calibration batch 4 \(2x3 float32\) does not fit the model: RuntimeError"):
        run_checked(nn.Linear(4, 2), ((x,), {}), 4)
