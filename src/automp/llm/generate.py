"""Token generation with a preallocated KV cache and, on CUDA, a CUDA-graph decode step.

At batch 1 a decoder step launches on the order of a thousand small kernels (norms, rotary, cache writes, GEMVs), and
launching them one by one from Python takes longer than reading the weights. A CUDA graph replays the whole step with
one launch, which needs every tensor the step touches to keep its address: hence transformers' StaticCache (keys and
values preallocated per layer as [batch, kv_heads, max_len, head_dim], written in place) and static input buffers for
the token and its position. With mode "compile" the step is first compiled with torch.compile (Inductor fuses the
elementwise kernels: fewer nodes per replay), then captured the same way.

Capture is done by hand rather than by torch.compile(mode="reduce-overhead") so the warm-up is under our control:
transformers' caches keep state (5.x advances a per-layer position counter in every step), so warm-up runs are real
decode steps, not throw-away ones. Step 1 runs as is (compiles, autotunes the Triton kernels); step 2 runs on the
capture stream with CUDA's sync debugging on, so a step that would synchronise (and could not be captured) is found
without breaking anything; step 3 is captured and every later step is one replay. Anything that fails falls back to
eager decoding, and `decode_info(model)` says which mode ran and why.

Prompts of different lengths come left-padded with an attention mask (transformers' convention). Every row then
shares the cache slot of each step (a column of the padded batch) but has its own position, counted from its first
real token; the 2-D mask [batch, max_len] hides each row's pads from attention. Both live in preallocated buffers
that each step updates in place, so one captured graph serves every step of a masked batch too.

Version differences (transformers 4.x vs 5.x) are found by feature checks: StaticCache's constructor arguments, whether
forward takes `cache_position`, what forward calls the cache (`past_key_values`, renamed `cache` in 5.x), whether the
model supports a static cache at all (else the model's own dynamic cache, eager).
"""
from __future__ import annotations

import functools
import inspect
import itertools
import time
import types
import warnings

import torch
import torch.nn as nn

from automp.frames import own_code
from automp.llm import attention as attn
from automp.llm import cache as kv
from automp.llm.fuse import fuse_projections
from automp.llm.quantize import QuantLinear, check_backend, input_embedding

MODES = ("auto", "eager", "graph", "compile")
_ATTR = "_automp_llm_decoder"
_decoder_ids = itertools.count()
_LEN_STEP = 256  # cache lengths are rounded up to this, so one decoder (and its graph) serves many prompt lengths


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: no tokenizer files to download, and any text round-trips."""
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _fingerprint(model: nn.Module) -> tuple:
    """Identity of the tensors a captured graph reads: a replaced module or a moved model makes a new decoder."""
    return tuple((t.data_ptr(), t.dtype) for t in list(model.parameters()) + list(model.buffers()))


def _key(model: nn.Module, batch: int, max_len: int, mode: str, masked: bool, attention: str) -> tuple:
    """What a decoder serves: a call that differs in any of it needs another decoder."""
    return batch, max_len, mode, masked, attention, _fingerprint(model)


class _Unpicklable:
    """Decoders hold CUDA graphs: a deep copy or a pickle of the model leaves them behind."""

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


class Decoder(_Unpicklable):
    """A KV cache for `batch` sequences of up to `max_len` tokens plus the one-token decode step over it."""

    def __init__(self, model: nn.Module, batch: int, max_len: int, mode: str = "auto", masked: bool = False,
                 attention: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"automp.llm.generate: mode must be one of {MODES}, got {mode!r}")
        self.model, self.batch, self.max_len = model, batch, max_len
        fuse_projections(model)  # a model moved since quantize() lost its fused groups; before the fingerprint
        self.device, self.dtype, _, _ = input_embedding(model)
        self.key = _key(model, batch, max_len, mode, masked, attention)
        fwd = inspect.signature(model.forward).parameters
        self.cache_position = "cache_position" in fwd
        self.cache_arg = "cache" if "cache" in fwd else "past_key_values"
        self.logits_to_keep = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in fwd), None)
        self.cache = kv.static_cache(model, batch, max_len, self.device, self.dtype)
        self.static = self.cache is not None
        cuda = self.device.type == "cuda"
        self.mode = ("compile" if cuda else "eager") if mode == "auto" else mode
        self.reason = ""
        if self.mode != "eager" and not self.static:
            self.mode, self.reason = "eager", "no static KV cache for this model / transformers version"
        if self.mode in ("graph", "compile") and not cuda:
            self.reason = f"no CUDA graph on {self.device.type}: steps run one by one"
        # the step's attention: one variant, or two captured and timed (automp.llm.attention)
        self.attention_key = attn.verdict_key(model, self.dtype, batch, max_len, self.device)
        self.variants, self.attention_note = attn.variants(model, attention, self.dtype,
                                                           graphs=cuda and self.mode != "eager", key=self.attention_key)
        self.attention_ms: dict[str, float] | None = None
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.long, device=self.device)
        self.masked = masked
        self.args = (self.tok, self.pos)  # what every decode step reads: the graph's inputs, fixed addresses
        if masked:
            self.pads = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # left pads of each row
            self.row_pos = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # position of the new token
            self.mask = torch.zeros(batch, max_len, dtype=torch.long, device=self.device)  # 1 = a real cached token
            self.args = (self.tok, self.pos, self.row_pos, self.mask)
        self.fn = self._forward
        if self.mode == "compile":  # a code object per decoder (automp.frames): each holds up to two graphs
            step = own_code(Decoder._forward, f"automp_decode_step_{next(_decoder_ids)}")
            self.fn = torch.compile(types.MethodType(step, self), dynamic=False)
        self.graph = self.logits = self.stream = None
        self.marked: tuple[list, list] = ([], [])  # the cache's step state before the step in hand (kv.mark)
        self.steps = 0
        self.next_pos = 0

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, row_pos: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] of the last position. pos: cache slots of ids; row_pos [B, len(pos)]: each row's positions
        where they differ from the slots (left padding), with mask [B, max_len] over the whole static cache."""
        positions = pos[None].expand(ids.shape[0], -1) if row_pos is None else row_pos
        kw = {"input_ids": ids, "position_ids": positions, "use_cache": True, self.cache_arg: self.cache}
        if mask is not None:
            # A static cache's mask covers all max_len slots; the model's own dynamic cache holds only the tokens
            # seen so far, and transformers 4.x sizes the causal mask from the 2-D mask's length there.
            kw["attention_mask"] = mask if self.static else mask[:, :int(pos[-1]) + 1]
        if self.cache_position:
            kw["cache_position"] = pos
        if self.logits_to_keep:
            kw[self.logits_to_keep] = 1
        out = self.model(**kw)
        if not self.static:
            self.cache = out[self.cache_arg]
        return out.logits[:, -1]

    def reset(self) -> None:
        if self.static:
            self.cache.reset()  # zeroes in place: the graph's addresses stay valid
        else:
            self.cache = None
        self.next_pos = 0

    # Both entry points hold grad mode off themselves, whoever calls them: a step traced under grad mode would compile
    # an autograd graph (the kernel's op has no backward: the compile fails and the step falls back to the model's
    # attention) and keep every step's activations alive.
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, V] after the prompt (eager: prompts vary in length). mask [B, P]: a checked left-padding mask,
        given exactly when this decoder is a masked one."""
        prompt = ids.shape[1]
        slots = torch.arange(prompt, device=self.device)
        if not self.masked:
            logits = self._forward(ids, slots)
        else:
            self.mask.zero_()
            self.mask[:, :prompt].copy_(mask)
            self.pads.copy_(prompt - self.mask.sum(dim=1, keepdim=True))
            positions = (slots[None] - self.pads).clamp_(min=0)  # = cumsum(mask) - 1, pads at 0
            logits = self._forward(ids, slots, positions, self.mask)
        self.next_pos = prompt
        return logits

    @torch.no_grad()
    def step(self, tok: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] after appending tok [B]; valid until the next step (a graph's output buffer)."""
        self.tok.copy_(tok[:, None])
        self.pos.fill_(self.next_pos)
        if self.masked:
            torch.sub(self.pos, self.pads, out=self.row_pos)
            self.mask[:, self.next_pos].fill_(1)
        self.next_pos += 1
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        self.steps += 1
        if self.device.type != "cuda" or self.mode == "eager":
            with attn.using(self.model, self.variants[0]):
                return self.fn(*self.args)
        self.marked = kv.mark(self.cache)  # the steps up to the capture may run more than once (automp.llm.cache)
        if self.steps == 1:
            self._measure_kernels()
            return self._each(self._first_call)
        if self.steps == 2:
            return self._each(self._checked_step)
        return self._capture()

    def _each(self, run) -> torch.Tensor:
        """`run(variant)` for every attention variant on the same step (each writes the same keys and values into the
        same cache slots); a kernel variant that fails leaves (the model's own then runs if it was the only one), the
        model's own failure is handled as before. The last one's logits."""
        ran, logits = False, None
        for variant in list(self.variants):
            kv.rewind(self.marked)
            try:
                with attn.using(self.model, variant):
                    logits = run(variant)
            except Exception as e:
                if variant == "model":
                    raise
                self._drop(variant, f"{e!r:.200}")
                continue
            ran = True
            if self.mode == "eager":  # the model's step synchronises: nothing is captured, nothing to time
                self.variants = ["model"]
                break
        if ran:
            return logits
        kv.rewind(self.marked)  # the kernel alone was asked for, and it left
        return run("model")

    def _drop(self, variant: str, why: str) -> None:
        self.variants = [v for v in self.variants if v != variant] or ["model"]
        self.attention_note = f"decode attention {variant} left: {why}"

    def _first_call(self, variant: str) -> torch.Tensor:
        try:
            return self.fn(*self.args)
        except Exception as e:  # a compile failure: keep going uncompiled
            if self.mode != "compile" or variant != "model":
                raise
            self.fn, self.mode, self.reason = self._forward, "graph", f"torch.compile failed: {e!r:.200}"
            kv.rewind(self.marked)  # a compile can fail after running part of the step (a graph break before it)
            return self.fn(*self.args)

    def _measure_kernels(self) -> None:
        """Before torch.compile traces the decode step: the same step once, eagerly, so that each weight-only layer
        measures which kernel serves this batch's rows (automp.kernels.crossover: measured outside tracing only; a
        shape first met while tracing keeps quant_gemm). The cache's step state is rewound after it, so the compiled
        step that follows writes the same keys and values into the same slots."""
        from automp.kernels.crossover import MAX_ROWS, MIN_ROWS  # here: importing automp.llm imports no Triton
        if self.mode == "compile" and MIN_ROWS <= self.batch <= MAX_ROWS and any(
                isinstance(m, QuantLinear) for m in self.model.modules()):
            self._forward(*self.args)
            kv.rewind(self.marked)

    def _checked_step(self, variant: str) -> torch.Tensor:
        """A real step on the capture stream with sync debugging: a synchronising op means no capture."""
        self.stream = self.stream or torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught, torch.cuda.stream(self.stream):
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                logits = self.fn(*self.args)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream().wait_stream(self.stream)
        syncs = sync_warnings(str(w.message) for w in caught)
        if syncs and variant != "model":
            raise RuntimeError(f"it synchronises: {syncs[0][:200]}")
        if syncs:
            self.mode, self.reason = "eager", f"decode step synchronises, not capturable: {syncs[0][:200]}"
        return logits

    def _capture(self) -> torch.Tensor:
        """The step captured once per attention variant; where two were captured, the faster one's replays stay."""
        graphs = {}
        for variant in list(self.variants):
            graph = torch.cuda.CUDAGraph()
            try:
                with attn.using(self.model, variant), torch.cuda.graph(graph, stream=self.stream):
                    logits = self.fn(*self.args)
            except Exception as e:  # capture records, it does not run: the cache is as before
                torch.cuda.synchronize()
                if variant != "model":
                    self._drop(variant, f"CUDA graph capture failed: {e!r:.200}")
                    continue
                self.mode, self.reason, self.variants = "eager", f"CUDA graph capture failed: {e!r:.200}", ["model"]
                return self.fn(*self.args)
            graphs[variant] = graph, logits
        if not graphs:  # the kernel alone was asked for and could not be captured; the model's step never ran
            torch.cuda.synchronize()
            self.mode, self.reason = "eager", self.attention_note
            return self.fn(*self.args)
        if len(graphs) > 1:
            for graph, _ in graphs.values():
                self._replay(graph)
            wrong = attn.disagreement({v: out for v, (_, out) in graphs.items()})
            if wrong:
                self._drop("kernel", wrong)
                del graphs["kernel"]
        if len(graphs) > 1:
            chosen, self.attention_ms = attn.faster({v: functools.partial(self._replay, g) for v, (g, _) in
                                                     graphs.items()}, torch.cuda.synchronize, time.perf_counter)
            attn.remember(self.attention_key, chosen, self.attention_ms)
        else:
            chosen = next(iter(graphs))
        self.variants = [chosen]
        self.graph, self.logits = graphs[chosen]
        self._replay(self.graph)
        return self.logits

    def _replay(self, graph: torch.cuda.CUDAGraph) -> None:
        """One replay of the step being captured, from the cache's step state before it (each replay appends)."""
        kv.rewind(self.marked)
        graph.replay()


def sync_warnings(messages) -> list[str]:
    """The messages that report a synchronising CUDA call. Only those: turning sync debugging on also warns, once
    per process, that the mode "is a prototype feature", and taking that for a sync sent the first model of a
    process to eager decoding."""
    return [m for m in messages if "called a synchronizing cuda operation" in m.lower()]


def _decoder(model: nn.Module, batch: int, length: int, mode: str, masked: bool = False,
             attention: str = "auto") -> Decoder:
    """The decoder kept on the model (reused while batch, rounded length, mode, masking and weights are the same:
    a masked step takes two more inputs, so its compiled and captured step is not an unmasked one's)."""
    max_len = -(-length // _LEN_STEP) * _LEN_STEP
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None:
        if length > limit:
            raise ValueError(f"automp.llm.generate: prompt + new tokens = {length} exceeds the model's "
                             f"max_position_embeddings {limit}")
        max_len = min(max_len, limit)
    dec = model.__dict__.get(_ATTR)
    if dec is None or dec.key != _key(model, batch, max_len, mode, masked, attention):
        model.__dict__.pop(_ATTR, None)
        dec = Decoder(model, batch, max_len, mode, masked, attention)
        model.__dict__[_ATTR] = dec
    return dec


def decode_info(model: nn.Module) -> dict:
    """How the last generate() on `model` decoded: cache kind, mode actually used, and why it differs if it does."""
    dec = model.__dict__.get(_ATTR)
    if dec is None:
        return {}
    return {"cache": "static" if dec.static else "dynamic", "mode": dec.mode, "captured": dec.graph is not None,
            "max_len": dec.max_len, "reason": dec.reason, "attention": dec.variants[0] if len(dec.variants) == 1
            else None, "attention_ms": dec.attention_ms, "attention_note": dec.attention_note}


def pick(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens [B] from logits [B, V]: argmax at temperature 0, else a sample from the top_k tokens."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)[:, 0]


def _left_padding(mask, shape: tuple) -> torch.Tensor | None:
    """The checked attention mask as int64 on its device, or None where it declares no padding (all ones: the
    unmasked decoder gives the same tokens without a mask's extra work)."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != shape:
        raise ValueError(f"automp.llm.generate: attention_mask must be a tensor of input_ids' shape {shape}, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    if mask.is_floating_point() or mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("automp.llm.generate: attention_mask must hold only 0 (pad) and 1 (token) as integers "
                         "or booleans")
    mask = mask.long()
    if not bool(mask[:, -1].all()):  # with the check below: a row of zeros, or a row that ends in padding
        rows = (mask[:, -1] == 0).nonzero()[:, 0].tolist()
        raise ValueError(f"automp.llm.generate: attention_mask rows {rows} end in padding (or are all padding): "
                         "only left padding is supported, each row's last token must be real")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        rows = (mask[:, 1:] < mask[:, :-1]).any(dim=1).nonzero()[:, 0].tolist()
        raise ValueError(f"automp.llm.generate: attention_mask rows {rows} have padding after a token: only left "
                         "padding is supported (each row's zeros first, then its ones)")
    return None if bool(mask.all()) else mask


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, generator: torch.Generator | None = None, eos_token_id: int | None = None,
             mode: str = "auto", attention_mask: torch.Tensor | None = None, attention: str = "auto") -> torch.Tensor:
    """Prompt + up to max_new_tokens generated ids, [B, P + n] (like transformers' generate).

    Greedy at temperature 0; otherwise samples (optionally from the top_k tokens) with `generator`. Stops early
    once every sequence has produced eos_token_id (finished ones are padded with it). mode: "auto" (compiled and
    CUDA-graph-captured decode step on CUDA, eager elsewhere), "compile", "graph" (captured, not compiled), "eager".

    Prompts of different lengths: left-pad them into input_ids and pass attention_mask [B, P] (1 = token, 0 = pad,
    each row's zeros first), as with transformers; each row then gets the tokens it gets alone. The mask is the only
    way padding is declared: pad ids are ordinary ids, so a padded batch without a mask decodes the pads as prompt.

    attention: the decode step's attention, "auto" (on CUDA the step is captured with the model's own and with
    automp's decode kernel and the faster one's replays stay, the verdict cached for later runs: automp.llm.attention),
    "model" or "kernel".
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long \
            or input_ids.shape[1] == 0:
        raise ValueError("automp.llm.generate: input_ids must be an int64 tensor [batch, prompt_len >= 1], got "
                         f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"automp.llm.generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if temperature < 0 or (top_k is not None and top_k < 1):
        raise ValueError(f"automp.llm.generate: need temperature >= 0 and top_k >= 1, got {temperature}, {top_k}")
    if mode not in MODES:
        raise ValueError(f"automp.llm.generate: mode must be one of {MODES}, got {mode!r}")
    if attention not in attn.ATTENTIONS:
        raise ValueError(f"automp.llm.generate: attention must be one of {attn.ATTENTIONS}, got {attention!r}")
    device = input_embedding(model)[0]
    for m in model.modules():
        if isinstance(m, QuantLinear):
            check_backend(m.bits, device)
    mask = None if attention_mask is None else _left_padding(attention_mask, tuple(input_ids.shape))
    ids = input_ids.to(device)
    mask = None if mask is None else mask.to(device)
    batch, prompt = ids.shape
    dec = _decoder(model, batch, prompt + max_new_tokens, mode, masked=mask is not None, attention=attention)
    dec.reset()
    was_training = model.training
    model.eval()
    try:
        out = torch.empty(batch, prompt + max_new_tokens, dtype=torch.long, device=device)
        out[:, :prompt] = ids
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        logits = dec.prefill(ids, mask)
        n = 0
        while True:
            tok = pick(logits, temperature, top_k, generator)
            if eos_token_id is not None:
                tok = torch.where(done, torch.full_like(tok, eos_token_id), tok)
                done |= tok == eos_token_id
            out[:, prompt + n] = tok
            n += 1
            if n == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                break
            logits = dec.step(tok)
    finally:
        model.train(was_training)
    return out[:, :prompt + n]
