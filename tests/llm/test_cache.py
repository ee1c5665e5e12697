"""automp.llm.cache: a decode step run again from its marked state gives the same logits and leaves the cache as one
run leaves it (transformers 5.x advances a counter inside the cache at every step)."""
import torch

from automp.llm import cache as kv
from automp.llm.generate import Decoder, generate
from automp.llm.store import build


def _model():
    return build("tiny-llama", dtype=torch.float32, seed=2, hidden_size=128, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=2)


def test_a_step_run_again_after_a_rewind_is_the_same_step():
    model = _model()
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    want = generate(model, ids, 5, mode="eager", attention="model")
    dec = Decoder(model, 2, 16, mode="eager", attention="model")
    dec.prefill(ids)
    marked = kv.mark(dec.cache)
    before = [t.clone() for t in marked[0]]
    tok = want[:, 6]
    dec.tok.copy_(tok[:, None])
    dec.pos.fill_(6)
    first = dec.fn(*dec.args).clone()
    for _ in range(3):  # three more runs of the same step, each from the marked state
        kv.rewind(marked)
        again = dec.fn(*dec.args)
        assert torch.equal(again, first)
    assert all(t.data_ptr() == s.data_ptr() for t, s in zip(kv.step_state(dec.cache), marked[0]))  # in place
    if marked[0]:  # transformers 5.x: the counters moved on by one step, not four
        assert [int(t.max()) for t in marked[0]] == [int(b.max()) + 1 for b in before]
    dec.next_pos = 7
    got = [tok]
    logits = first
    for _ in range(3):
        got.append(logits.argmax(-1))
        logits = dec.step(got[-1])
    assert torch.equal(torch.stack(got[1:], 1), want[:, 7:10])


def test_a_cache_without_step_state_marks_nothing():
    assert kv.step_state(object()) == []
    kv.rewind(kv.mark(None))  # nothing to put back
