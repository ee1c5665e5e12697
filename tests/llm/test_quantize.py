"""automp.llm.quantize: QuantLinear numerics, architecture/group/backend errors (AWQ: test_awq.py).

Error bounds: symmetric per-group rounding leaves a uniform error of +-s/2 per weight, s = absmax / qmax. For Gaussian
weights in groups of 32, absmax is about 2.2 sigma, so the relative weight error is 2.2 / (qmax * sqrt(12)): 0.5% for
int8 (qmax 127) and 9% for int4 (qmax 7). Logits of these tiny random models move by about that much (measured: 0.4-0.6%
and 8-10%), so the bounds against the fp32 model are 1.5e-2 (int8) and 0.25 (int4). Against a float32 model holding
the same dequantized weights only fp16 activations differ: 5e-3 for either scheme.
"""
import copy

import pytest
import torch

from automp.llm.quantize import (QuantEmbedding, QuantLinear, check_backend, input_embedding, quantize, target_paths,
                                 weight_bytes, QuantConfig)
from automp.llm.store import build
from tests.llm import BOUND, DEVICE, dequantized_reference, ids, logits, rel

@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_logits_close_to_float(name, scheme):
    model = build(name).to(DEVICE)
    q = quantize(copy.deepcopy(model), scheme, group_size=32)
    x = ids().to(DEVICE)
    out = logits(q, x)
    assert out.dtype == torch.float16
    assert rel(out, logits(dequantized_reference(model, q), x)) < 5e-3
    assert rel(out, logits(model, x)) < BOUND[scheme]
    n_quant = sum(isinstance(m, QuantLinear) for m in q.modules())
    assert n_quant == 2 * (7 if name == "tiny-llama" else 4)
    assert not isinstance(q.lm_head, QuantLinear)


def test_single_row_and_batched_paths_agree():
    torch.manual_seed(0)
    w = torch.randn(96, 64, device=DEVICE)
    for bits in (8, 4):
        layer = QuantLinear.from_weight(w, torch.randn(96, device=DEVICE), bits, 32, torch.float16)
        x = torch.randn(3, 64, dtype=torch.float16, device=DEVICE)
        rows = torch.cat([layer(x[i:i + 1]) for i in range(3)])  # GEMV, one row at a time
        assert rel(rows, layer(x)) < 2e-3  # GEMM over all rows
        ref = x.double() @ layer.dequantized().double().t() + layer.bias.double()
        assert rel(layer(x), ref) < 2e-3
        assert layer(x.float()).dtype == torch.float32  # casts in and out of an fp32 model


def test_quantized_lm_head_unties_embedding():
    model = build("tiny-gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    q = quantize(copy.deepcopy(model), "int8", group_size=32, quantize_lm_head=True)
    assert isinstance(q.lm_head, QuantLinear) and q.transformer.wte.weight.dtype == torch.float16
    assert q.config.tie_word_embeddings is False
    x = ids()
    assert rel(logits(q, x), logits(model, x)) < BOUND["int8"]


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_embedding_looks_up_its_dequantized_rows(scheme):
    """Exactly the dequantized table's rows (odd shapes: the last group short, an odd dim for the int4 packing)."""
    w = torch.randn(37, 99, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    emb = QuantEmbedding.from_weight(w, {"int8": 8, "int4": 4}[scheme], 32, torch.float16)
    x = torch.tensor([[0, 36, 5], [5, 17, 2]], device=DEVICE)
    out = emb(x)
    assert out.shape == (2, 3, 99) and out.dtype == torch.float16
    assert torch.equal(out, emb.dequantized()[x].to(torch.float16))
    assert rel(out, w[x]) < BOUND[scheme]


@pytest.mark.parametrize("scheme,edge", [("int8", None), ("int4", None), ("int4", "int8")])
def test_quantized_embeddings_and_head(scheme, edge):
    model = build("tiny-llama").to(DEVICE)
    q = quantize(copy.deepcopy(model), scheme, group_size=32, quantize_lm_head=True, quantize_embeddings=True,
                 edge_scheme=edge)
    assert isinstance(q.get_input_embeddings(), QuantEmbedding) and isinstance(q.lm_head, QuantLinear)
    edge_bits = {"int8": 8, "int4": 4}[edge or scheme]
    assert q.get_input_embeddings().bits == q.lm_head.bits == edge_bits
    assert q.model.layers[0].mlp.up_proj.bits == {"int8": 8, "int4": 4}[scheme]
    x = ids().to(DEVICE)
    ref = dequantized_reference(model, q)
    ref.get_input_embeddings().weight.data = q.get_input_embeddings().dequantized()
    out = logits(q, x)
    assert rel(out, logits(ref, x)) < 5e-3
    assert rel(out, logits(model, x)) < BOUND[scheme] * 1.5  # one more rounded layer than the linears alone
    device, dtype, nbytes, tied = input_embedding(q)
    qw = q.model.embed_tokens.qw
    assert dtype == torch.float16 and not tied and nbytes == qw.numel() + 4 * 256 * 2  # 2 groups of fp32 scales
    alone = quantize(copy.deepcopy(model), scheme, group_size=32, quantize_lm_head=True)
    assert weight_bytes(q) < weight_bytes(alone)


def test_tied_embedding_needs_the_head_quantized_too():
    with pytest.raises(ValueError, match="tied to lm_head"):
        quantize(build("tiny-gpt2"), "int8", group_size=32, quantize_embeddings=True)
    with pytest.raises(ValueError, match="does not divide the embedding dim 64"):
        quantize(build("tiny-llama"), "int8", group_size=128, quantize_embeddings=True)


def test_unsupported_architecture():
    with pytest.raises(TypeError, match=r"unsupported architecture Linear.*GPT2LMHeadModel, LlamaForCausalLM"):
        quantize(torch.nn.Linear(64, 64), "int8")


def test_group_size_must_divide_k():
    model = build("tiny-llama", intermediate_size=96)
    with pytest.raises(ValueError, match=r"group_size 64 does not divide K=96 of layer model.layers.0.mlp.down_proj"):
        quantize(model, "int4", group_size=64)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # checked before anything changed
    assert model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("kwargs,match", [
    ({"scheme": "int3"}, "scheme must be one of"),
    ({"group_size": 48}, "power of two >= 32"),
    ({"group_size": 16}, "power of two >= 32"),
    ({"dtype": "float32"}, "dtype must be one of"),
    ({"awq": True}, "awq=True needs calib"),
    ({"edge_scheme": "int2"}, "edge_scheme must be one of"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quantize(build("tiny-llama"), **{"scheme": "int8", "group_size": 32, **kwargs})


def test_already_quantized_and_bad_calib():
    q = quantize(build("tiny-llama"), "int8", group_size=32)
    with pytest.raises(ValueError, match="already quantized"):
        target_paths(q, QuantConfig("int8", 32))
    with pytest.raises(ValueError, match="calib must be non-empty int64"):
        quantize(build("tiny-llama"), "int4", 32, calib=torch.rand(2, 8), awq=True)


def test_int4_and_int8_run_on_cuda_or_cpu():
    """int4 on the CPU runs the torch reference (automp.quant.weight_only), with or without the Triton interpreter:
    `automp llm generate` of an int4 model works on a CPU. Other devices are refused by name."""
    for bits in (4, 8):
        check_backend(bits, "cpu")
        check_backend(bits, torch.device("cuda"))
    with pytest.raises(RuntimeError, match=r"int4 weights run on a CUDA device or the CPU; got device mps"):
        check_backend(4, "mps")
