"""Tiny models, an easy synthetic 4-class image task and its session fixtures, shared by the quantization tests
(tests/quant, tests/deploy/qdq: each conftest imports the fixtures from here)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from automp.deploy.qdq.export import export_float

SIDE = 12
ONE_POINT = 0.01 + 1e-9  # one top-1 percentage point (plus float slack: 0.96 - 0.95 > 0.01)


def make_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Class = the quadrant holding a bright 4x4 square (jittered position and brightness) on noise."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = rng.normal(0, 0.5, (n, 1, SIDE, SIDE)).astype(np.float32)
    for i, c in enumerate(y):
        r0, c0 = (c // 2) * SIDE // 2 + rng.integers(0, 3), (c % 2) * SIDE // 2 + rng.integers(0, 3)
        x[i, 0, r0:r0 + 4, c0:c0 + 4] += rng.uniform(0.3, 1.0)
    return x, y.astype(np.int64)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc1 = nn.Linear(16 * 3 * 3, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        h = torch.max_pool2d(torch.relu(self.conv2(h)), 2)
        return self.fc2(torch.relu(self.fc1(h.flatten(1))))


def train(model: nn.Module, x: np.ndarray, y: np.ndarray, steps: int, lr: float = 3e-3, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(xt), (32,), generator=gen)
        loss = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def torch_accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def ort_run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def onnx_accuracy(model: onnx.ModelProto, x: np.ndarray, y: np.ndarray) -> float:
    name = model.graph.input[0].name
    return float((ort_run(model, {name: x})[0].argmax(1) == y).mean())


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


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
