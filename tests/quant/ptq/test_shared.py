"""Layers that read one input share one int8 GEMM: which layers are grouped, and what each slice computes (the compiled
model running one GEMM per input: tests/deploy/quantized/test_requant.py)."""
import torch
import torch.nn as nn

from automp.quant.ptq.shared import input_groups, shared_layers

from tests.quant.torch_helpers import DEVICE, bert_batch, randn, rel_err, tiny_bert


class Fork(nn.Module):
    """a, b and c read x; d reads a's output; e is called twice (never grouped)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.d = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(8, 8)
        self.c = nn.Linear(16, 8, bias=False)
        self.e = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.e(self.e(x))
        return torch.cat([self.d(self.a(x)), self.b(x), self.c(x)], -1).sum(-1) + y.sum(-1)


def test_layers_reading_one_tensor_are_grouped():
    net = Fork().to(DEVICE)
    names = ["a", "b", "c", "d", "e"]
    assert input_groups(net, names, ((randn(3, 16, seed=1).to(DEVICE),), {})) == [("a", "b", "c")]
    bert = tiny_bert(layers=2)
    lin = [n for n, m in bert.named_modules() if isinstance(m, nn.Linear)]
    groups = input_groups(bert, lin, ((), bert_batch(2, 6, seed=1)))
    assert groups == [tuple(f"encoder.layer.{i}.attention.self.{p}" for p in ("query", "key", "value"))
                      for i in range(2)]


def test_shared_layer_slices_compute_each_layer():
    net = Fork().to(DEVICE)
    slices = shared_layers(net, ("a", "b", "c"), None, None)
    x = randn(5, 16, seed=2).to(DEVICE)
    assert {n: (s.start, s.stop) for n, s in slices.items()} == {"a": (0, 8), "b": (8, 12), "c": (12, 20)}
    assert slices["a"].shared is slices["c"].shared
    for n, s in slices.items():
        ref = getattr(net, n)(x)
        assert rel_err(s(x), ref) < 3e-2  # int8 weights and per-row int8 activations
