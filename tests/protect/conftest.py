"""Models the protect tests share: a torch CNN and a tiny transformer encoder, exported the way automp exports
models (automp.deploy.onnx_io.export_torch), plus the hand-built conv net with a real BatchNormalization (the
exporters fold BN into the conv)."""
import onnx
import pytest
import torch

from automp.deploy import onnx_io

from ..deploy.util import convnet


class SmallCNN(torch.nn.Module):
    """Conv/BN/ReLU/max-pool, a grouped conv, global pooling and a linear head."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.c2, self.b2 = torch.nn.Conv2d(8, 16, 3, padding=1, groups=2), torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = torch.max_pool2d(torch.relu(self.b1(self.c1(x))), 2)
        x = torch.relu(self.b2(self.c2(x)))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def _cnn(exporter: str) -> bytes:
    torch.manual_seed(0)
    net = SmallCNN().eval()
    with torch.no_grad():
        for bn in (net.b1, net.b2):
            bn.running_mean.normal_(0, 0.1)
            bn.running_var.uniform_(0.5, 2)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.normal_(0, 0.1)
    return onnx_io.export_torch(net, (torch.randn(2, 3, 16, 16),), ["image"], ["logits"],
                                exporter=exporter).SerializeToString()


def _encoder(exporter: str) -> bytes:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    with torch.no_grad():  # non-trivial norms, so no two layers share identical LayerNorm weights
        for name, p in enc.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return onnx_io.export_torch(enc, (torch.randn(2, 6, 32),), ["tokens"], ["hidden"],
                                exporter=exporter).SerializeToString()


_BUILDERS = {"cnn": lambda: _cnn("dynamo"), "encoder": lambda: _encoder("legacy"),
             "encoder_dynamo": lambda: _encoder("dynamo"), "convnet_bn": lambda: convnet().SerializeToString()}


@pytest.fixture(scope="session")
def exported():
    """name -> serialized model, each exported once per test process; tests parse their own copy."""
    cache: dict[str, bytes] = {}

    def get(name: str) -> onnx.ModelProto:
        if name not in cache:
            cache[name] = _BUILDERS[name]()
        return onnx.load_model_from_string(cache[name])
    return get
