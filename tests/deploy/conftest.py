import numpy as np
import onnx
import pytest

from .util import convnet, rand


@pytest.fixture
def files(tmp_path):
    """(model.onnx, calib.npz, folder): the conv net with a dynamic batch and 64 calibration images."""
    src = tmp_path / "net.onnx"
    onnx.save(convnet(), src)
    calib = tmp_path / "calib.npz"
    np.savez(calib, image=rand(64, 3, 8, 8, seed=11))
    return src, calib, tmp_path
