"""Sibling linear layers as one GEMM (automp.precision.siblings): on a transformers Llama the query/key/value and
gate/up groups are joined, the loss and every parameter's gradient match the unfused graph and state_dict keeps its
keys; layers on different inputs, tied or otherwise shared weights and mixed biases stay apart; a graph whose model
views a slice in a way the wide output does not allow is kept as it was."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.precision.siblings import fuse_sibling_linears
from tests.precision.fp8.test_layers import RECIPES, cpu_scaled_mm, needs_scaled_mm


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _compiled(fn, *args):
    """fn compiled with a backend that applies the pass (with the example inputs) and runs the graph as it is."""
    groups = []

    def backend(gm, example_inputs):
        gm, found = fuse_sibling_linears(gm, example_inputs)
        groups.extend(found)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend)(*args), groups


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("autocast", [False, True])
def test_llama_groups_are_joined_and_train_as_before(autocast):
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ref_model = copy.deepcopy(model)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss(m):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return m(input_ids=ids, labels=ids).loss

    out, groups = _compiled(loss, model)
    ref = loss(ref_model)
    out.backward()
    ref.backward()
    # per layer: query, key, value (widths 64, 32, 32) and gate, up (128, 128)
    assert sorted(g.widths for g in groups) == [(64, 32, 32)] * 2 + [(128, 128)] * 2
    tol = 2e-2 if autocast else 1e-5  # bf16 GEMMs on both sides, summed in other orders
    assert _rel(out, ref) < tol
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert p.grad is not None and _rel(p.grad, q.grad) < tol, name
    assert model.state_dict().keys() == ref_model.state_dict().keys()


class Pair(nn.Module):
    def __init__(self, bias=(False, False)):
        super().__init__()
        self.a, self.b = nn.Linear(8, 6, bias=bias[0]), nn.Linear(8, 4, bias=bias[1])


def test_only_layers_on_one_input_with_their_own_weights_and_alike_biases_are_joined():
    x, z = torch.randn(3, 8), torch.randn(3, 8)
    m = Pair((True, True))
    (ya, yb), groups = _compiled(lambda: (m.a(x), m.b(x)), )
    assert [g.widths for g in groups] == [(6, 4)] and _rel(ya, m.a(x)) < 1e-6 and _rel(yb, m.b(x)) < 1e-6
    assert _compiled(lambda: (m.a(x), m.b(z)))[1] == []  # different inputs
    mixed = Pair((True, False))
    assert _compiled(lambda: (mixed.a(x), mixed.b(x)))[1] == []  # a bias on one only
    w = nn.Parameter(torch.randn(6, 8))
    assert _compiled(lambda: (F.linear(x, w), F.linear(x, w)))[1] == []  # one weight read twice (tied)
    assert _compiled(lambda: (m.a(x), m.b(x), m.a.weight.sum()))[1] == []  # a weight read elsewhere


def test_a_slice_viewed_in_a_way_the_wide_output_does_not_allow_keeps_the_graph():
    m = Pair()
    x = torch.randn(2, 5, 8)
    # a's output (2, 5, 6) flattened by view: fine on its own, not on a slice of the (2, 5, 10) joined output
    (flat, yb), groups = _compiled(lambda: (m.a(x).view(2, -1), m.b(x)))
    assert groups == [] and _rel(flat, m.a(x).reshape(2, -1)) < 1e-6


class Qkv(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32)

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), 2 * self.v(x)], dim=-1).float()


def _fp8_qkv(recipes):
    from automp.precision.fp8 import layers as fp8
    torch.manual_seed(0)
    net = Qkv()
    for layer, recipe in zip((net.q, net.k, net.v), recipes):
        if recipe is not None:
            fp8.install(layer, recipe)
    return net


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_siblings_of_one_recipe_become_one_fp8_call(recipe):
    """Three FP8 layers on one input: one FP8 call on the concatenated weight, split back. One scale for the group's
    weight changes the rounding, not the result: loss and gradients within FP8's error of the layers apart."""
    from automp.precision.fp8 import layers as fp8
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(3))
    g = torch.randn(2, 24, 128, generator=torch.Generator().manual_seed(4))  # the outputs' gradient
    net, ref_net = _fp8_qkv([recipe] * 3), _fp8_qkv([recipe] * 3)
    with torch.autocast("cpu", dtype=torch.bfloat16), fp8.active():
        out, groups = _compiled(net, x)
        ref = ref_net(x)
        (out * g).sum().backward()
        (ref * g).sum().backward()
    assert [g.widths for g in groups] == [(64, 32, 32)]
    assert _rel(out, ref) < 0.1
    for (name, p), q in zip(net.named_parameters(), ref_net.parameters()):
        assert p.grad is not None and _rel(p.grad, q.grad) < 0.15, name


@needs_scaled_mm
def test_fp8_siblings_join_only_their_like():
    """An FP8 layer beside a bf16 one, or beside one of another recipe, keeps its own call."""
    from automp.precision.fp8 import layers as fp8
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(3))
    mixes = [["tensorwise", None, None]] + ([["tensorwise", "rowwise", None]] if cpu_scaled_mm("rowwise") else [])
    for recipes in mixes:  # torch 2.11's CPU torch._scaled_mm takes per-tensor scales only
        with torch.autocast("cpu", dtype=torch.bfloat16), fp8.active():
            _, groups = _compiled(_fp8_qkv(recipes), x)
        assert [g.widths for g in groups] == ([(32, 32)] if recipes[1] is None else []), recipes
