"""automp.llm.generate: static-cache decoding against a no-cache recompute and transformers' generate, greedy
agreement of int8/int4 models with the float model on memorised text, sampling, eos, decoder reuse, bad input."""
import copy

import pytest
import torch

from automp.bench.suites.llm import as_tokens, train_lm
from automp.llm.generate import _ATTR, ByteTokenizer, _decoder, decode_info, generate, sync_warnings
from automp.llm.quantize import quantize
from automp.llm.store import build
from tests.llm import DEVICE

TEXT = "Pack my box with five dozen liquor jugs; then the quick brown fox jumps over a lazy dog. "


def prompt(batch: int = 2, n: int = 5, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def recompute(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Greedy decoding by running the whole sequence again for every token: no cache to get wrong."""
    for _ in range(n):
        nxt = model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_static_cache_matches_recompute_and_hf(name):
    model = build(name)
    x = prompt()
    out = generate(model, x, 8)
    assert out.shape == (2, 13) and torch.equal(out[:, :5], x)
    assert torch.equal(out, recompute(model, x, 8))
    with torch.no_grad():
        hf = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(out, hf)
    assert decode_info(model)["cache"] == "static" and decode_info(model)["mode"] == "eager"


@pytest.fixture(scope="module")
def memorised():
    """A tiny Llama that has learnt TEXT by heart (greedy continuation = the text), trained here in a few seconds."""
    torch.set_num_threads(1)
    model = build("tiny-llama", seed=1)
    data = as_tokens((TEXT * 8).encode(), "cpu")
    train_lm(model, data, steps=150, seq=32, batch=8, lr=1e-2, seed=0)
    return model


def test_quantized_models_generate_the_same_greedy_tokens(memorised):
    tok = ByteTokenizer()
    x = torch.tensor([tok.encode(TEXT[:16])])  # one 16-row tile for the prefill GEMM: the interpreter is slow
    ref = generate(memorised, x, 5)
    assert tok.decode(ref[0]) == TEXT[:21]  # it did memorise the text
    with torch.no_grad():
        assert torch.equal(memorised.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=0), ref)
    for scheme, kw in (("int8", {}), ("int4", {}),
                       ("int4", dict(quantize_lm_head=True, quantize_embeddings=True, edge_scheme="int8"))):
        q = quantize(copy.deepcopy(memorised).to(DEVICE), scheme, group_size=32, **kw)
        assert torch.equal(generate(q, x.to(DEVICE), 5).cpu(), ref), (scheme, kw)


def test_sampling_is_reproducible_and_top1_is_greedy():
    model = build("tiny-llama")
    x = prompt()

    def sample(seed, **kw):
        return generate(model, x, 6, generator=torch.Generator().manual_seed(seed), **kw)

    a, b = sample(0, temperature=1.0, top_k=20), sample(0, temperature=1.0, top_k=20)
    assert torch.equal(a, b) and a.max() < 256
    assert not torch.equal(sample(0, temperature=5.0), sample(1, temperature=5.0))
    assert torch.equal(sample(0, temperature=0.7, top_k=1), generate(model, x, 6))


def test_eos_stops_generation():
    model = build("tiny-llama")
    x = prompt(batch=1)
    full = generate(model, x, 6)
    eos = int(full[0, 5 + 2])  # the third new token
    first = int((full[0, 5:] == eos).nonzero()[0])
    out = generate(model, x, 6, eos_token_id=eos)
    assert torch.equal(out, full[:, :5 + first + 1])


def test_decoder_is_reused_and_replaced_when_weights_change():
    model = build("tiny-llama")
    x = prompt(batch=1)
    a = generate(model, x, 4)
    dec = model.__dict__[_ATTR]
    assert torch.equal(generate(model, x, 4), a) and model.__dict__[_ATTR] is dec  # reset, same cache
    clone = copy.deepcopy(model)
    assert clone.__dict__.get(_ATTR) is None
    quantize(model, "int8", group_size=32)
    assert _decoder(model, 1, 9, "auto") is not dec


@pytest.mark.parametrize("args,kwargs,match", [
    ((torch.tensor([1, 2, 3]), 4), {}, "input_ids must be an int64 tensor"),
    ((torch.rand(1, 3), 4), {}, "input_ids must be an int64 tensor"),
    ((torch.zeros(1, 3, dtype=torch.long), 0), {}, "max_new_tokens must be an int >= 1"),
    ((torch.zeros(1, 3, dtype=torch.long), 2), {"temperature": -1.0}, "temperature >= 0"),
    ((torch.zeros(1, 3, dtype=torch.long), 2), {"mode": "fast"}, "mode must be one of"),
    ((torch.zeros(1, 1000, dtype=torch.long), 100), {}, "exceeds the model's max_position_embeddings 1024"),
])
def test_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(build("tiny-llama"), *args, **kwargs)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve café — 数"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 105, 300]) == "hi"  # ids outside the byte range are dropped


def test_only_real_sync_warnings_block_capture():
    """The one-off 'prototype feature' notice of sync debugging is not a synchronising op (it once sent the first
    model of a process to eager decoding)."""
    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    sync = "called a synchronizing CUDA operation (Triggered internally at Module.cpp:1003.)"
    assert sync_warnings([notice]) == []
    assert sync_warnings([notice, sync]) == [sync]


def test_a_decoder_driven_under_grad_mode_builds_no_autograd_graph():
    """The decoder's own entry points run without grad whoever calls them: a float model's parameters require grad,
    and a step traced with grad on would compile a backward (which the decode-attention op does not have)."""
    torch.manual_seed(0)
    model = build("tiny-llama", device=DEVICE, dtype=torch.float32, seed=0)
    assert any(p.requires_grad for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 5), device=DEVICE)
    dec = _decoder(model, 2, 9, "eager")
    dec.reset()
    with torch.enable_grad():
        first = dec.prefill(ids)
        nxt = dec.step(first.argmax(-1))
    assert not first.requires_grad and not nxt.requires_grad
    with torch.no_grad():
        want = model(torch.cat([ids, first.argmax(-1)[:, None]], 1)).logits[:, -1]
    assert float((nxt - want).norm() / want.norm()) < 1e-4
