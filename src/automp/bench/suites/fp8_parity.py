"""`automp bench fp8_parity`: does FP8 train as bf16 does? Loss after the same steps, on data that can be learned
but not memorized, for the modes of `automp bench fp8`.

The step-time suite cycles a pool of 8 random batches: a 1.2B model memorizes them within a few hundred steps, and
a loss near zero says nothing about FP8's error. Here every step gets a fresh batch of a token stream with a known
floor: each token is the previous one plus a fixed stride plus a uniform draw from 0..K-1, modulo an active
vocabulary of the first --active-vocab ids, so the model must learn, for each of those ids, the K that can follow
it. The loss falls from ln(vocab) to about ln(active) as the model learns which ids occur, then towards ln(K) as it
learns the table. The defaults (512 ids, K = 4: 2,048 pairs, each seen ~4 times per batch of 8,192 tokens) are a
table a model learns within a few hundred steps: Llama-3-8B dims with 2 layers at lr 1e-4 read 1.69 nats over
steps 1-50 and 1.44 at step 1,000 (the floor is 1.39), a 4-layer d256 Llama 3.6 at step 300. Larger tables learned too late to compare two precisions: at 4,096 ids and K = 16 a 1.2B
Llama stayed at ln(4096) for 2,000 steps; over the whole 128,256-id vocabulary it sat at ln(vocab) for 1,400-1,900
steps and then dropped at a step that differed from run to run. The stream is drawn on the device from a generator
seeded by the step's index: every mode, in any process, sees the same batches.

Each mode runs alone (one mode per process suits one GPU each: `--modes automp-fp8` on one card while
`--modes bf16-reduce-overhead` runs on another), from the same seed, with the loops of `automp bench fp8`. --seeds
runs each mode once per seed, the seed drawing both the model's initial weights and the stream, so a difference
between modes can be read against the spread between seeds of one mode (the markdown's "between seeds" table). The loss
at a checkpoint is the mean over the WINDOW steps that end there (one batch's loss is noisy). Rows
`{"model", "mode", "seed", "steps", "active_vocab", "successors", "loss_at": {step: mean loss}, "window", "seconds",
"fp8_fallback"}` go to `<out>.json` (rows merged by model, stream, seed and mode with those already there) and `.md`,
with each checkpoint's relative gap to bf16-reduce-overhead on the same stream and seed where the file holds both.
fp8_fallback: whether automp's loss guard moved the run back to bf16 (then the later losses are partly bf16's).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Callable

import torch

from automp.bench.fp8_workloads import LOOPS, LR, MODELS
from automp.bench.harness import device_name, fmt, gpu_slug, one_line, provenance, usage_problem
from automp.bench.suites.fp8 import ANCHOR, MODES
from automp.files import write_json_and_markdown

LM_MODELS = ("llama-d2048", "llama-d4096", "gpt2")  # the stream is tokens: the language models only
WINDOW = 50
ACTIVE = 512  # ids in the stream: a successor table learned within a few hundred steps (the module docstring)
K = 4  # successors per token: the loss floor is ln(K) = 1.39 nats
STRIDE = 7919  # a prime, so the successor sets are spread over the vocabulary


class TokenStream:
    """Batch i of a learnable token stream (the module docstring says what it is), as the LM loops take it. Indexable
    like the fp8 workloads' batch pools, with `len` the number of steps, so their loops run on it unchanged."""

    def __init__(self, vocab: int, batch: int, seq: int, device: str, steps: int, seed: int = 1234,
                 active: int = 0, successors: int = K):
        self.vocab = min(active, vocab) if active > 0 else vocab  # the ids that occur
        self.successors = successors
        self.shape, self.device, self.steps, self.seed = (batch, seq), device, steps, seed

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + i)
        start = torch.randint(0, self.vocab, (self.shape[0], 1), generator=gen, device=self.device)
        draws = torch.randint(0, self.successors, self.shape, generator=gen, device=self.device)
        draws[:, 0] = 0
        ids = (start + torch.cumsum(draws + STRIDE, dim=1) - STRIDE) % self.vocab
        return {"input_ids": ids, "labels": ids}


def run_mode(model: str, mode: str, opts: argparse.Namespace,
             emit: Callable[[dict[str, Any]], None] = lambda row: None, seed: int = 0) -> dict[str, Any]:
    """One mode's losses over --steps steps of the stream; `emit` gets the row at every checkpoint, so a run cut
    off later keeps the checkpoints it reached. `seed` draws the initial weights and the stream (0: the suite's
    original ones)."""
    import automp
    row: dict[str, Any] = {"model": model, "mode": mode, "seed": seed, "steps": opts.steps, "window": opts.window,
                           "active_vocab": opts.active_vocab, "successors": opts.successors, "lr": opts.lr,
                           "loss_at": {}, "seconds": None, "fp8_fallback": None}
    torch.manual_seed(seed)
    work = MODELS[model][0](opts.quick, opts.device, opts.layers)
    work.lr = opts.lr
    first = work.batches[0]["input_ids"]
    work.batches = TokenStream(work.model.config.vocab_size, first.shape[0], first.shape[1], opts.device,
                               opts.steps, seed=1234 + seed, active=opts.active_vocab,
                               successors=opts.successors)
    losses = torch.full((opts.steps,), math.nan, device=opts.device)
    enabled = False
    t0 = time.perf_counter()
    try:
        if mode.startswith("automp"):  # FP8 where the machine has none: enable raises, the row says why
            automp.enable(dtype=mode.split("-")[1])
            enabled = True
        step = LOOPS[mode](work, opts.device)
        for i in range(opts.steps):
            losses[i].copy_(step())  # on the device: no host read per step (a CUDA graph's output is overwritten)
            if i + 1 in opts.at and i + 1 < opts.steps:  # the last one: with the whole row, after the loop
                _read(row, losses, opts, i + 1, time.perf_counter() - t0)
                emit(row)
    except Exception as e:  # noqa: BLE001 - a failing mode keeps what it measured and says why
        row["error"] = one_line(e)
    finally:
        report = automp.disable() if enabled else None
    _read(row, losses, opts, opts.steps, time.perf_counter() - t0)
    if report is not None:
        row["fp8_fallback"] = report.get("fp8_fallback")
        row["fp8_layers"] = sum(per.get("fp8_layers", 0) for per in report.get("fp8", {}).values())
    return row


def _read(row: dict[str, Any], losses: torch.Tensor, opts: argparse.Namespace, done: int, seconds: float) -> None:
    """The row's windowed losses at the checkpoints reached after `done` steps, and its loss curve so far."""
    values = losses[:done].cpu().tolist()
    row["seconds"] = round(seconds, 1)
    for at in (a for a in opts.at if a <= done):
        window = values[max(0, at - opts.window):at]
        if window and all(math.isfinite(v) for v in window):
            row["loss_at"][str(at)] = round(sum(window) / len(window), 5)
    row["curve"] = [round(v, 4) if math.isfinite(v) else None for v in values[opts.window - 1::opts.window]]


def gaps(rows: list[dict[str, Any]]) -> None:
    """Each row's relative loss gap to the anchor's (same model, same stream) at every checkpoint both reached:
    (loss - anchor) / anchor."""
    anchors = {_stream(r): r["loss_at"] for r in rows if r["mode"] == ANCHOR}
    for r in rows:
        ref = anchors.get(_stream(r), {})
        r["gap_vs_bf16"] = {at: round((v - ref[at]) / ref[at], 5) for at, v in r["loss_at"].items()
                            if at in ref and ref[at]}


def _stream(row: dict[str, Any]) -> tuple[str, int, int, float, int]:
    """What makes two rows comparable: the model, the stream (rows without `successors` drew 16), the learning rate
    (rows without one ran at LR) and the seed (rows without one ran seed 0)."""
    return row["model"], row.get("active_vocab", 0), row.get("successors", 16), row.get("lr", LR), row.get("seed", 0)


def between_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, stream and mode run with two or more seeds, at each checkpoint all of them reached: the mean loss
    over the seeds, their spread (highest - lowest), and the mean's difference from the anchor's mean beside the
    anchor's own spread (a difference inside that spread is not one between the modes)."""
    groups: dict[tuple, dict[str, list[float]]] = {}
    for r in rows:
        key = (*_stream(r)[:4], r["mode"])
        for at, loss in r["loss_at"].items():
            groups.setdefault(key, {}).setdefault(at, []).append(loss)
    table = []
    for (model, active, successors, lr, mode), by_at in groups.items():
        for at, losses in by_at.items():
            if len(losses) < 2:
                continue
            ref = groups.get((model, active, successors, lr, ANCHOR), {}).get(at, [])
            mean = sum(losses) / len(losses)
            table.append({"model": model, "active_vocab": active, "successors": successors, "lr": lr, "mode": mode, "at": at,
                          "seeds": len(losses), "mean": round(mean, 5), "spread": round(max(losses) - min(losses), 5),
                          "diff_vs_anchor": round(mean - sum(ref) / len(ref), 5) if len(ref) >= 2 else None,
                          "anchor_spread": round(max(ref) - min(ref), 5) if len(ref) >= 2 else None})
    return table


def markdown(rows: list[dict[str, Any]], device: str) -> str:
    lines = [f"# automp bench fp8_parity · {device} · torch {torch.__version__}", "",
             f"loss: mean over the {rows[0]['window'] if rows else WINDOW} steps ending at the checkpoint, fresh "
             f"batches of a stream with floor ln(K); gap: (loss - {ANCHOR}'s) / {ANCHOR}'s", "",
             "| model | active ids | K | lr | mode | seed | steps | loss at checkpoints | gap vs bf16 | seconds | notes |",
             "|---|---:|---:|---:|---|---:|---:|---|---|---:|---|"]
    for r in rows:
        at = ", ".join(f"{k}: {v:.4f}" for k, v in r["loss_at"].items())
        gap = ", ".join(f"{k}: {100 * v:+.2f}%" for k, v in r.get("gap_vs_bf16", {}).items())
        notes = "; ".join(x for x in (r.get("error"), f"fell back to bf16: {r['fp8_fallback']}"
                                      if r.get("fp8_fallback") else None,
                                      f"{r['fp8_layers']} FP8 layers" if r.get("fp8_layers") is not None else None)
                          if x)
        lines.append(f"| {r['model']} | {r.get('active_vocab', 0) or 'all'} | {_stream(r)[2]} | {r.get('lr', LR):g} | {r['mode']} | "
                     f"{r.get('seed', 0)} | {r['steps']} | {at} | "
                     f"{gap} | {fmt(r['seconds'], '.0f')} | {notes} |")
    seeds = between_seeds(rows)
    if seeds:
        lines += ["", "## Between seeds", "",
                  f"mean and spread (highest - lowest) of the windowed loss over the seeds; difference: mean - "
                  f"{ANCHOR}'s mean, beside {ANCHOR}'s own spread", "",
                  "| model | active ids | K | lr | mode | checkpoint | seeds | mean | spread | difference "
                  "| anchor spread |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        for s in seeds:
            lines.append(f"| {s['model']} | {s['active_vocab'] or 'all'} | {s['successors']} | {s['lr']:g} | {s['mode']} | {s['at']} | "
                         f"{s['seeds']} | {s['mean']:.4f} | {s['spread']:.4f} | {fmt(s['diff_vs_anchor'], '+.4f')} | "
                         f"{fmt(s['anchor_spread'], '.4f')} |")
    return "\n".join(lines) + "\n"


def _merge(path: str, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows already in `path` (another process's modes) with `new` replacing those of the same model, stream,
    learning rate, seed and mode."""
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = []
    keys = {(*_stream(r), r["mode"]) for r in new}
    return [r for r in old if isinstance(r, dict) and (*_stream(r), r.get("mode")) not in keys] + new


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="automp bench fp8_parity", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-d2048", help=f"comma-separated, from {', '.join(LM_MODELS)}")
    p.add_argument("--modes", default=f"{ANCHOR},automp-fp8", help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--at", default="500,2000", help="checkpoints (steps) where the windowed loss is read")
    p.add_argument("--window", type=int, default=WINDOW, help="steps averaged at each checkpoint")
    p.add_argument("--active-vocab", type=int, default=ACTIVE,
                   help="ids the stream draws from (0: the whole vocabulary)")
    p.add_argument("--successors", type=int, default=K, help=f"K: the ids that can follow each id (default {K}; "
                                                                "the loss floor is ln K)")
    p.add_argument("--lr", type=float, default=LR, help=f"AdamW's learning rate in every mode (default {LR:g})")
    p.add_argument("--layers", type=int, default=4, help="llama-d4096's layers")
    p.add_argument("--seeds", default="0", help="comma-separated seeds: each mode runs once per seed (initial "
                                                "weights and stream); 0 is the suite's original")
    p.add_argument("--quick", action="store_true", help="tiny dims (a CPU smoke run)")
    p.add_argument("--out", default=None, help="writes OUT.json and .md (default: benchmarks/fp8-parity-<gpu>)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = device_name(args.device)
    args.out = args.out or os.path.join("benchmarks", f"fp8-parity-{gpu_slug(device)}" + ("-quick" if args.quick
                                                                                          else ""))
    try:
        args.at = sorted({int(a) for a in args.at.split(",") if a.strip()})
    except ValueError:
        args.at = [0]
    try:
        args.seeds = list(dict.fromkeys(int(s) for s in args.seeds.split(",") if s.strip())) or [-1]
    except ValueError:
        args.seeds = [-1]
    error = usage_problem([("--models", args.models, LM_MODELS), ("--modes", args.modes, MODES)],
                          [("--steps", args.steps, 1), ("--window", args.window, 1),
                           ("--layers", args.layers, 1), ("--active-vocab", args.active_vocab, 0),
                           ("--successors", args.successors, 1),
                           ("--lr", args.lr, 1e-12)]
                          + [("--at", a, 1) for a in args.at] + [("--seeds", s, 0) for s in args.seeds], args.out)
    if not error and args.at[-1] > args.steps:
        error = f"--at {args.at[-1]} is past --steps {args.steps}"
    if error:
        print(f"automp bench fp8_parity: {error}", file=sys.stderr)
        return 2
    out_dir, stem = os.path.split(os.path.abspath(args.out))
    meta = {**provenance(), "device": device}
    mine: dict[tuple[str, str, int], dict[str, Any]] = {}

    def emit(row: dict[str, Any]) -> None:
        mine[row["model"], row["mode"], row["seed"]] = dict(row, **meta)
        rows = _merge(args.out + ".json", list(mine.values()))
        gaps(rows)
        write_json_and_markdown(out_dir, stem, rows, markdown(rows, device))
        print(f"[{row['model']}] {row['mode']} seed {row['seed']}: loss {row['loss_at']} after {row['seconds']} s"
              + (f" ({row['error']})" if row.get("error") else ""), flush=True)

    for model in args.models.split(","):
        for seed in args.seeds:
            for mode in args.modes.split(","):
                emit(run_mode(model, mode, args, emit, seed))
    print(f"wrote {args.out}.json, .md", flush=True)
    return 0
