"""`automp llm bench ... --profile`: where one decode step's time goes, per case and batch size.

At batch 1 a step should cost its weight bytes over the memory bandwidth; int4 reads a quarter of fp16's bytes yet
is not four times as fast. One step (after warm-up: compiled and replayed as a CUDA graph, as it is timed) runs under
torch.profiler with CUDA activities, and its kernels' time is summed by category from their names:
  quantized   automp's weight-only kernels (_wq_gemv / _wq_rows / _wq_gemm and the split-K sum), torchao's
              (tinygemm's int4pack, int8 kernels): the work of reading the packed weights
  attention   flash / memory-efficient / fused attention, softmax
  matmul      any other GEMM / GEMV (cuBLAS, CUTLASS, Inductor's mm templates): the 16-bit lm_head above all
  other       norms, rotary, cache writes, sampling, copies: what a step spends beside reading weights
beside the step's wall time (median of replays without the profiler): wall minus kernel time is the GPU idling
between kernels. The largest kernels by name are kept, so a category can be checked against what ran. If a graph
replay shows no kernels to the profiler, the compiled step runs uncaptured instead and the row says so. On the CPU
(--quick) the aten ops' own CPU time stands in for kernels.

Rows merge by (model, case, batch) into `<out>/llm-profile-<gpu>.json` (and `.md`).
"""
from __future__ import annotations

import re
from typing import Callable

import torch
import torch.nn as nn

from automp.bench import kernel_profile
from automp.bench.harness import fmt, header
from automp.bench.llm_results import one_line
from automp.timing import time_fn

CATEGORIES = ("quantized", "attention", "matmul", "other")
_PATTERNS = (  # first match wins
    ("quantized", re.compile(r"_wq_|split_sum|int4pack|tinygemm|int8|int4|dequant", re.I)),
    ("attention", re.compile(r"attention|attn|flash|fmha|sdpa|softmax", re.I)),
    ("matmul", re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|splitk|triton_tem|(^|[_:])(b|add)?mm(_|$)",
                          re.I)),
)


def category(name: str) -> str:
    return kernel_profile.category(name, _PATTERNS)


@torch.no_grad()  # as generate runs it: a step under grad mode would be another compile
def profile_step(model: nn.Module, length: int, mode: str, replays: int = 10, attention: str = "auto",
                 batch: int = 1) -> dict:
    """Kernel time by category and wall time of one decode step of `model` for `batch` sequences, whose last
    generate() made the decoder for that batch and `length` tokens (the one reused here: no new compile)."""
    from automp.llm.generate import _decoder
    dec = _decoder(model, batch, length, mode, attention=attention)
    device = dec.device
    tok = torch.zeros(batch, dtype=torch.long, device=device)
    replays = min(replays, dec.max_len - dec.next_pos - 3)  # every step fills one more cache slot
    if replays < 1:
        raise RuntimeError(f"the decoder has {dec.max_len - dec.next_pos} free cache slots, need at least 4")
    # two warm-up steps: compiled and captured already, unless this decoder is new
    wall_ms = time_fn(lambda: dec.step(tok), warmup=2, iters=replays, device=device)
    found = kernel_profile.profiled(lambda: dec.step(tok), device)
    source = "graph replay" if dec.graph is not None else f"{dec.mode} step"
    if not found and device.type == "cuda":
        found = kernel_profile.profiled(lambda: dec.fn(*dec.args), device)
        source = f"{dec.mode} step uncaptured (the graph replay showed the profiler no kernels)"
    return {"step_ms": wall_ms, **kernel_profile.summed(found, _PATTERNS), "source": source}


def profile_case(model: nn.Module, m, case: str, row: dict, profiles, expired: list,
                 log: Callable[[str], None], how: dict) -> None:
    """The case's profile row at the row's batch size (after a generate of that batch: reuses the decoder the timed
    samples use). how: generate's decode settings for the case (llm_speed.decode_args), those of its timed decoder."""
    from automp.llm.generate import generate
    batch = row["batch"]
    row = {k: v for k, v in row.items() if v is not None and v != ""}  # the speed row's unfilled keys
    ids = torch.randint(0, model.config.vocab_size, (batch, m.prompt), generator=torch.Generator().manual_seed(1))
    try:
        generate(model, ids.to(m.device), m.new_tokens, **how)
        if expired:
            raise expired[0]
        row.update(profile_step(model, m.prompt + m.new_tokens, m.mode, attention=how["attention"], batch=batch))
    except Exception as e:
        if expired or isinstance(e, TimeoutError):
            raise
        row["error"] = one_line(e)
    profiles.add(row)
    log(f"{case} batch {batch} profile: " + (row.get("error") or ", ".join(
        f"{k} {row[k]:.3f}" for k in ("step_ms", "kernel_ms", *(f"{c}_ms" for c in CATEGORIES)))))


def markdown(rows: list[dict]) -> str:
    lines = header("llm profile", rows, [
        "one batch-1 decode step under torch.profiler; ms of kernel time by category, step = wall time of a step "
        "without the profiler (median of replays)"])
    lines += ["", "| model | layers | case | step ms | kernels ms | quantized | attention | matmul | other | kernels | "
              "largest kernel | notes |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        top = r.get("top") or [{}]
        biggest = f"{top[0].get('name', '')[:60]} ({fmt(top[0].get('ms'), '.3f')})" if top[0] else ""
        lines.append(f"| {r['model']} | {r.get('layers', '')} | {r['case']} | {fmt(r.get('step_ms'), '.3f')} | "
                     f"{fmt(r.get('kernel_ms'), '.3f')} | "
                     + " | ".join(fmt(r.get(f"{c}_ms"), ".3f") for c in CATEGORIES)
                     + f" | {r.get('kernels', '')} | {biggest.replace('|', '/')} | "
                     f"{(r.get('error') or r.get('source') or '').replace('|', '/')} |")
    return "\n".join(lines) + "\n"
