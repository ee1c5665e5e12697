"""Layers that read one input share one int8 GEMM: which layers are grouped, and what the shared model computes."""
import torch
import torch.nn as nn

from automp.deploy.quantized import TorchQuantConfig, quantize_module
from automp.deploy.quantized.shared import input_groups, shared_layers
from automp.quant.int8 import Int8Slice

from .helpers import DEVICE, bert_batch, randn, rel_err, tiny_bert
from .test_requant import GEMM, REQUANT, _compiled


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


def test_static_bert_shares_qkv_and_runs_one_gemm_per_input():
    bert = tiny_bert(layers=2, pooler=False)
    calib = [bert_batch(4, 9, seed=s) for s in (1, 2)]
    batch = bert_batch(2, 9, seed=5)
    config = TorchQuantConfig(activations="static", measure=False)  # compile=True: eager on the CPU, grouped
    model, rep = quantize_module(bert, "int8", calib, config)
    separate, _ = quantize_module(bert, "int8", calib, TorchQuantConfig(activations="static", compile=False))
    shares = {d.name: d.shares for d in rep.layers if d.shares}
    assert len(shares) == 6 and all(len(g) == 3 and n in g for n, g in shares.items())
    assert sum(isinstance(m, Int8Slice) for m in model.modules()) == 6
    with torch.no_grad():
        ref = bert(**batch).last_hidden_state
        eager = model(**batch).last_hidden_state
        fused, graphs = _compiled(model, fuse=True)
        out = fused(**batch).last_hidden_state
        apart = separate(**batch).last_hidden_state
    # per layer: QKV once, attention output, MLP in (fused into the requant GEMM), MLP out
    assert graphs[-1].count(GEMM) == 2 * 3 and graphs[-1].count(REQUANT) == 2
    assert rel_err(out, eager) < 2e-2
    assert rel_err(eager, ref) < 1.5 * rel_err(apart, ref) + 1e-3  # joint smoothing as accurate as separate
