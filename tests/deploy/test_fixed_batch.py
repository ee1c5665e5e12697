"""A model exported with a fixed batch size takes only that many samples per run: calibration data of any other size
is run in whole batches of it (the left-over samples dropped and reported), or is a clear error."""
import json

import numpy as np
import onnx
import pytest

from automp.deploy import check_calib, optimize, runtime
from automp.deploy.cli import main

from .util import convnet, rand


@pytest.fixture
def fixed_files(tmp_path):
    src = tmp_path / "fixed.onnx"
    onnx.save(convnet(batch=4), src)
    calib = tmp_path / "calib.npz"
    np.savez(calib, image=rand(10, 3, 8, 8, seed=11))
    return src, calib, tmp_path


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("fp16", 1e-2), ("int8", 0.1)])
def test_calibration_data_is_run_in_the_models_batches(fixed_files, precision, tol):
    src, calib, tmp = fixed_files
    out, rep_path = tmp / "out.onnx", tmp / "rep.json"
    assert main([str(src), "-o", str(out), "--precision", precision, "--calib", str(calib),
                 "--report", str(rep_path)]) == 0
    rep = json.loads(rep_path.read_text())
    assert "8 samples" in rep["error_data"] and "batches of 4" in rep["error_data"]
    assert "2 left-over calibration samples dropped" in rep["error_data"]
    assert 0 <= rep["error_vs_fp32"]["logits"]["rel_l2"] <= tol
    assert runtime.fixed_batch(onnx.load(out)) == 4


def test_too_few_samples_name_the_input_and_both_batch_sizes(fixed_files, capsys):
    src, _, tmp = fixed_files
    small = tmp / "small.npz"
    np.savez(small, image=rand(3, 3, 8, 8))
    assert main([str(src), "-o", str(tmp / "o.onnx"), "--calib", str(small)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "'image'" in err and "3 samples" in err and "fixed at 4" in err
    assert not (tmp / "o.onnx").exists()


def test_a_wrong_fixed_feature_dim_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'image' has shape \(4, 3, 9, 9\), the model expects \[4, 3, 8, 8\]"):
        check_calib(convnet(batch=4), {"image": rand(4, 3, 9, 9)})


def test_whole_batches_and_dynamic_batch_untouched():
    assert check_calib(convnet(batch=4), {"image": rand(9, 3, 8, 8)})["image"].shape[0] == 8
    assert check_calib(convnet(), {"image": rand(9, 3, 8, 8)})["image"].shape[0] == 9
    _, rep = optimize(convnet(), calib={"image": rand(9, 3, 8, 8)})
    assert rep["error_data"] == "calibration data (9 samples)"


def test_without_calibration_data_the_random_inputs_fit_the_batch():
    _, rep = optimize(convnet(batch=4), precision="fp16")
    assert rep["error_data"].startswith("seeded random") and rep["error_vs_fp32"]["logits"]["rel_l2"] < 1e-2
