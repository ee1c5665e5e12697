"""automp.llm.attention: the decode step with automp's attention kernel gives the model's tokens, the timed choice
between two captured steps, and the decoder's way back to the model's attention when the kernel fails."""
import contextlib
import importlib

import pytest
import torch

from automp.llm import attention as attn
from automp.llm.generate import decode_info, generate
from automp.llm.store import build

GEN = importlib.import_module("automp.llm.generate")


def _model(seed=0):
    """tiny-llama with 4 query heads on 1 KV head (head dim 32), in bf16."""
    return build("tiny-llama", dtype=torch.bfloat16, seed=seed, hidden_size=128, num_attention_heads=4,
                 num_key_value_heads=1)


def _prompt(batch=2, n=5, seed=3):
    return torch.randint(1, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_the_kernel_decodes_the_models_tokens(mode):
    """bf16 tiny Llama: the same greedy tokens with the kernel as with SDPA, and the
    model's own attention setting is back after every call."""
    model = _model()
    before = model.config._attn_implementation
    ids = _prompt()
    want = generate(model, ids, 8, mode="eager", attention="model")
    got = generate(model, ids, 8, mode=mode, attention="kernel")
    assert torch.equal(got, want)
    assert decode_info(model)["attention"] == "kernel" and model.config._attn_implementation == before


def test_left_padded_rows_get_their_own_tokens_with_the_kernel():
    model = _model(seed=1)
    ids = _prompt(3, 6, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0: three pads, then its prompt
    want = generate(model, ids, 6, mode="eager", attention_mask=mask, attention="model")
    got = generate(model, ids, 6, mode="eager", attention_mask=mask, attention="kernel")
    assert torch.equal(got, want)


def test_which_variants_a_decoder_runs():
    model = _model()
    assert attn.variants(model, "model", torch.bfloat16, graphs=True) == (["model"], "")
    assert attn.variants(model, "auto", torch.bfloat16, graphs=True) == (["model", "kernel"], "")
    assert attn.variants(model, "kernel", torch.bfloat16, graphs=False) == (["kernel"], "")
    only, why = attn.variants(model, "auto", torch.bfloat16, graphs=False)  # nothing captured: nothing to time
    assert only == ["model"] and "without a captured step" in why
    only, why = attn.variants(model, "kernel", torch.float32, graphs=True)
    assert only == ["model"] and "float32 activations" in why
    with pytest.raises(ValueError, match="attention must be one of"):
        generate(model, _prompt(), 2, attention="flash")


def test_using_restores_the_setting_when_the_call_fails():
    model = _model()
    before = model.config._attn_implementation
    with pytest.raises(RuntimeError), attn.using(model, "kernel"):
        assert model.config._attn_implementation == attn.NAME
        raise RuntimeError("boom")
    assert model.config._attn_implementation == before


def test_the_faster_replays_win_and_the_variants_alternate():
    now, order = [0.0], []

    def replay(name, cost):
        def run():
            order.append(name)
            now[0] += cost
        return run
    chosen, ms = attn.faster({"model": replay("model", 3e-6), "kernel": replay("kernel", 1e-6)}, lambda: None,
                             lambda: now[0])
    assert chosen == "kernel" and ms == {"model": pytest.approx(3e-3), "kernel": pytest.approx(1e-3)}
    blocks = [order[i] for i in range(0, len(order), attn.REPLAYS)]
    assert blocks == ["model", "kernel", "kernel", "model"] * (attn.ROUNDS // 2)
    assert order.count("model") == order.count("kernel") == attn.ROUNDS * attn.REPLAYS


def test_a_failing_kernel_leaves_and_the_models_attention_runs():
    """The CUDA branch of the step, driven with stand-ins: the kernel variant raises on its first call, the decoder
    drops it, says why, and goes on with the model's attention alone."""
    model = _model()
    dec = GEN.Decoder(model, 1, 16, mode="compile", attention="kernel")
    dec.device = torch.device("cuda")
    seen = []

    def fn(*args):
        seen.append(model.config._attn_implementation)
        if model.config._attn_implementation == attn.NAME:
            raise RuntimeError("no kernel here")
        return "logits"
    dec.fn = fn
    assert dec.step(torch.zeros(1, dtype=torch.long)) == "logits"
    assert seen[0] == attn.NAME and seen[-1] != attn.NAME
    assert dec.variants == ["model"] and "no kernel here" in dec.attention_note


def test_a_kernel_that_computes_something_else_is_never_kept():
    ref = torch.randn(2, 256)
    assert attn.disagreement({"model": ref, "kernel": ref * (1 + 1e-2)}) is None  # rounding carried through layers
    assert "differ from the model" in attn.disagreement({"model": ref, "kernel": ref + 0.5 * torch.randn(2, 256)})
    assert attn.disagreement({"model": ref, "kernel": ref[:, torch.randperm(256)]}) is not None  # scrambled heads
    assert attn.disagreement({"model": ref, "kernel": torch.full_like(ref, float("nan"))}) is not None
    assert attn.disagreement({"model": ref}) is None


def test_a_timed_verdict_is_kept_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    model = _model()
    assert attn.cached("gpu|k") is None  # no cache yet
    attn.remember("gpu|k", "kernel", {"model": 0.02, "kernel": 0.015})
    assert attn.cached("gpu|k") == "kernel" and attn.cached("gpu|other") is None
    only, why = attn.variants(model, "auto", torch.bfloat16, graphs=True, key="gpu|k")
    assert only == ["kernel"] and "cached verdict" in why
    assert attn.variants(model, "model", torch.bfloat16, graphs=True, key="gpu|k") == (["model"], "")  # forced
    assert attn.variants(model, "auto", torch.bfloat16, graphs=True, key="gpu|new")[0] == ["model", "kernel"]
    (tmp_path / "cache" / "decode_attention.json").write_text("{torn")
    assert attn.cached("gpu|k") is None  # a corrupt cache: timed again, never fatal
    attn.remember("gpu|k", "model", {})
    assert attn.cached("gpu|k") == "model"
    assert attn.verdict_key(model, torch.bfloat16, 1, 256, torch.device("cpu")) is None  # off CUDA: nothing timed


def test_a_cached_kernel_verdict_registers_the_kernel_in_a_fresh_process(tmp_path, monkeypatch):
    """A later run that reads "kernel" from the cache has not timed anything, so nothing has registered the kernel's
    attention with transformers in that process yet: the decoder's step would then fail to find it."""
    from transformers import AttentionInterface
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    attn.remember("gpu|k", "kernel", {"model": 0.02, "kernel": 0.015})
    monkeypatch.delitem(AttentionInterface._global_mapping, attn.NAME, raising=False)
    attn.register.cache_clear()  # as in a process that has registered nothing
    try:
        only, why = attn.variants(_model(), "auto", torch.bfloat16, graphs=True, key="gpu|k")
        assert only == ["kernel"] and "cached verdict" in why
        assert attn.NAME in AttentionInterface._global_mapping
    finally:
        attn.register.cache_clear()


def _forced_logits(model, ids, tokens, attention, mode="auto"):
    """Each decode step's logits [B, n, V] with `tokens` [B, n] fed in, whatever the step predicted (teacher forcing:
    a near-tie that 16-bit rounding breaks the other way changes one prediction, not the rest of the sequence)."""
    dec = GEN._decoder(model, ids.shape[0], ids.shape[1] + tokens.shape[1] + 1, mode, attention=attention)
    dec.reset()
    dec.prefill(ids)
    return torch.stack([dec.step(tokens[:, t]).float().clone() for t in range(tokens.shape[1])], 1)


def _rel(got, want):
    return float((got - want).norm() / want.norm())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: captured decode steps")
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 5e-3), (torch.bfloat16, 3e-2)])
def test_on_a_gpu_both_captured_steps_decode_alike_and_one_is_kept(dtype, tol, tmp_path, monkeypatch):
    """Llama-3-8B's head layout (32 query heads on 8 KV heads, head dim 128) at two layers, every step's logits fed
    the same tokens: the kernel's captured step gives SDPA's within 16-bit rounding carried through the layers (the
    CPU interpreter measured 0.1% for fp16, 1% for bf16), and "auto" times both, keeps one, and caches its verdict."""
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    model = build("tiny-llama", device="cuda", dtype=dtype, seed=0, hidden_size=4096, intermediate_size=1024,
                  num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=2)
    ids = _prompt(2, 7).cuda()
    tokens = generate(model, ids, 13, attention="model")[:, 7:]
    want = _forced_logits(model, ids, tokens, "model")
    assert decode_info(model)["captured"]
    got = _forced_logits(model, ids, tokens, "kernel")
    assert decode_info(model)["captured"] and decode_info(model)["attention"] == "kernel", decode_info(model)
    assert _rel(got, want) < tol, _rel(got, want)
    auto = _forced_logits(model, ids, tokens, "auto")
    info = decode_info(model)
    assert info["attention"] in ("model", "kernel") and set(info["attention_ms"] or ()) == {"model", "kernel"}, info
    assert _rel(auto, want) < tol, _rel(auto, want)
    assert attn.cached(model.__dict__["_automp_llm_decoder"].attention_key) == info["attention"]


def test_a_forced_kernel_that_cannot_be_captured_decodes_eagerly_with_the_models_attention(monkeypatch):
    """The CUDA branch driven with stand-ins up to the capture, which fails for the kernel, the only variant: the
    step runs uncaptured with the model's attention, and the decoder says why."""
    model = _model()
    dec = GEN.Decoder(model, 1, 16, mode="compile", attention="kernel")
    dec.device, dec.steps = torch.device("cuda"), 2  # the third step captures

    class Failing:
        def __init__(self, *a, **k):
            raise RuntimeError("capture not allowed here")
    monkeypatch.setattr(torch.cuda, "graph", Failing)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    seen = []
    dec.fn = lambda *a: seen.append(model.config._attn_implementation) or "logits"
    assert dec.step(torch.zeros(1, dtype=torch.long)) == "logits"
    assert dec.mode == "eager" and dec.variants == ["model"] and "capture failed" in dec.reason
    assert seen == [model.config._attn_implementation] != [attn.NAME]


def test_both_variants_run_and_timed_on_one_step_decode_the_models_tokens(monkeypatch, tmp_path):
    """The CUDA branch with stand-ins for streams and graphs (a stand-in capture runs the step and puts the cache's
    step state back, as a real capture leaves it; a replay runs it again into the captured logits): the step run once
    per variant, captured twice, replayed for the check and for ROUNDS x REPLAYS timed replays each, still decodes the
    model's own greedy tokens, because every further run starts from the step's marked cache state."""
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    model = _model(seed=2)
    ids = _prompt(2, 6, seed=5)
    want = generate(model, ids, 9, mode="eager", attention="model")
    dec = GEN.Decoder(model, 2, 16, mode="compile", attention="auto")
    assert attn.register() is None
    dec.variants, dec.fn = ["model", "kernel"], dec._forward

    class Graph:
        def replay(self):
            with attn.using(model, self.variant):
                self.logits.copy_(dec._forward(*dec.args))

    class Capture:
        def __init__(self, graph, stream=None):
            self.graph = graph

        def __enter__(self):
            self.marked = GEN.kv.mark(dec.cache)
            self.graph.variant = "kernel" if model.config._attn_implementation == attn.NAME else "model"
            dec.fn = lambda *a: setattr(self.graph, "logits", dec._forward(*a)) or self.graph.logits

        def __exit__(self, *exc):
            dec.fn = dec._forward
            GEN.kv.rewind(self.marked)

    stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    for name, value in {"Stream": stream, "current_stream": stream, "stream": lambda s: contextlib.nullcontext(),
                        "get_sync_debug_mode": lambda: 0, "set_sync_debug_mode": lambda m: None,
                        "synchronize": lambda: None, "CUDAGraph": Graph, "graph": Capture}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    tokens = [dec.prefill(ids).argmax(-1)]
    dec.device = torch.device("cuda")  # from here on the step takes its CUDA branch
    for _ in range(8):
        tokens.append(dec.step(tokens[-1]).argmax(-1))
    assert dec.graph is not None and set(dec.attention_ms or ()) == {"model", "kernel"}, dec.attention_note
    assert torch.equal(torch.stack(tokens, 1), want[:, 6:])
