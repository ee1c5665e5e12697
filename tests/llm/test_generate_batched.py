"""automp.llm.generate on left-padded batches of prompts of mixed lengths: every row gets the tokens (and, to float32
rounding, the logits) it gets when generated alone; all-ones masks; bad masks; a batch larger than the last one."""
import importlib

import pytest
import torch

from automp.llm.generate import _ATTR, generate
from automp.llm.store import build

LENGTHS = (3, 7, 5, 1)
NEW = 8
PAD = 0
# float32 throughout: a padded row and its solo run sum the same terms in different groupings (the pads' zero
# attention weights, a wider batch), so their logits agree to a few float32 ulps of accumulation, far below 1e-4.
REL = 1e-4
GEN = importlib.import_module("automp.llm.generate")  # the module: automp.llm exports the function under its name


def prompts(lengths=LENGTHS, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (1, n), generator=g) for n in lengths]


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1]:] = r[0]
        mask[i, width - r.shape[1]:] = 1
    return ids, mask


def recording(monkeypatch) -> list[torch.Tensor]:
    """The logits of every step of the next generate() calls, copied (a graph's output buffer is reused)."""
    seen, pick = [], GEN.pick

    def spy(logits, *args, **kwargs):
        seen.append(logits.detach().clone())
        return pick(logits, *args, **kwargs)

    monkeypatch.setattr(GEN, "pick", spy)
    return seen


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_rows_match_solo(model, rows, mode, monkeypatch):
    seen = recording(monkeypatch)
    ids, mask = left_padded(rows)
    out = generate(model, ids, NEW, attention_mask=mask, mode=mode)
    batched = list(seen)
    assert out.shape == (len(rows), ids.shape[1] + NEW) and torch.equal(out[:, :ids.shape[1]], ids)
    for i, r in enumerate(rows):
        seen.clear()
        solo = generate(model, r, NEW, mode=mode)
        assert torch.equal(out[i, ids.shape[1]:], solo[0, r.shape[1]:]), (i, r.shape[1])
        # the logits of the prompt (prefill) and of the first decode step, then every later step too
        for step, (b, s) in enumerate(zip(batched, seen)):
            assert rel(b[i], s[0]) < REL, (i, step, rel(b[i], s[0]))
    return out


@pytest.mark.parametrize("mode", ["eager", "auto"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_padded_rows_match_their_solo_runs(name, mode, monkeypatch):
    model = build(name, seed=2)
    check_rows_match_solo(model, prompts(), mode, monkeypatch)
    assert model.__dict__[_ATTR].masked is False  # the last call was a solo run: an unmasked decoder


def test_padded_rows_match_huggingface_generate():
    """transformers' own generate on the same left-padded batch (its convention is the one followed here)."""
    model = build("tiny-llama", seed=2)
    ids, mask = left_padded(prompts())
    out = generate(model, ids, NEW, attention_mask=mask)
    with torch.no_grad():
        hf = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, hf)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_all_ones_mask_is_no_mask(name):
    model = build(name, seed=2)
    ids = torch.cat(prompts((6, 6, 6), seed=9))
    plain = generate(model, ids, NEW)
    for ones in (torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool)):
        assert torch.equal(generate(model, ids, NEW, attention_mask=ones), plain)


def test_larger_batch_rebuilds_the_decoder(monkeypatch):
    model = build("tiny-llama", seed=2)
    check_rows_match_solo(model, prompts((4, 2)), "eager", monkeypatch)
    ids, mask = left_padded(prompts((4, 2)))
    generate(model, ids, NEW, attention_mask=mask)
    small = model.__dict__[_ATTR]
    assert small.masked and small.batch == 2
    check_rows_match_solo(model, prompts((2, 6, 4, 1, 3), seed=11), "eager", monkeypatch)
    ids, mask = left_padded(prompts((2, 6, 4, 1, 3), seed=11))
    generate(model, ids, NEW, attention_mask=mask)
    assert model.__dict__[_ATTR] is not small and model.__dict__[_ATTR].batch == 5


def test_masked_and_unmasked_decoders_differ():
    model = build("tiny-llama", seed=2)
    ids, mask = left_padded(prompts((3, 5)))
    generate(model, ids, 2, attention_mask=mask)
    masked = model.__dict__[_ATTR]
    generate(model, ids, 2)  # same batch, same length: only the mask differs
    assert model.__dict__[_ATTR] is not masked and not model.__dict__[_ATTR].masked


def test_eos_in_a_padded_batch_pads_finished_rows():
    model = build("tiny-llama", seed=2)
    rows = prompts()
    ids, mask = left_padded(rows)
    full = generate(model, ids, NEW, attention_mask=mask)
    eos = int(full[0, ids.shape[1] + 1])  # row 0's second new token
    out = generate(model, ids, NEW, attention_mask=mask, eos_token_id=eos)
    for i in range(len(rows)):
        new, ref = out[i, ids.shape[1]:], full[i, ids.shape[1]:out.shape[1]]
        hit = (ref == eos).nonzero()
        cut = int(hit[0]) + 1 if len(hit) else len(ref)
        assert torch.equal(new[:cut], ref[:cut]) and bool((new[cut:] == eos).all())


@pytest.mark.parametrize("mask,match", [
    (torch.tensor([[1, 1, 0], [0, 1, 1]]), r"rows \[0\] end in padding"),
    (torch.tensor([[0, 0, 0], [1, 1, 1]]), r"rows \[0\] end in padding \(or are all padding\)"),
    (torch.tensor([[0, 1, 1], [1, 0, 1]]), r"rows \[1\] have padding after a token"),
    (torch.tensor([[1, 1], [1, 1]]), r"attention_mask must be a tensor of input_ids' shape \(2, 3\), got \(2, 2\)"),
    ([[1, 1, 1], [1, 1, 1]], r"attention_mask must be a tensor of input_ids' shape \(2, 3\), got list"),
    (torch.tensor([[0, 1, 2], [1, 1, 1]]), "attention_mask must hold only 0 .pad. and 1 .token."),
    (torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]), "attention_mask must hold only 0 .pad. and 1 .token."),
])
def test_bad_masks(mask, match):
    with pytest.raises(ValueError, match=match):
        generate(build("tiny-llama"), torch.ones(2, 3, dtype=torch.long), 2, attention_mask=mask)


def test_masked_step_inputs_keep_their_addresses(monkeypatch):
    """A captured graph replays reads of fixed addresses: the mask, the row positions, the token and the cache slot
    must be updated in place on every step, never replaced."""
    model = build("tiny-llama", seed=2)
    ids, mask = left_padded(prompts())
    generate(model, ids, 2, attention_mask=mask)
    dec = model.__dict__[_ATTR]
    inputs = dec.args
    ptrs = [t.data_ptr() for t in inputs]
    seen = []
    pick = GEN.pick
    monkeypatch.setattr(GEN, "pick", lambda logits, *a, **k: (seen.append([t.data_ptr() for t in dec.args]),
                                                                pick(logits, *a, **k))[1])
    generate(model, ids, NEW, attention_mask=mask)
    assert model.__dict__[_ATTR] is dec and len(inputs) == 4 and len(seen) == NEW
    assert all(s == ptrs for s in seen)
    assert dec.mask[:, ids.shape[1] + NEW - 1:].sum() == 0  # the slot of the last token picked is never read


def test_dynamic_cache_fallback_with_a_mask(monkeypatch):
    """A model without a static cache decodes with its own growing cache: the mask is cut to the tokens seen."""
    monkeypatch.setattr(GEN.kv, "static_cache", lambda *args: None)
    model = build("tiny-gpt2", seed=2)
    check_rows_match_solo(model, prompts(), "eager", monkeypatch)
    assert GEN.decode_info(model)["cache"] == "dynamic"


def test_cache_passed_under_the_name_forward_takes(recwarn):
    """transformers 5.x renamed forward's past_key_values to cache (the old name warns, then goes away)."""
    ids, mask = left_padded(prompts((2, 3)))
    generate(build("tiny-llama"), ids, 3, attention_mask=mask)
    assert not [w for w in recwarn if "past_key_values" in str(w.message)]


def test_compiled_decode_first_runs_the_step_eagerly_for_quantized_batches(monkeypatch):
    """The compiled decode step of a weight-only model at 2..64 rows is preceded, once, by the same step run eagerly:
    the kernels choose which of them serves a batch only outside tracing (automp.kernels.crossover)."""
    from automp.llm.quantize import quantize
    model = build("tiny-llama", seed=0)
    quantize(model, "int8", group_size=32)
    calls = []
    for batch, eager_first in ((4, True), (64, True), (1, False), (65, False)):
        dec = GEN.Decoder(model, batch, 16, mode="compile")
        dec.device = torch.device("cuda")  # the CUDA branch of step(), driven with recording stand-ins
        dec._forward = lambda *a, _c=calls: _c.append("eager")
        dec.fn = lambda *a, _c=calls: _c.append("compiled")
        dec._checked_step = dec._capture = lambda: None
        calls.clear()
        dec.step(torch.zeros(batch, dtype=torch.long))
        assert calls == (["eager", "compiled"] if eager_first else ["compiled"]), (batch, calls)
