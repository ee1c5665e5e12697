"""The requant pass: int8_gemm [-> GELU] -> static int8 quantization becomes one int8_gemm_requant, and only then.

The graphs are the ones Inductor's post-grad passes see (AOTAutograd with Inductor's decompositions), run eagerly
after the pass, so the fused graph's output is checked on the CPU against the unfused one.
"""
import copy

import pytest
import torch
import torch.nn as nn

from automp.deploy.quantized import TorchQuantConfig, quantize_module
from automp.deploy.quantized.requant import dedupe, fuse_requant
from automp.quant import Int8Linear, Int8Slice

from tests.quant.torch_helpers import DEVICE, bert_batch, randn, rel_err, tiny_bert

REQUANT, GEMM = "automp.int8_gemm_requant.default", "automp.int8_gemm.default"


def _compiled(model: nn.Module, fuse: bool) -> tuple[object, list[list[str]]]:
    """model compiled through AOTAutograd with Inductor's decompositions, the pass applied (or not), run eagerly;
    and the call targets of every graph after the pass."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    graphs: list[list[str]] = []

    def fw(gm: torch.fx.GraphModule, example_inputs):
        if fuse:
            fuse_requant(dedupe(gm))
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=fw, decompositions=select_decomp_table())
    return torch.compile(model, backend=backend, dynamic=False), graphs


class Block(nn.Module):
    """LayerNorm -> static int8 Linear -> act -> static (or dynamic) int8 Linear, + residual; `leak` also adds the
    first Linear's output to the result (a second consumer of the value the pass would remove)."""

    def __init__(self, act: nn.Module, zero: int = 0, smooth: bool = True, static2: bool = True,
                 leak: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ln = nn.LayerNorm(48)
        self.fc1 = Int8Linear(torch.randn(80, 48, generator=g) * 0.2, torch.randn(80, generator=g), (0.03, 0),
                              torch.rand(48, generator=g) + 0.5 if smooth else None)
        self.act = act
        self.fc2 = Int8Linear(torch.randn(48, 80, generator=g) * 0.2, torch.randn(48, generator=g),
                              (0.02, zero) if static2 else None, torch.rand(80, generator=g) + 0.5 if smooth else None)
        self.leak = leak

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(self.ln(x))
        out = self.fc2(self.act(h)) + x
        return out + h[..., :48] if self.leak else out


@pytest.mark.parametrize("zero,smooth,gelu", [(0, True, True), (-128, True, True), (3, False, True),
                                              (0, True, False)])
def test_gemm_gelu_quantize_chain_is_fused_and_agrees(zero, smooth, gelu):
    block = Block(nn.GELU() if gelu else nn.Identity(), zero, smooth).half().to(DEVICE)
    x = randn(3, 7, 48, seed=1).half().to(DEVICE)
    with torch.no_grad():
        plain, _ = _compiled(copy.deepcopy(block), fuse=False)
        ref = plain(x)
        fused, graphs = _compiled(block, fuse=True)
        out = fused(x)
    targets = graphs[-1]
    assert targets.count(REQUANT) == 1 and targets.count(GEMM) == 1
    assert "aten.erf.default" not in targets and "aten.round.default" in targets  # fc1's own input stays unfused
    # the fused epilogue skips one fp16 rounding of fc1's output, so a few int8 codes of fc2's input move by one
    assert rel_err(out, ref) < 5e-3


@pytest.mark.parametrize("case", ["dynamic consumer", "second consumer", "tanh gelu", "relu"])
def test_chains_the_pass_must_leave_alone(case):
    act = {"tanh gelu": nn.GELU(approximate="tanh"), "relu": nn.ReLU()}.get(case, nn.GELU())
    block = Block(act, static2=case != "dynamic consumer", leak=case == "second consumer").half().to(DEVICE)
    x = randn(2, 5, 48, seed=2).half().to(DEVICE)
    with torch.no_grad():
        fused, graphs = _compiled(block, fuse=True)
        fused(x)
    assert REQUANT not in graphs[-1] and graphs[-1].count(GEMM) == 2


def test_static_bert_fuses_each_mlp_and_keeps_its_output():
    bert = tiny_bert(layers=2, pooler=False)
    calib = [bert_batch(4, 9, seed=s) for s in (1, 2)]
    model, _ = quantize_module(bert, "int8", calib, TorchQuantConfig(compile=False, activations="static"))
    batch = bert_batch(2, 9, seed=5)
    with torch.no_grad():
        eager = model(**batch).last_hidden_state
        fused, graphs = _compiled(model, fuse=True)
        out = fused(**batch).last_hidden_state
    assert graphs[-1].count(REQUANT) == 2 and graphs[-1].count(GEMM) == 2 * 6 - 2  # one per layer's MLP
    assert rel_err(out, eager) < 2e-2


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


def test_dedupe_runs_a_shared_layer_once_per_input():
    """Three slices of one layer's output, each computed by its own call: one GEMM and one input quantization
    remain; two calls on another input stay a separate GEMM; a random op is never merged."""
    shared = Int8Linear(randn(96, 32, seed=3), randn(96, seed=4), (0.05, 0), None).to(DEVICE)

    class ThreeCalls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.lin(x)[..., :32], self.lin(x)[..., 32:64], self.lin(x)[..., 64:]
            noise = torch.rand_like(q) + torch.rand_like(q)  # two draws: merging them would change the result
            return q * k + v + self.lin(2 * x)[..., :32] + 0 * noise

    model = ThreeCalls()
    x = randn(4, 32, seed=5).to(DEVICE)
    with torch.no_grad():
        ref = model(x)
        fused, graphs = _compiled(model, fuse=True)
        out = fused(x)
    assert graphs[-1].count(GEMM) == 2 and graphs[-1].count("aten.round.default") == 2
    assert graphs[-1].count("aten.rand.default") + graphs[-1].count("aten.rand_like.default") == 2
    assert rel_err(out, ref) < 1e-6
