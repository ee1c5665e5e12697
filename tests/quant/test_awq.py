"""automp.quant.awq: scaling and folding change nothing by themselves, the search helps outlier channels, and an AWQ
model computes what its dequantized weights say (bounds: test_quantize.py's docstring)."""
import copy

import pytest
import torch

from automp.quant.awq import fake_quant, scale_block, search_scale
from automp.llm.quantize import ARCHS, QuantLinear, quantize
from automp.quant.causal_lm import _dense
from automp.llm.store import build
from tests.llm import BOUND, DEVICE, dequantized_reference, ids, logits, rel


@pytest.mark.parametrize("name,overrides", [("tiny-llama", {}), ("tiny-llama", {"num_key_value_heads": 4}),
                                            ("tiny-gpt2", {})])
def test_awq_scales_fold_exactly(name, overrides):
    """Scaling weight columns by s and folding 1/s into the previous op (or an input multiply) changes nothing."""
    model = build(name, **overrides)
    x = ids()
    ref = logits(model, x)
    arch = ARCHS[type(model).__name__]
    gen = torch.Generator().manual_seed(0)
    explicit_all = {}
    for i, block in enumerate(model.get_submodule(arch.blocks)):
        prefix = f"{arch.blocks}.{i}."
        dense = {f"{prefix}{lin}": list(_dense(model.get_submodule(f"{prefix}{lin}"), arch.conv1d))
                 for g in arch.groups for lin in g.linears}
        scales = {gi: torch.rand(dense[f"{prefix}{g.linears[0]}"][0].shape[1], generator=gen) * 4 + 0.25
                  for gi, g in enumerate(arch.groups)}
        explicit = scale_block(block, prefix, arch, dense, scales)
        explicit_all.update(explicit)
        for path, (w, b) in dense.items():
            if path in explicit:
                w = w * explicit[path][None, :]
            m = model.get_submodule(path)
            m.weight.data = w.t().contiguous() if arch.conv1d else w
            if b is not None:
                m.bias.data = b
    assert rel(logits(model, x), ref) < 1e-5
    gqa = name == "tiny-llama" and model.config.num_key_value_heads < model.config.num_attention_heads
    expected = {"tiny-llama": "self_attn.o_proj" if gqa else None, "tiny-gpt2": "mlp.c_proj"}[name]
    assert sorted({p.split(".", 3)[3] for p in explicit_all}) == ([expected] if expected else [])


def test_awq_search_helps_outlier_channels():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=gen)
    x[:, :4] *= 30  # a few channels with large activations, as in real LLMs
    w = torch.randn(64, 128, generator=gen)
    s, alpha = search_scale(x, [w], bits=4, group_size=32)

    def err(scale):
        return float(((x / scale) @ fake_quant(w * scale, 4, 32).t() - x @ w.t()).pow(2).mean())

    assert alpha > 0
    assert err(s) < 0.8 * err(torch.ones(128))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_awq_end_to_end(name):
    model = build(name).to(DEVICE)
    calib = ids(64, batch=4, seed=7).to(DEVICE)
    q = quantize(copy.deepcopy(model), "int4", group_size=32, calib=calib, awq=True)
    alphas = [m.awq_alpha for m in q.modules() if isinstance(m, QuantLinear)]
    assert all(a is not None for a in alphas)
    assert any(m.input_scale is not None for m in q.modules() if isinstance(m, QuantLinear))
    x = ids().to(DEVICE)
    out = logits(q, x)
    assert rel(out, logits(dequantized_reference(model, q), x)) < 5e-3
    assert rel(out, logits(model, x)) < BOUND["int4"]
