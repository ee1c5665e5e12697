"""Decode speed by model, case and batch size: what `automp llm bench --model/--batches/--cases` runs.

    automp llm bench --only speed --model llama-8b-shape --layers 8 --batches 1,8,32 \
        --cases fp16-compiled,automp-int8,automp-int4,torchao-int8,torchao-int4 --out benchmarks

Models have random weights built on the device (no download): `llama-8b-shape` is Llama-3-8B's widths (hidden 4096,
FFN 14336, 32 heads, 8 KV heads, vocabulary 128256, untied head) with 32 decoder layers or `--layers N`; `llama-1b`
is TinyLlama-1.1B's. Both are automp.llm.store's built-in Llama with its dims overridden; --quick shrinks either to
hidden 64 on the CPU.

Cases, each through automp.llm.generate's static-cache decode (compiled and captured as a CUDA graph on a GPU; the
attention is the model's SDPA, but for automp's cases generate's default choice: decode_args):
  fp16-compiled      fp16 weights: the anchor
  automp-int8/int4   automp.llm.quantize, group 128 (q/k/v and gate/up fused)
  torchao-int8/int4  torchao's quantize_ with Int8WeightOnlyConfig (per row) / Int4WeightOnlyConfig(group_size=128)
                     in the tinygemm layout ("tile_packed_to_4d": torch's own kernel, no extra package), on the
                     decoder blocks' linears (lm_head stays 16-bit, as in automp's cases). tinygemm takes bf16 weights
                     only: a case whose fp16 model fails to quantize or to run one token is rebuilt in bf16 and its
                     row's note says so. They compile under the Inductor settings torchao recommends for them
                     (TORCHAO_INDUCTOR: coordinate-descent tuning, int_mm fused with its scale), applied to these
                     cases only: without them torchao's int8 casts its weights to fp16 in a kernel of their own at
                     every step and falls far behind the fp16 anchor, no peer worth the name.

Every case builds its model once, at the first batch size that runs it, and keeps it for the rest. Each batch size
then runs in two phases. Warm: case by case, under the case's alarm and Inductor settings, one untimed decode
(compile, autotune, capture) and the row's static facts; dynamo's caches are dropped before the next case compiles
(generate captures the step as a CUDA graph by hand, and a captured graph replays without the compiled code). Time:
--repeats rounds, each one sample of every warmed case, in harness.block_order's order (A B C, C B A, ...; the timing
itself is automp.bench.llm_rounds). Cases timed one after another meet a host and GPU that drift meanwhile, and the
drift goes into their ratio as if it were the cases'; alternating rounds cancel a drift linear in time. generate keeps
one decoder per model, made for one batch size (its static cache, compiled step and CUDA graph have that batch's
shapes), so every batch size is one more compile per case; a second model of the same case and shapes would reuse
the compiled code. Dynamo's limit of compiled versions per frame is raised, so no case runs uncompiled unnoticed.

Row: a sample is (t(N new tokens) - t(1)) / (N - 1), one decode step of the whole batch, each call timed alone;
ms_per_token = the median of the case's rounds, spread = [least, greatest] of them, rounds = their number, so
tokens_per_s = batch * 1000 / ms_per_token; weight_gib = every parameter and buffer (torchao's packed tensors by
their inner tensors); roofline_frac = the bytes a step must read / the copy bandwidth measured in this process / the
step time, where the bytes are every weight but the input embedding plus the KV cache entries the step attends to,
taken at their mean over the timed steps (prompt + N / 2 tokens per row), not the whole static cache the attention
kernel may sweep. A failing sample makes its case's row an error and drops it from the later rounds; past
--time-limit no sample starts, and a row keeps the rounds it has.
Rows merge by (model, case, batch) into `<out>/llm-<gpu>.json` and `.md`, rewritten after every row.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from automp.bench.harness import fmt, free
from automp.bench.llm_results import ROW_KEYS, Results, one_line, summary, sync
from automp.bench.llm_rounds import time_rounds, timed_row
from automp.timing import time_fn

MODELS = {
    "llama-8b-shape": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                           rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama-1b": {},  # automp.llm.store's built-in as it is: TinyLlama-1.1B's shape
}
# --quick, CPU-sized: the FFN 7/2 of the hidden width, 4 heads a KV head
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=1024)


@dataclass(frozen=True)
class Matrix:
    """One speed-matrix run, as the command line gave it."""
    model: str
    layers: int | None       # None: the model's own depth
    batches: tuple[int, ...]
    cases: tuple[str, ...]
    prompt: int
    new_tokens: int
    repeats: int              # alternating rounds of timed samples per batch size
    group: int
    device: str
    tiny: bool
    mode: str                 # generate's decode mode
    case_timeout: float       # seconds per case, 0 = none
    time_limit: float         # seconds for the whole run, 0 = none
    profile: bool


# ----------------------------------------------------------------------------------------------- models and cases
def dims(m: Matrix) -> dict:
    """The transformers LlamaConfig arguments of the run's model."""
    from automp.llm.store import BUILTIN
    over = dict(TINY) if m.tiny else {**BUILTIN["llama-1b"][2], **MODELS[m.model]}
    if m.layers is not None:
        over["num_hidden_layers"] = m.layers
    return over


def build_model(m: Matrix, dtype: torch.dtype) -> nn.Module:
    from automp.llm.store import build
    return build("llama-1b", m.device, dtype, **dims(m))


# torchao.quantization.utils.recommended_inductor_config_setter's Inductor settings, as a patch for the torchao
# cases alone (quantize_'s set_inductor_config would set them for the rest of the process, and so for later cases)
TORCHAO_INDUCTOR = {"coordinate_descent_tuning": True, "coordinate_descent_check_all_directions": True,
                    "force_fuse_int_mm_with_mul": True}


def inductor_settings(case: str) -> contextlib.AbstractContextManager:
    """The Inductor settings a case compiles under: torchao's recommended ones for its cases (those this torch
    has), the defaults for the rest."""
    if not case.startswith("torchao-"):
        return contextlib.nullcontext()
    import torch._inductor.config as inductor
    return inductor.patch({k: v for k, v in TORCHAO_INDUCTOR.items() if hasattr(inductor, k)})


def decode_args(m: Matrix, case: str) -> dict:
    """generate()'s decode settings for a case. automp's cases decode as automp.llm does by default (attention "auto":
    the step captured with SDPA and with automp's decode kernel, the faster kept); the anchor and torchao's cases
    with the model's own SDPA attention, as a user of compiled transformers or torchao decodes."""
    return {"mode": m.mode, "attention": "auto" if case.startswith("automp-") else "model"}


def torchao_missing() -> bool:
    try:
        importlib.import_module("torchao.quantization")
    except ImportError:
        return True
    return False


def _block_linears(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn.split(".")[-1] != "lm_head"


def _torchao(case: str, m: Matrix, dtype: torch.dtype) -> nn.Module:
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    config = Int8WeightOnlyConfig(set_inductor_config=False) if case == "torchao-int8" else Int4WeightOnlyConfig(
        group_size=m.group, int4_packing_format="tile_packed_to_4d", set_inductor_config=False)
    model = build_model(m, dtype)
    quantize_(model, config, filter_fn=_block_linears)
    with torch.no_grad():  # one eager token: an fp16 model the kernels reject fails here, not in the timed decode
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=m.device))
    return model


def prepare(case: str, m: Matrix) -> tuple[nn.Module, str]:
    """The case's model on the device, and a note on how it differs from what its name says (or "")."""
    if case == "fp16-compiled":
        return build_model(m, torch.float16), ""
    if case.startswith("automp-"):
        from automp.llm.quantize import quantize
        return quantize(build_model(m, torch.float16), case.removeprefix("automp-"), m.group), ""
    try:
        return _torchao(case, m, torch.float16), ""
    except Exception as e:  # tinygemm: bf16 only
        why = one_line(e)
    free()
    return _torchao(case, m, torch.bfloat16), f"bf16 (fp16 failed: {why})"


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a wrapper subclass (torchao's quantized weights) by its inner tensors."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names if getattr(t, n) is not None)
    return t.numel() * t.element_size()


def model_bytes(model: nn.Module) -> int:
    """Every distinct parameter and buffer (tied weights once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += tensor_bytes(t)
    return total


def step_bytes(model: nn.Module, batch: int, m: Matrix) -> int:
    """What one decode step must read (see the module docstring): weights but the input embedding, plus the KV cache
    at its mean length over the timed steps."""
    from automp.llm.quantize import input_embedding
    _, dtype, emb, tied = input_embedding(model)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = batch * c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * dtype.itemsize
    return model_bytes(model) - (0 if tied else emb) + int(kv * (m.prompt + m.new_tokens / 2))


# ----------------------------------------------------------------------------------------------- one row
def base_row(m: Matrix, case: str, batch: int, meta: dict) -> dict:
    return {**{k: None for k in ROW_KEYS}, "model": m.model, "case": case, "batch": batch,
            "layers": dims(m)["num_hidden_layers"], **meta}


def warm(model: nn.Module, m: Matrix, batch: int, row: dict, bandwidth: float, expired: list) -> torch.Tensor:
    """A batch size's untimed first decode (compile, autotune, capture) and the row's static facts; returns the prompt
    ids its timed samples decode. Raises the case's TimeoutError if the alarm went off (a compile that swallowed it
    still ends the case)."""
    from automp.llm.generate import decode_info, generate
    device = torch.device(m.device)
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, m.prompt), generator=gen).to(device)
    t0 = time.perf_counter()
    how = decode_args(m, row["case"])
    out = generate(model, ids, m.new_tokens, **how)  # equal lengths: no padding, so no attention_mask
    sync(device)
    warm_s = time.perf_counter() - t0
    if expired:
        raise expired[0]
    if tuple(out.shape) != (batch, m.prompt + m.new_tokens):
        raise RuntimeError(f"generated {tuple(out.shape)}, expected {(batch, m.prompt + m.new_tokens)}")
    info = decode_info(model)
    generate(model, ids, 1, **how)  # t(1)'s call, which must keep the decoder t(N) compiled and captured
    if decode_info(model).get("max_len") != info.get("max_len"):
        raise RuntimeError(f"prompt + 1 and prompt + {m.new_tokens} tokens need static caches of different lengths: "
                           "every sample would build its decoder again; lower --new-tokens")
    notes = [row["note"]] if row.get("note") else []
    if info.get("mode") != m.mode or info.get("reason"):
        notes.append(f"decode {info.get('mode')}: {info.get('reason')}".strip(": "))
    if info.get("attention_ms"):  # generate timed its step with each attention and kept the faster (llm.attention)
        notes.append(f"{info['attention']} attention (step replays, ms: " + ", ".join(
            f"{k} {v:.4f}" for k, v in info["attention_ms"].items()) + ")")
    elif info.get("attention_note"):
        notes.append(info["attention_note"])
    row.update(attention=info.get("attention"), attention_ms=info.get("attention_ms"))
    row.update(warmup_s=round(warm_s, 2), decode=info.get("mode"), weight_gib=model_bytes(model) / 2**30,
               dtype=str(next(model.parameters()).dtype).removeprefix("torch."), bandwidth_gbps=bandwidth,
               step_gib=step_bytes(model, batch, m) / 2**30)
    if notes:
        row["note"] = "; ".join(notes)
    return ids


def sample(model: nn.Module, m: Matrix, ids: torch.Tensor, case: str) -> float:
    """One timed sample of a warmed case: ms of one decode step of the whole batch, (t(N) - t(1)) / (N - 1), each call
    timed alone with the device synchronized around it (so the prompt and the first token cancel)."""
    from automp.llm.generate import generate
    device = torch.device(m.device)
    how = decode_args(m, case)
    full = time_fn(lambda: generate(model, ids, m.new_tokens, **how), warmup=0, iters=1, device=device)
    one = time_fn(lambda: generate(model, ids, 1, **how), warmup=0, iters=1, device=device)
    return (full - one) / (m.new_tokens - 1)


# ----------------------------------------------------------------------------------------------- the run
class Case:
    """One case across the batch sizes: its model (built at the first batch size that runs the case, kept for the
    rest), the note on how it differs from its name, the seconds its alarm has run, and once known (`over`) the error
    or skip of its batch sizes still to come."""

    def __init__(self, name: str, m: Matrix, meta: dict, results: Results, log: Callable[[str], None]):
        self.name, self.m, self.meta, self.results, self.log = name, m, meta, results, log
        self.model: nn.Module | None = None
        self.note, self.used = "", 0.0
        self.over = {"skipped": "pip install torchao"} if name.startswith("torchao-") and torchao_missing() else {}

    def row(self, batch: int) -> dict:
        return dict(base_row(self.m, self.name, batch, self.meta), **({"note": self.note} if self.note else {}))

    def finish(self, row: dict, **why: str) -> None:
        row.update(why)
        self.results.add(row)
        shown = why or {"ms/step": fmt(row["ms_per_token"], ".3f"), "spread": row.get("spread"),
                        "tokens/s": fmt(row["tokens_per_s"], ".1f"), "roofline": fmt(row["roofline_frac"], ".2f"),
                        "warm-up s": row.get("warmup_s"), "note": row.get("note", "")}
        self.log(f"{self.name} batch {row['batch']}: {shown}")


def run_matrix(m: Matrix, results: Results, profiles: Results | None, meta: dict,
               log: Callable[[str], None]) -> None:
    """Each batch size in turn: every case warmed (phase A), then all of them timed in alternating rounds (phase B);
    rows go to `results` as soon as they are final."""
    from automp.bench.harness import copy_bandwidth_gbps
    start = time.perf_counter()
    deadline = start + m.time_limit if m.time_limit > 0 else math.inf
    bandwidth = copy_bandwidth_gbps(2**30 if m.device == "cuda" else 2**26)
    log(f"copy bandwidth {bandwidth:.0f} GB/s; {m.model} {dims(m)}")
    cases = [Case(name, m, meta, results, log) for name in m.cases]
    with torch._dynamo.config.patch(recompile_limit=max(64, 2 * len(m.batches) + 2)):
        for batch in m.batches:
            warmed = {}
            for c in cases:
                got = warm_case(c, batch, bandwidth, deadline, profiles)
                if got is not None:
                    warmed[c] = got
                free(dynamo=True)  # the next case compiles other graphs: drop this one's (captured ones replay on)
            time_batch(warmed, m, batch, deadline, log)
            for c in cases:
                if c.over:
                    c.model = None  # its later batch sizes do not run
            free()
    log(f"{summary(results.added)} in {time.perf_counter() - start:.0f} s")


def warm_case(c: Case, batch: int, bandwidth: float, deadline: float,
              profiles: Results | None) -> tuple[dict, torch.Tensor] | None:
    """Phase A of one case at one batch size, under the case's alarm (--case-timeout over all its batch sizes, or what
    is left of --time-limit) and its Inductor settings: its model built if it is not yet, the untimed decode and the
    row's facts (warm), and with --profile the profile of that batch size. Returns the row and the prompt ids to time,
    or None where the row is final already: a failing batch is an error row and the next batch size runs; an alarm
    ends the case, its later batch sizes skipped."""
    from automp.bench.llm_profile import profile_case
    from automp.bench.zoo_modes import time_limit
    m = c.m
    row = c.row(batch)
    left = deadline - time.perf_counter()
    own = m.case_timeout - c.used if m.case_timeout > 0 else math.inf
    if c.over or left <= 0 or own <= 0:
        c.finish(row, **(c.over or {"skipped": "time limit" if left <= 0 else "case timeout"}))
        return None
    flag, limit = ("--time-limit", m.time_limit) if left <= own else ("--case-timeout", m.case_timeout)
    stage, warmed, expired, t0 = "prepare", None, [], time.perf_counter()
    try:
        with time_limit(min(left, own) if math.isfinite(min(left, own)) else 0) as expired, \
                inductor_settings(c.name):
            if c.model is None:
                c.model, c.note = prepare(c.name, m)
                c.log(f"{c.name}: model ready in {time.perf_counter() - t0:.1f} s {c.note}")
                row = c.row(batch)
            stage = "batch"
            try:
                warmed = row, warm(c.model, m, batch, row, bandwidth, expired)
            except Exception as e:
                if expired or isinstance(e, TimeoutError):
                    raise
                c.finish(row, error=one_line(e))
            stage = "profile"  # an alarm from here on must not turn the warmed row into an error
            if profiles is not None and warmed is not None:
                profile_case(c.model, m, c.name, c.row(batch), profiles, expired, c.log, decode_args(m, c.name))
    except Exception as e:
        timed_out = bool(expired) or isinstance(e, TimeoutError)
        error = f"ran past {flag} {limit:g} s" if timed_out else one_line(e)
        if stage == "profile" and profiles is not None:
            profiles.add(dict(base_row(m, c.name, batch, c.meta), error=error))
        else:
            c.finish(row, error=error)
        c.over = {"error": error} if stage == "prepare" else {"skipped": (
            "case timeout" if flag == "--case-timeout" else "time limit") if timed_out else "the case failed"}
    finally:
        c.used += time.perf_counter() - t0
    return warmed


def time_batch(warmed: dict[Case, tuple[dict, torch.Tensor]], m: Matrix, batch: int, deadline: float,
               log: Callable[[str], None]) -> None:
    """Phase B of one batch size: the warmed cases timed in alternating rounds (automp.bench.llm_rounds), each row
    written once its rounds are done, a case whose sample fails written at once as an error row."""
    from automp.llm.generate import decode_info, generate
    for c, (row, ids) in list(warmed.items()):
        # a step that runs uncaptured through compiled code lost that code to free(dynamo=True): compile it again
        # (and capture it, for a decode too short to have been), untimed, under the case's Inductor settings
        for tries in range(3 if m.device == "cuda" and m.mode == "compile" else 0):
            info = decode_info(c.model)
            if info.get("captured") or (tries and info.get("mode") == "eager"):  # eager: it will never capture
                break
            try:
                with inductor_settings(c.name):
                    generate(c.model, ids, m.new_tokens, **decode_args(m, c.name))
            except Exception as e:
                c.finish(row, error=one_line(e))
                del warmed[c]
                break
    if not warmed:
        return
    log(f"batch {batch}: {', '.join(c.name for c in warmed)} in {m.repeats} alternating rounds")
    calls = {c: (lambda c=c, ids=ids: sample(c.model, m, ids, c.name)) for c, (_, ids) in warmed.items()}
    steps = time_rounds(calls, m.repeats, deadline, lambda c, e: c.finish(warmed[c][0], error=one_line(e)))
    for c, ms in steps.items():
        if ms:
            c.finish(timed_row(warmed[c][0], ms, batch, m.repeats))
        else:
            c.finish(warmed[c][0], skipped="time limit")
