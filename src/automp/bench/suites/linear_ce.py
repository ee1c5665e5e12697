"""`automp bench linear_ce`: an output layer + cross-entropy, forward and backward, as Inductor compiles the model's
own ops against automp's blocks of rows (automp.precision.linear_ce), in one process.

Modes (each compiled with torch.compile under bf16 autocast, as the stock compiled paths run them; FP32 weight, bf16
hidden states, a loss with mean reduction):
  stock             F.cross_entropy(F.linear(h, W).float(), target), the logits returned detached: what a
                    transformers causal LM computes when the script reads its loss only. The anchor.
  blocks            automp's rewrite of the same: loss and both gradients a block of rows at a time, the logits
                    still returned (the rewrite keeps every output the graph had)
  blocks-no-logits  the same without the logits: the memory the loss itself needs

Timing: rounds of alternating blocks (A B C, C B A, ...), each block the median of --iters steps (CUDA events);
the row gives the median over the rounds and their spread. peak_gib: the most memory allocated above what was
there before the mode's step (inputs and the weight's gradient of the previous step freed), over one step.
Defaults: Llama-3.2-1B's head (hidden 2048, vocabulary 128256) at 8192 tokens (B4 x T2048).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from automp.bench.fp8_run import Peak
from automp.bench.harness import block_order, command_line, cpu_refusal, fmt, free, provenance, usage_problem
from automp.files import write_json_and_markdown
from automp.precision import linear_ce
from automp.timing import time_fn

SUITE = "linear_ce"
MODES = ("stock", "blocks", "blocks-no-logits")
ANCHOR = "stock"


def _fn(mode: str, h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> Callable[[], Any]:
    rows, vocab = h.shape[0], w.shape[0]
    if mode == "stock":
        def fn() -> Any:
            logits = F.linear(h, w)
            return F.cross_entropy(logits.float(), target), logits.detach()
    else:
        shape = (rows, vocab) if mode == "blocks" else None

        def fn() -> Any:
            return linear_ce.linear_cross_entropy(h, w, None, target, logits_shape=shape)
    return fn


def _step(mode: str, h: torch.Tensor, w: torch.Tensor, target: torch.Tensor, device: str) -> Callable[[], Any]:
    compiled = torch.compile(_fn(mode, h, w, target))

    def step() -> torch.Tensor:
        h.grad = w.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            loss, _ = compiled()
        loss.backward()
        return loss
    return step


def _peak_gib(step: Callable[[], Any], device: str) -> float | None:
    """One step's peak allocated memory above what was there before it (bench.fp8_run.Peak), after a step whose
    gradients the measured step frees."""
    if device != "cuda":
        return None
    step()
    free()
    peak, row = Peak(device), {}
    step()
    peak.into(row, "")
    return row["peak_gib"]


def run(tokens: int, hidden: int, vocab: int, rounds: int, iters: int, device: str,
        modes: tuple[str, ...] = MODES) -> list[dict[str, Any]]:
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * hidden ** -0.5).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=device, generator=g)
    steps = {m: _step(m, h, w, target, device) for m in modes}
    losses = {m: float(steps[m]()) for m in modes}  # compiles each, outside the timed blocks
    peaks = {m: _peak_gib(steps[m], device) for m in modes}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for order in block_order(modes, rounds):
        for m in order:
            times[m].append(time_fn(steps[m], warmup=2, iters=iters, device=device))
    meta = provenance(device)
    anchor = statistics.median(times[ANCHOR]) if ANCHOR in times else None
    rows = []
    for m in modes:
        ms = statistics.median(times[m])
        rows.append({"mode": m, "ms": round(ms, 3), "spread_ms": [round(min(times[m]), 3), round(max(times[m]), 3)],
                     "ratio_vs_stock": round(anchor / ms, 3) if anchor else None, "peak_gib": peaks[m],
                     "loss": round(losses[m], 5), "tokens": tokens, "hidden": hidden, "vocab": vocab,
                     "block_rows": linear_ce.block_rows(tokens, vocab), "rounds": rounds, **meta})
    return rows


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    first = rows[0]
    lines = ["# automp bench linear_ce", "", f"- {first['device']} · torch {first['torch']} · {first['date']} · "
             f"commit {first['commit']} · `{command}`",
             f"- {first['tokens']} tokens, hidden {first['hidden']}, vocabulary {first['vocab']}, "
             f"{first['block_rows']} rows a block; ratio: stock ms / mode ms; {first['rounds']} alternating rounds",
             "", "| mode | ms | spread | ratio vs stock | peak GiB | loss |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['ms']:.3f} | {r['spread_ms'][0]:.3f}-{r['spread_ms'][1]:.3f} | "
                     f"{fmt(r['ratio_vs_stock'], '.3f')} | {fmt(r['peak_gib'], '.2f')} | {r['loss']:.5f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="automp bench linear_ce", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="rows of the hidden states (batch x sequence)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of timed blocks")
    p.add_argument("--iters", type=int, default=10, help="steps per timed block")
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run (a CPU runs only these)")
    p.add_argument("--out", default="bench-results/linear_ce", help="prefix of the .json and .md written")
    args = p.parse_args(argv)
    problem = usage_problem([], [("--tokens", args.tokens, 1), ("--hidden", args.hidden, 1), ("--vocab", args.vocab, 2),
                                 ("--rounds", args.rounds, 1), ("--iters", args.iters, 1)], args.out, (".json", ".md"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    problem = problem or cpu_refusal(SUITE, device, args.quick)
    if problem:
        print(problem if problem.startswith("automp") else f"automp bench {SUITE}: {problem}", file=sys.stderr)
        return 2
    if args.quick:
        args.tokens, args.hidden, args.vocab, args.rounds, args.iters = 64, 32, 300, 2, 2
    rows = run(args.tokens, args.hidden, args.vocab, args.rounds, args.iters, device)
    command = command_line("automp bench linear_ce", argv)
    md = markdown(rows, command)
    write_json_and_markdown(os.path.dirname(os.path.abspath(args.out)), os.path.basename(args.out),
                            {"command": command, "rows": rows}, md)
    print(md, end="")
    return 0
