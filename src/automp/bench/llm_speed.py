"""Decode speed by model, case and batch size: what `automp llm bench --model/--batches/--cases` runs.

    automp llm bench --only speed --model llama-8b-shape --layers 8 --batches 1,8,32 \
        --cases fp16-compiled,automp-int8,automp-int4,torchao-int8,torchao-int4 --out benchmarks

Models have random weights built on the device (no download): `llama-8b-shape` is Llama-3-8B's widths (hidden 4096,
FFN 14336, 32 heads, 8 KV heads, vocabulary 128256, untied head) with 32 decoder layers or `--layers N`; `llama-1b`
is TinyLlama-1.1B's. Both are automp.llm.store's built-in Llama with its dims overridden; --quick shrinks either to
hidden 64 on the CPU.

Cases, each through automp.llm.generate's static-cache decode (compiled and captured as a CUDA graph on a GPU):
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

Each case builds its model once and then decodes at each batch size in turn. generate keeps one decoder per model,
made for one batch size (its static cache, compiled step and CUDA graph have that batch's shapes), so every batch
size is one more compile; a second model of the same case and shapes would reuse the compiled code (measured on the
CPU: tiny-llama at batches 1, 2, 4 compiled three graphs, a second and third model none). Dynamo's limit of 8
compiled versions per frame is raised, and its caches dropped between cases, so no case runs uncompiled unnoticed.

Row: ms_per_token = (t(N new tokens) - t(1)) / (N - 1), one decode step of the whole batch, so tokens_per_s = batch *
1000 / ms_per_token; weight_gib = every parameter and buffer (torchao's packed tensors by their inner tensors);
roofline_frac = the bytes a step must read / the copy bandwidth measured in this process / the step time, where the
bytes are every weight but the input embedding plus the KV cache entries the step attends to, taken at their mean
over the timed steps (prompt + N / 2 tokens per row), not the whole static cache the attention kernel may sweep.
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
from automp.bench.llm_results import ROW_KEYS, Results, one_line, summary
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
    repeats: int
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


def measure(model: nn.Module, m: Matrix, batch: int, row: dict, bandwidth: float, expired: list) -> dict:
    """Fill `row` with one batch size's decode speed; raises the case's TimeoutError if the alarm went off (a
    compile that swallowed it still ends the case)."""
    from automp.llm.generate import decode_info, generate
    device = torch.device(m.device)
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, model.config.vocab_size, (batch, m.prompt), generator=gen).to(device)

    def run(n: int) -> torch.Tensor:
        out = generate(model, ids, n, mode=m.mode)  # equal lengths: no padding, so no attention_mask
        if expired:
            raise expired[0]
        return out

    t0 = time.perf_counter()
    out = run(m.new_tokens)  # compile, autotune, capture
    warm = time.perf_counter() - t0
    if tuple(out.shape) != (batch, m.prompt + m.new_tokens):
        raise RuntimeError(f"generated {tuple(out.shape)}, expected {(batch, m.prompt + m.new_tokens)}")
    full = time_fn(lambda: run(m.new_tokens), warmup=0, iters=m.repeats, device=device) / 1e3
    one = time_fn(lambda: run(1), warmup=0, iters=m.repeats, device=device) / 1e3
    info = decode_info(model)
    notes = [row["note"]] if row.get("note") else []
    if info.get("mode") != m.mode or info.get("reason"):
        notes.append(f"decode {info.get('mode')}: {info.get('reason')}".strip(": "))
    row.update(warmup_s=round(warm, 2), decode=info.get("mode"), weight_gib=model_bytes(model) / 2**30,
               dtype=str(next(model.parameters()).dtype).removeprefix("torch."), bandwidth_gbps=bandwidth,
               step_gib=step_bytes(model, batch, m) / 2**30)
    if full > one:
        step = (full - one) / (m.new_tokens - 1)
        row.update(ms_per_token=step * 1e3, tokens_per_s=batch / step,
                   roofline_frac=row["step_gib"] * 2**30 / (bandwidth * 1e9) / step)
    else:
        notes.append("decode time below timing noise")
    if notes:
        row["note"] = "; ".join(notes)
    return row


# ----------------------------------------------------------------------------------------------- the run
def run_matrix(m: Matrix, results: Results, profiles: Results | None, meta: dict,
               log: Callable[[str], None]) -> None:
    """Every case in turn, each at every batch size; rows go to `results` as they finish."""
    from automp.bench.harness import copy_bandwidth_gbps
    start = time.perf_counter()
    deadline = start + m.time_limit if m.time_limit > 0 else math.inf
    bandwidth = copy_bandwidth_gbps(2**30 if m.device == "cuda" else 2**26)
    log(f"copy bandwidth {bandwidth:.0f} GB/s; {m.model} {dims(m)}")
    with torch._dynamo.config.patch(recompile_limit=max(64, 2 * len(m.batches) + 2)):
        for case in m.cases:
            run_case(case, m, bandwidth, deadline, meta, results, profiles, log)
            free(dynamo=True)  # the next case compiles other graphs: drop this one's
    log(f"{summary(results.added)} in {time.perf_counter() - start:.0f} s")


def run_case(case: str, m: Matrix, bandwidth: float, deadline: float, meta: dict, results: Results,
             profiles: Results | None, log: Callable[[str], None]) -> None:
    """One case's rows: built once, then each batch size; a failing batch gives an error row and the next one runs;
    the case's alarm (--case-timeout, or what is left of --time-limit) ends it, the rest skipped."""
    from automp.bench.llm_profile import profile_case
    from automp.bench.zoo_modes import time_limit
    rows = {b: base_row(m, case, b, meta) for b in m.batches}
    pending = list(m.batches)

    def finish(row: dict, **why: str) -> None:
        row.update(why)
        results.add(row)
        shown = why or {"ms/step": fmt(row["ms_per_token"], ".3f"), "tokens/s": fmt(row["tokens_per_s"], ".1f"),
                        "roofline": fmt(row["roofline_frac"], ".2f"), "warm-up s": row.get("warmup_s"),
                        "note": row.get("note", "")}
        log(f"{case} batch {row['batch']}: {shown}")

    left = deadline - time.perf_counter()
    skip = "pip install torchao" if case.startswith("torchao-") and torchao_missing() else (
        "time limit" if left <= 0 else None)
    if skip:
        for b in pending:
            finish(rows[b], skipped=skip)
        return
    budget = min(m.case_timeout if m.case_timeout > 0 else math.inf, left)
    flag = "--time-limit" if budget == left else "--case-timeout"
    stage: tuple[str, int | None] = ("prepare", None)
    with time_limit(budget if math.isfinite(budget) else 0) as expired, inductor_settings(case):
        try:
            t0 = time.perf_counter()
            model, note = prepare(case, m)
            log(f"{case}: model ready in {time.perf_counter() - t0:.1f} s {note}")
            for b in list(pending):
                stage = ("batch", b)
                pending.remove(b)
                row = dict(rows[b], **({"note": note} if note else {}))
                try:
                    measure(model, m, b, row, bandwidth, expired)
                except Exception as e:
                    if expired or isinstance(e, TimeoutError):
                        raise
                    row["error"] = one_line(e)
                finish(row)
                stage = ("between", None)  # an alarm from here on must not turn the written row into an error
                if profiles is not None and b == 1:
                    stage = ("profile", None)
                    profile_case(model, m, case, dict(rows[1], note=note), profiles, expired, log)
            if profiles is not None and 1 not in m.batches:
                stage = ("profile", None)
                profile_case(model, m, case, dict(base_row(m, case, 1, meta), note=note), profiles, expired, log)
        except Exception as e:
            timed_out = bool(expired) or isinstance(e, TimeoutError)
            error = f"ran past {flag} {budget:g} s" if timed_out else one_line(e)
            if stage[0] == "batch":
                finish(rows[stage[1]], error=error)
            elif stage[0] == "profile" and profiles is not None:
                profiles.add(dict(base_row(m, case, 1, meta), error=error))
            elif stage[0] == "prepare":
                for b in pending:
                    finish(rows[b], error=error)
                pending = []
            for b in pending:
                finish(rows[b], skipped=("case timeout" if flag == "--case-timeout" else "time limit")
                       if timed_out else "the case failed")
