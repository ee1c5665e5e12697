"""automp.quant's one verb on a causal LM (automp.quant.causal_lm): `quantize(model, WeightOnlyConfig(...))` replaces
the architecture's projections, each bit for bit the layer built from its own weight, and records what it did as
automp.llm saves it; automp.llm.quantize is that verb plus fusion (the same codes); a filter narrows the projections;
what only a causal LM can take is refused elsewhere, in one line; one table of names serves every entry point."""
import copy

import pytest
import torch
import torch.nn as nn

import automp.llm
from automp.llm.store import build
from automp.quant import QuantConfig, WeightOnlyConfig, WeightOnlyLinear, quantize
from automp.quant.archs import ARCHS
from automp.quant.names import DTYPES, SCHEMES, SHORT, dtype_name
from automp.quant.ptq import pipeline

pytest.importorskip("transformers")


def _codes(model: nn.Module) -> dict[str, tuple[torch.Tensor, ...]]:
    return {n: (m.qw.clone(), m.scales.clone()) for n, m in model.named_modules() if isinstance(m, WeightOnlyLinear)}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("bits", [8, 4])
def test_each_projection_is_the_layer_built_from_its_own_weight(name, bits):
    model = build(name)
    original = copy.deepcopy(model)
    arch = ARCHS[type(model).__name__]
    out = quantize(model, WeightOnlyConfig(bits=bits, group_size=32))
    assert out is model and not model.training
    codes = _codes(model)
    assert len(codes) == len(model.get_submodule(arch.blocks)) * sum(len(g.linears) for g in arch.groups)
    for path, (qw, scales) in codes.items():
        layer = original.get_submodule(path)
        w = layer.weight.detach().float()
        w = w.t() if arch.conv1d else w  # GPT-2's Conv1D stores [K, N]
        b = None if layer.bias is None else layer.bias.detach().float()
        ref = WeightOnlyLinear.from_weight(w.clone(), b, bits, 32, torch.float16)
        assert torch.equal(qw, ref.qw) and torch.equal(scales, ref.scales), path
    assert not isinstance(model.lm_head, WeightOnlyLinear)
    assert model.automp_quant == QuantConfig({8: "int8", 4: "int4"}[bits], 32)
    assert all(p.dtype == torch.float16 for p in model.parameters())


@pytest.mark.parametrize("awq", [False, True])
def test_automp_llm_quantize_is_the_verb_plus_fusion(awq):
    calib = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    model = build("tiny-llama")
    by_verb = quantize(copy.deepcopy(model), WeightOnlyConfig(bits=4, group_size=32, awq=awq, calib=calib,
                                                              lm_head=True, edge_bits=8))
    by_llm = automp.llm.quantize(copy.deepcopy(model), "int4", 32, calib=calib, awq=awq, quantize_lm_head=True,
                                 edge_scheme="int8")
    verb, llm = _codes(by_verb), _codes(by_llm)
    assert verb.keys() == llm.keys() and "lm_head" in verb
    for path in verb:
        assert all(torch.equal(a, b) for a, b in zip(verb[path], llm[path])), path
    assert by_verb.lm_head.bits == 8 and by_llm.automp_quant.fuse and by_verb.automp_quant.awq == awq


def test_a_filter_narrows_the_projections_and_awq_takes_none():
    model = quantize(build("tiny-llama"), WeightOnlyConfig(group_size=32),
                     filter_fn=lambda m, path: path.endswith("q_proj"))
    assert sorted(_codes(model)) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    with pytest.raises(ValueError, match="awq scales whole groups"):
        quantize(build("tiny-llama"), WeightOnlyConfig(group_size=32, awq=True, calib=torch.zeros(1, 8).long()),
                 filter_fn=lambda m, path: True)
    with pytest.raises(ValueError, match="no projection of LlamaForCausalLM matched"):
        quantize(build("tiny-llama"), WeightOnlyConfig(group_size=32), filter_fn=lambda m, path: False)


def test_what_only_a_causal_lm_takes_is_refused_elsewhere():
    net = nn.Sequential(nn.Linear(64, 32))
    calib = [torch.randn(2, 64)]  # with calib the module goes to automp.quant.ptq, unless AWQ's settings are asked
    for config in (WeightOnlyConfig(awq=True), WeightOnlyConfig(lm_head=True), WeightOnlyConfig(edge_bits=8),
                   WeightOnlyConfig(awq=True, calib=calib), WeightOnlyConfig(embeddings=True, calib=calib)):
        with pytest.raises(ValueError, match="awq, lm_head, embeddings and edge_bits apply to the causal LMs of "
                                             "automp.quant.archs, not to Sequential"):
            quantize(copy.deepcopy(net), config)
    assert isinstance(quantize(copy.deepcopy(net), WeightOnlyConfig(group_size=32))[0], WeightOnlyLinear)
    with pytest.raises(ValueError, match="edge_bits must be 4, 8 or None"):
        WeightOnlyConfig(edge_bits=2)


def test_a_causal_lm_takes_no_error_budget():
    """PTQ's settings are not the causal-LM handler's: given to it, they are refused rather than ignored."""
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(ValueError, match="budget and exclude are automp.quant.ptq's"):
        quantize(build("tiny-llama"), WeightOnlyConfig(group_size=32, calib=ids, budget=0.05))


def test_one_table_of_names():
    from automp.llm.quantize import DTYPES as LLM_DTYPES, SCHEMES as LLM_SCHEMES
    assert LLM_DTYPES is DTYPES and LLM_SCHEMES is SCHEMES
    assert {dtype_name(d) for d in DTYPES.values()} == set(DTYPES) and SHORT[torch.bfloat16] == "bf16"
    record = QuantConfig("int8", 64, dtype="bfloat16", quantize_embeddings=True, edge_scheme="int4")
    assert QuantConfig.of(record.weight_only()) == record
    assert pipeline.SHORT is SHORT  # PTQ reports name dtypes from the same table
