import pytest
import torch

from automp.compress.quant.export import export_float
from tests.compress.helpers import SmallCNN, make_images, torch_accuracy, train


@pytest.fixture(scope="session")
def task():
    """(x_train, y_train, x_test, y_test) of the synthetic 4-class image task."""
    return make_images(512, seed=1) + make_images(400, seed=2)


@pytest.fixture(scope="session")
def trained_cnn(task):
    torch.manual_seed(0)
    model = SmallCNN()
    x, y, xt, yt = task
    train(model, x, y, steps=150)
    acc = torch_accuracy(model, xt, yt)
    assert acc > 0.9, f"the synthetic task should be easy; float CNN reached only {acc:.3f}"
    return model


@pytest.fixture(scope="session")
def cnn_onnx(trained_cnn, task):
    return export_float(trained_cnn, (torch.from_numpy(task[0][:2]),), ["image"], ["logits"])
