"""`automp bench dist`: training step time under torch.distributed on 1..N GPUs of one host, anchors in the same run.

Each world size in --gpus is one torchrun launch of automp.bench.dist_worker (NCCL, one GPU per rank; gloo on CPU
processes where there is no CUDA, the smoke run). Models (per rank: B4 T2048, its own data shard):
  llama-d2048-ddp     transformers Llama at Llama-3.2-1B dims (--layers-d2048, 16), wrapped in DDP
  llama-d4096-fsdp2   Llama-3-8B dims (--layers-d4096, 4), FSDP2: fully_shard on each decoder layer, then the root.
                      B4 fits: one 80 GB GPU holds 4 layers with FP32 weights, gradients and AdamW state and the
                      128256-word logits; more GPUs shard the state, so the same batch fits with room to spare.
Modes (AdamW lr 1e-4 everywhere, the same recipe, so the losses compare):
  bf16-compile        autocast bf16 + torch.compile (default mode: CUDA graphs do not mix with DDP's/FSDP's
                      collectives) + fused AdamW; DDP: the DDP module compiled; FSDP2: each decoder layer compiled
                      before sharding (torchtitan's pattern). The anchor: ratio_vs_bf16 = its ms / the mode's
  torchao-float8      torchao's convert_to_float8_training (tensorwise recipe; FSDP2: float8 all-gather), before
                      wrapping, then the bf16-compile loop
  automp-bf16         the plain FP32 loop over the wrapped model with automp.enable(dtype=...) before and
  automp-fp8          automp.disable() after; warm-up until automp has settled on every rank
  automp-fp8-bf16-gather  automp-fp8 with fp8_all_gather=False (FSDP2 gathers the FP8 layers' weights in bf16): what
                      the FP8 all-gather gains, in the same run (not in the default --modes)
Modes run one after another (built, warmed up, timed in --blocks blocks of --steps steps, freed). Per block the
slowest rank's time counts; step_ms is the median block's mean step time, spread the fastest and slowest block.
tokens_per_s_per_gpu = one rank's tokens per step / step time; scaling_eff = that at N GPUs / at 1 GPU (same model
and mode); loss: after the same number of optimizer steps in every mode, averaged over the ranks; peak_gib: the
largest rank's torch.cuda.max_memory_allocated; first_run_s: build to the end of --first-steps steps, compilation and
automp's trial included (each mode on empty compile caches of its own, automp's verdicts cold). With --profile, one
more step per mode under torch.profiler adds comm_ms (the time any NCCL kernel runs), comm_exposed_ms (the part of it
no other kernel hides) and comm_overlap (1 - exposed / comm): FSDP2's next-layer all-gathers should run under the
current layer's compute (automp.bench.kernel_profile.comm_overlap); the longest times and the lowest overlap over the
ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

from typing import Any

import torch

from automp.bench.dist_worker import COLLECTIVE_TIMEOUT_S, DEFAULT_MODES, MODELS, MODES, ROW_KEYS
from automp.bench.harness import (device_name, fmt, gpu_slug, header, missing, provenance, ratio_bars, row_notes,
                                  usage_problem)
from automp.files import write_json_and_markdown

ANCHOR = "bf16-compile"
MODE_LIBS = {"torchao-float8": "torchao"}
LAUNCH_SLACK_S = 180  # per mode, on top of --mode-timeout: process start, rendezvous, building, freeing


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """ratio_vs_bf16 (the anchor's step_ms / the row's, same model and world size) and scaling_eff (the row's
    tokens/s/GPU / the same model and mode's at 1 GPU); None where either side is missing."""
    anchor = {(r["model"], r["gpus"]): r["step_ms"] for r in rows if r["mode"] == ANCHOR and r.get("step_ms")}
    single = {(r["model"], r["mode"]): r["tokens_per_s_per_gpu"] for r in rows
              if r["gpus"] == 1 and r.get("tokens_per_s_per_gpu")}
    for r in rows:
        a, one = anchor.get((r["model"], r["gpus"])), single.get((r["model"], r["mode"]))
        r["ratio_vs_bf16"] = round(a / r["step_ms"], 3) if a and r.get("step_ms") else None
        r["scaling_eff"] = round(r["tokens_per_s_per_gpu"] / one, 3) if one and r.get("tokens_per_s_per_gpu") \
            else None


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = header("dist", rows, [
        f"ratio: {ANCHOR} ms / mode ms at the same GPU count (> 1: faster than the compiled bf16 loop)",
        "step ms: median of the blocks' mean step time, the slowest rank's per block; spread: the fastest and slowest "
        "block",
        "scaling eff: tokens/s/GPU at N GPUs / at 1 GPU; loss: after the same number of optimizer steps in every mode, "
        "averaged over the ranks; first run s: build + first steps, compilation and automp's trial included"])
    profiled = any("comm_overlap" in r for r in rows)
    for model in dict.fromkeys(r["model"] for r in rows):
        lines += ["", f"## {model}", "",
                  "| gpus | mode | step ms | spread | tokens/s/GPU | scaling eff | ratio vs bf16-compile | peak GiB | "
                  "loss | first run s |" + (" collectives ms | exposed ms | overlap |" if profiled else "") + " notes |",
                  "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if profiled else "") + "---|"]
        for r in (r for r in rows if r["model"] == model):
            spread = f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}" if r.get("spread") else ""
            comm = (f" {fmt(r.get('comm_ms'), '.2f')} | {fmt(r.get('comm_exposed_ms'), '.2f')} | "
                    f"{fmt(r.get('comm_overlap'), '.2f')} |") if profiled else ""
            lines.append(f"| {r['gpus']} | {r['mode']} | {fmt(r['step_ms'], '.2f')} | {spread} | "
                         f"{fmt(r['tokens_per_s_per_gpu'], ',.0f')} | {fmt(r['scaling_eff'], '.2f')} | "
                         f"{fmt(r['ratio_vs_bf16'], '.2f')} | {fmt(r['peak_gib'], '.2f')} | "
                         f"{fmt(r['loss'], '.4f')} | {fmt(r['first_run_s'], '.1f')} |{comm} {row_notes(r)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Grouped bars of ratio_vs_bf16, one group per model and GPU count, one bar per mode (harness.ratio_bars)."""
    if rows:
        ratio_bars([dict(r, model=f"{r['model']} x{r['gpus']}") for r in rows], "ratio_vs_bf16", MODES, ANCHOR,
                   "automp bench dist", path)


def _order(row: dict[str, Any]) -> tuple[int, int, int]:
    return MODELS.index(row["model"]), row["gpus"], MODES.index(row["mode"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="automp bench dist", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="1,2", help="comma-separated world sizes, one torchrun launch each")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--layers-d2048", type=int, default=16, help="llama-d2048-ddp's decoder layers")
    p.add_argument("--layers-d4096", type=int, default=4, help="llama-d4096-fsdp2's decoder layers")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--blocks", type=int, default=4, help="timed blocks per mode")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per mode (automp: more until settled)")
    p.add_argument("--max-warmup", type=int, default=300, help="cap on automp's warm-up while it has not settled")
    p.add_argument("--first-steps", type=int, default=20, help="first_run_s is the time to the end of this step")
    p.add_argument("--mode-timeout", type=float, default=240, help="seconds one mode may take; 0: no limit")
    p.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT_S,
                   help="seconds a rank waits in a collective (all-reduce, barrier) for the others before "
                        "torch.distributed fails it (default: %(default)g)")
    p.add_argument("--quick", action="store_true", help="tiny dims of every model (a CPU smoke run)")
    p.add_argument("--profile", action="store_true",
                   help="one more step per mode under torch.profiler: how much of the collectives' time compute hides")
    p.add_argument("--out", default=None, help="writes OUT.json, .md, .png (default: benchmarks/dist-<gpu>)")
    return p


def _world_sizes(text: str) -> list[int] | None:
    try:
        sizes = [int(s) for s in text.split(",")]
    except ValueError:
        return None
    return list(dict.fromkeys(sizes)) if all(s >= 1 for s in sizes) else None


def _usage_error(args: argparse.Namespace) -> str | None:
    sizes = _world_sizes(args.gpus)
    if sizes is None:
        return f"--gpus: expected comma-separated world sizes of at least 1, got {args.gpus!r}"
    visible = torch.cuda.device_count() if torch.cuda.is_available() else None
    if visible is not None and max(sizes) > visible:
        return f"--gpus {max(sizes)}: only {visible} CUDA device(s) visible"
    return usage_problem([("--models", args.models, MODELS), ("--modes", args.modes, MODES)],
                         [("--steps", args.steps, 1), ("--blocks", args.blocks, 1), ("--warmup", args.warmup, 0),
                          ("--layers-d2048", args.layers_d2048, 1), ("--layers-d4096", args.layers_d4096, 1),
                          ("--first-steps", args.first_steps, 1), ("--max-warmup", args.max_warmup, 0),
                          ("--mode-timeout", args.mode_timeout, 0),
                          ("--collective-timeout", args.collective_timeout, 1)], args.out)


class Stopped(Exception):
    """The suite itself was stopped (SIGTERM from `timeout` or a scheduler, Ctrl-C) while a launch ran."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped()


def launch(world: int, models: list[str], modes: list[str], args: argparse.Namespace
           ) -> tuple[list[dict[str, Any]], bool]:
    """One torchrun launch of the worker at `world` ranks; its rows (rank 0's file), and a skipped row for every
    model x mode it did not finish (it died, ran past the launch's time limit, or the suite was stopped: then the
    second value is True, and the rows finished so far are still returned to be written)."""
    flags = ["--layers-d2048", args.layers_d2048, "--layers-d4096", args.layers_d4096, "--steps", args.steps,
             "--blocks", args.blocks, "--warmup", args.warmup, "--max-warmup", args.max_warmup,
             "--first-steps", args.first_steps, "--mode-timeout", args.mode_timeout,
             "--collective-timeout", args.collective_timeout]
    limit = len(models) * len(modes) * (args.mode_timeout + LAUNCH_SLACK_S) if args.mode_timeout > 0 else None
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(prefix="automp-bench-dist-") as tmp:
        result = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
               "-m", "automp.bench.dist_worker", "--models", ",".join(models), "--modes", ",".join(modes),
               "--result", result, *map(str, flags), *(["--quick"] if args.quick else []),
               *(["--profile"] if args.profile else [])]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)  # its own group: a hung launch ends whole
        try:
            code: int | str = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"ran past {limit:g} s ((--mode-timeout + {LAUNCH_SLACK_S}) per mode)"
        except (Stopped, KeyboardInterrupt):  # the ranks go with the parent, and the rows they finished stay
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "was stopped with the suite"
        rows = []
        if os.path.exists(result):
            with open(result, encoding="utf-8") as f:
                rows = json.load(f)
    done = {(r["model"], r["mode"]) for r in rows}
    why = f"the worker exited with code {code} before this mode finished" if isinstance(code, int) else \
        f"the worker {code} and was ended before this mode finished"
    stopped = code == "was stopped with the suite"
    return rows + [_skipped(m, mode, world, why) for m in models for mode in modes if (m, mode) not in done], stopped


def _skipped(model: str, mode: str, world: int, why: str) -> dict[str, Any]:
    return {**{k: None for k in ROW_KEYS}, "model": model, "mode": mode, "gpus": world, "skipped": why}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = device_name("cuda" if torch.cuda.is_available() else "cpu")
    args.out = args.out or os.path.join("benchmarks", f"dist-{gpu_slug(device)}" + ("-quick" if args.quick else ""))
    error = _usage_error(args)
    if error:
        print(f"automp bench dist: {error}", file=sys.stderr)
        return 2
    out_dir, stem = os.path.split(os.path.abspath(args.out))
    meta = {**provenance(), "device": device}
    models, rows = args.models.split(","), []
    print(f"automp bench dist: {device}, torch {torch.__version__}, world sizes {args.gpus}", flush=True)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return _run(args, models, rows, meta, out_dir, stem)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace, models: list[str], rows: list[dict[str, Any]], meta: dict[str, Any],
         out_dir: str, stem: str) -> int:
    for world in _world_sizes(args.gpus):
        modes, absent = [], []
        for m in args.modes.split(","):  # a missing library skips its rows, not the run
            lib = "transformers" if missing("transformers") else MODE_LIBS.get(m)
            (absent if lib and missing(lib) else modes).append((m, lib))
        found = [_skipped(model, m, world, f"pip install {lib}") for model in models for m, lib in absent]
        stopped = False
        if modes:
            done, stopped = launch(world, models, [m for m, _ in modes], args)
            found += done
        rows = sorted(rows + [dict(r, **meta) for r in found], key=_order)
        add_ratios(rows)  # rewritten after every world size: a run cut off keeps the rows it finished
        write_json_and_markdown(out_dir, stem, rows, markdown(rows))
        if stopped:
            print(f"automp bench dist: stopped; wrote the rows finished so far to {args.out}.json, .md",
                  file=sys.stderr)
            return 143
        plot(rows, args.out + ".png")
    print(markdown(rows))
    print(f"wrote {args.out}.json, .md, .png", flush=True)
    return 0
