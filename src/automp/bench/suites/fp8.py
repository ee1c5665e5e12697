"""`automp bench fp8`: FP8 training step time on one GPU against the strongest bf16 loop and torchao, in one process.

Modes (AdamW lr 1e-4 in every one, the same recipe, so the losses compare):
  bf16-reduce-overhead  the strongest bf16 loop written by hand: autocast bf16 + torch.compile(model,
                        mode="reduce-overhead") (CUDA graphs) + fused AdamW. The anchor: ratio_vs_bf16 = its ms / ours
  torchao-tensorwise    torchao.float8.convert_to_float8_training with the "tensorwise" recipe (e4m3 activations and
  torchao-rowwise       weights, e5m2 gradients, one scale per tensor) or "rowwise" (e4m3, per-row scales), then the
                        same compiled loop. The module filter is the one torchao's README recommends: the LM head
                        `lm_head` and the classifier `head` stay in bf16 (the final projection is the layer most
                        sensitive to FP8 error), and a Linear whose dims are not multiples of 16 is not swapped (FP8
                        GEMMs need them). GPT-2's blocks use transformers' Conv1D, not nn.Linear: torchao swaps none.
  torchao-auto          torchao tensorwise with torchao's own filter (_auto_filter_for_recipe), LM head kept bf16
  bf16-liger            bf16-reduce-overhead with Liger-Kernel's fused linear cross-entropy on the model (Llama
                        only), run eagerly inside the compiled model (its kernels fail under torch.compile)
  automp-bf16           the plain FP32 loop (no autocast, no compile, AdamW as built) with automp.enable(dtype=...)
  automp-fp8            before it and automp.disable() after, as `automp run` does; warm-up runs until
                        automp.settled(). On a machine without FP8, enable raises and the row says so (skipped).
  automp-bf16-siblings  automp-bf16 with sibling linear layers joined into one GEMM (--fuse-siblings)
  automp-bf16-masked    automp-bf16 keeping the causal mask the model builds (--no-causal-attention): what the
                        causal-attention rewrite earns
  automp-fp8-auto       automp-fp8 with each layer's recipe chosen from the device table (--fp8-recipe auto)
  automp-fp8-siblings   automp-fp8 with sibling FP8 layers joined into one FP8 GEMM (--fuse-siblings)

Blocks: models under 300M parameters keep every mode resident and time them in alternating blocks (A B C, then C B A,
...), so a host that drifts during the run (10-40% over minutes on a shared GPU host) biases no mode. automp's session
is process-wide, so each automp mode has its own phase: its session opens, it warms up, and it alternates with the
resident hand-written modes (automp steps aside for a model called under the script's own autocast); the hand-written
modes' step time is the median over the blocks of every phase. A larger model with AdamW state (a 1.2B Llama: ~20 GB)
does not fit five times in one GPU: such models run their modes one after another (build, warm up, time the blocks,
free) and their rows say "blocks": "sequential".

first_run_s: wall time from building the loop (model, optimizer, conversion) to the end of its first --first-steps
steps: torch.compile's compilation and automp's trial of its paths included, the cost a user pays before the steady
state. loss: read after the same number of optimizer steps in every mode (warm-up plus timed steps, automp's longer
warm-up notwithstanding), so a lower loss is progress, not more steps. peak_gib, peak_reserved_gib: the mode's own
peak, allocated and reserved (CUDA graphs' pools whole), above what was there when it started (the other resident
modes), from its build to the end of its warm-up (compilation and automp's trial included). A peak of the timed
blocks alone would say nothing: CUDA graph replays allocate nothing. The steady state's peak, without automp's trial,
is its second run's (--second-run: second_peak_gib, second_peak_reserved_gib), which starts on the verdict.
--repeats N: N passes over every model and mode in one process, the modes' order reversed every other pass, each
row tagged with its `repeat` and its ratio taken to the same pass's anchor; the markdown adds each mode's median
and spread over the passes (`across_repeats`), which the plot then shows.
warmup_peaks_gib (CUDA): each warm-up step's own peak allocated above the same start, so the step that set
peak_gib, and with it the trial's candidate or aborted call, can be named; warmup_paths (automp modes): the path or
paths each warm-up step ran, joined by '+'.
Inductor's and AOTAutograd's caches are on, torch's default, each mode with a cache directory of its own, empty at
its first build, and Inductor's in-process caches emptied before it (fp8_run.Run.compiling): every mode compiles
cold, as on a machine that never compiled the model, and no mode is served another's graphs or kernels; automp's
verdicts start empty, so it runs its trial, and first_run_s compares like with like. --second-run measures what a
user's next run of the same script pays: after its timed blocks each mode is built again from nothing, on its own
warm caches, and runs its first --first-steps steps once more (second_run_s, second_peak_gib); automp's modes keep
their verdict cache, so their second run starts on the verdict and skips the trial, as `automp run` does.

--profile explains a ratio: after its timed blocks each mode runs one more step under torch.profiler, and its row
gets that step's kernel time by category (attention, matmul, optimizer, other; fp8_run.PROFILE) and its largest
kernels. The step's wall time less its kernel time is the device waiting for the host.

On a CPU the suite runs only with --quick (tiny dims, a smoke run): the full-size models take minutes per step there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from typing import Any, Callable

import torch

from automp.bench.fp8_run import PROFILE, ROUNDS, ROW_KEYS, Run, cold_cache
from automp.bench.fp8_workloads import MODE_LIBS, MODELS, automp_options
from automp.bench.harness import (block_order, cpu_refusal, device_name, provenance, fmt, free, gpu_slug, header, missing,
                                  over_runs, ratio_bars, row_notes, usage_problem)
from automp.files import write_json_and_markdown

__all__ = ["ANCHOR", "MODES", "ROUNDS", "ROW_KEYS", "Run", "main"]

MODES = ("bf16-reduce-overhead", "bf16-liger", "torchao-tensorwise", "torchao-rowwise", "torchao-auto", "automp-bf16",
         "automp-fp8", "automp-bf16-siblings", "automp-bf16-masked", "automp-fp8-auto", "automp-fp8-siblings")
ANCHOR = "bf16-reduce-overhead"
RESIDENT_MAX_PARAMS = 300_000_000  # below: every mode resident, alternating blocks; above: one mode at a time


def _enable(run: Run) -> bool:
    """automp.enable(dtype=...) for an automp mode, with the rest of the configuration from the environment as
    `automp run` reads it, but a verdict cache of its own (cold_cache); a machine that cannot run the dtype skips
    the row."""
    import automp
    try:
        run.cache = cold_cache()
        automp.enable(**automp_options(run.mode), cache_dir=run.cache.name)
    except (RuntimeError, ValueError) as e:
        run.skip(" ".join(str(e).split())[:300])
        _disable(run)
        return False
    return True


def _disable(run: Run, keep_cache: bool = False) -> None:
    """automp.disable() for an automp mode, its report noted; its verdict cache removed unless `keep_cache` (its
    second run starts from it)."""
    import automp
    if run.mode.startswith("automp") and automp.is_enabled():
        run.note_report(automp.disable())
    if run.cache is not None and not keep_cache:
        run.cache.cleanup()
        run.cache = None


def run_model(name: str, modes: list[str], opts: argparse.Namespace, emit: Callable[[dict], None]) -> None:
    """A model under RESIDENT_MAX_PARAMS: the hand-written modes resident, then one phase per automp mode, in which
    it alternates with them inside its session. A larger one: each mode its own phase, freed before the next."""
    resident = parameters(name, opts) < RESIDENT_MAX_PARAMS
    runs = {m: Run(name, m, opts, "alternating" if resident else "sequential") for m in modes}
    plain = [runs[m] for m in modes if resident and not m.startswith("automp")]
    for run in plain:
        run.build(opts.quick, opts.layers)
    timed, later = False, []
    for run in (r for r in runs.values() if r not in plain):
        if not run.mode.startswith("automp") or _enable(run):
            try:
                run.build(opts.quick, opts.layers)
                _alternate(plain + [run], opts.steps)
                timed = True
            finally:
                _disable(run, keep_cache=opts.second_run)
        if resident:  # its second run resets Dynamo: after the resident modes' last blocks
            later.append(run)
            continue
        if opts.second_run:
            run.second(opts.quick, opts.layers)
        emit(run.finish())
        free(dynamo=True)
    if plain and not timed:  # no automp phase ran: the hand-written modes alternate on their own
        _alternate(plain, opts.steps)
    for run in plain + later:
        if opts.second_run:
            run.second(opts.quick, opts.layers)
        emit(run.finish())


def _alternate(runs: list[Run], steps: int) -> None:
    for run in runs:  # the first call under a session: automp notes the script's own autocast and steps aside
        run.block(1, timed=False)
    for order in block_order(runs, ROUNDS):
        for run in order:
            run.block(steps)
    for run in runs:
        if run.opts.profile:  # each mode once, after its blocks
            run.profile()


def parameters(name: str, opts: argparse.Namespace) -> int:
    """The model's parameter count, from a copy on the meta device (no memory, no init)."""
    try:
        with torch.device("meta"):
            model = MODELS[name][0](opts.quick, "meta", opts.layers).model
    except Exception:  # noqa: BLE001 - a builder that cannot build on meta: one mode at a time is always safe
        return sys.maxsize
    return sum(p.numel() for p in model.parameters())


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's ratio to the anchor's step time of the same model and repeat (one process pass, --repeats)."""
    anchors = {(r["model"], r.get("repeat", 0)): r["step_ms"] for r in rows if r["mode"] == ANCHOR and r.get("step_ms")}
    for r in rows:
        a = anchors.get((r["model"], r.get("repeat", 0)))
        r["ratio_vs_bf16"] = round(a / r["step_ms"], 3) if a and r.get("step_ms") else None


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = header("fp8", rows, [f"ratio: {ANCHOR} ms / mode ms (> 1: faster than the strongest bf16 loop)",
                                 "step ms: median of the blocks' mean step time; spread: the fastest and slowest block",
                                 "loss: after the same number of optimizer steps in every mode; first run s: build + "
                                 "first steps, compilation and automp's trial included"])
    repeated = any(r.get("repeat", 0) for r in rows)
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        lines += ["", f"## {model} ({mine[0].get('blocks')} blocks)", "",
                  "| mode | step ms | spread | ratio | peak GiB | reserved GiB | 2nd run peak GiB | loss | first run s "
                  "| second run s | notes |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in mine:
            spread = f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}" if r.get("spread") else ""
            name = f"{r['mode']} (repeat {r['repeat']})" if repeated else r["mode"]
            lines.append(f"| {name} | {fmt(r['step_ms'], '.2f')} | {spread} | "
                         f"{fmt(r['ratio_vs_bf16'], '.2f')} | {fmt(r['peak_gib'], '.2f')} | "
                         f"{fmt(r.get('peak_reserved_gib'), '.2f')} | {fmt(r.get('second_peak_gib'), '.2f')} | "
                         f"{fmt(r['loss'], '.4f')} | {fmt(r['first_run_s'], '.1f')} | "
                         f"{fmt(r.get('second_run_s'), '.1f')} | "
                         f"{row_notes(r)} |")
    summary = across_repeats(rows)
    if summary:
        lines += ["", "## across repeats (median; spread: the fastest and slowest repeat)", "",
                  "| model | mode | repeats | step ms | spread | ratio | ratio spread | first run s | peak GiB |",
                  "|---|---|---:|---:|---|---:|---|---:|---:|"]
        for r in summary:
            rs = f"{r['ratio_spread'][0]:.3f}-{r['ratio_spread'][1]:.3f}" if r["ratio_spread"] else ""
            lines.append(f"| {r['model']} | {r['mode']} | {r['repeats']} | {r['step_ms']:.2f} | "
                         f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f} | {fmt(r['ratio_vs_bf16'], '.3f')} | {rs} | "
                         f"{fmt(r['first_run_s'], '.1f')} | {fmt(r['peak_gib'], '.2f')} |")
    profiled = [r for r in rows if r.get("kernel_ms") is not None]
    if profiled:
        cats = [c for c, _ in PROFILE] + ["other"]
        lines += ["", "## kernel time of one step by category, ms (--profile)", "",
                  "| model | mode | step ms | kernels ms | " + " | ".join(cats) + " | largest kernel |",
                  "|---|---|---:|---:|" + "---:|" * len(cats) + "---|"]
        for r in profiled:
            top = (r.get("top") or [{}])[0]
            largest = f"{top.get('name', '')[:60]} ({fmt(top.get('ms'), '.2f')})".replace("|", "/") if top else ""
            by_cat = " | ".join(fmt(r.get(f"{c}_ms"), ".2f") for c in cats)
            lines.append(f"| {r['model']} | {r['mode']} | {fmt(r.get('step_ms'), '.2f')} | "
                         f"{fmt(r['kernel_ms'], '.2f')} | {by_cat} | {largest} |")
    return "\n".join(lines) + "\n"


def across_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and mode timed in two or more repeats: harness.over_runs of its rows, and the median and spread of
    its ratio to the anchor."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("step_ms"):
            groups.setdefault((r["model"], r["mode"]), []).append(r)
    out = []
    for (model, mode), rs in groups.items():
        if len(rs) < 2:
            continue
        ratios = [r["ratio_vs_bf16"] for r in rs if r.get("ratio_vs_bf16")]
        out.append({"model": model, "mode": mode, "repeats": len(rs), **over_runs(rs),
                    "ratio_vs_bf16": round(statistics.median(ratios), 3) if ratios else None,
                    "ratio_spread": [min(ratios), max(ratios)] if ratios else None})
    return out


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Grouped bars of ratio_vs_bf16, one group per model, one bar per mode (harness.ratio_bars): with --repeats,
    the median over the repeats."""
    summary = across_repeats(rows)
    ratio_bars(summary or rows, "ratio_vs_bf16", MODES, ANCHOR, "automp bench fp8", path)


def _order(row: dict[str, Any]) -> tuple[int, int, int]:
    return (list(MODELS).index(row["model"]), row.get("repeat", 0),
            MODES.index(row["mode"]) if row["mode"] in MODES else len(MODES))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="automp bench fp8", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=10, help=f"steps per timed block ({ROUNDS} blocks per mode)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per mode (automp: more until settled)")
    p.add_argument("--max-warmup", type=int, default=300, help="cap on automp's warm-up while it has not settled")
    p.add_argument("--first-steps", type=int, default=20, help="first_run_s is the time to the end of this step")
    p.add_argument("--layers", type=int, default=4, help="llama-d4096's layers: as many as fit (4 on an 80 GB GPU)")
    p.add_argument("--quick", action="store_true", help="tiny dims of every model (a CPU smoke run)")
    p.add_argument("--out", default=None, help="writes OUT.json, .md, .png (default: benchmarks/fp8-<gpu>)")
    p.add_argument("--mode-timeout", type=float, default=300, help="seconds one mode may take; 0: no limit")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over every model and mode, the modes' order reversed every other pass; with 2 or "
                        "more, the markdown's median and spread over them")
    p.add_argument("--profile", action="store_true",
                   help="after its timed blocks, one more step of each mode under torch.profiler: kernel time by "
                        "category (attention, matmul, optimizer, other) in its row and a table of its own")
    p.add_argument("--second-run", action="store_true",
                   help="each mode's first steps run again after its blocks, from a new model, on its own warm "
                        "caches and (automp) its verdicts: second_run_s")
    return p


def _usage_error(args: argparse.Namespace) -> str | None:
    return usage_problem([("--models", args.models, tuple(MODELS)), ("--modes", args.modes, MODES)],
                         [("--steps", args.steps, 1), ("--warmup", args.warmup, 0), ("--layers", args.layers, 1),
                          ("--first-steps", args.first_steps, 1), ("--max-warmup", args.max_warmup, 0),
                          ("--mode-timeout", args.mode_timeout, 0), ("--repeats", args.repeats, 1)], args.out)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = device_name(args.device)
    args.out = args.out or os.path.join("benchmarks", f"fp8-{gpu_slug(device)}" + ("-quick" if args.quick else ""))
    error = cpu_refusal("fp8", args.device, args.quick)  # before the usage check makes --out's folder
    if error:
        print(error, file=sys.stderr)
        return 2
    error = _usage_error(args)
    if error:
        print(f"automp bench fp8: {error}", file=sys.stderr)
        return 2
    out_dir, stem = os.path.split(os.path.abspath(args.out))
    meta = {**provenance(), "device": device}
    rows: list[dict[str, Any]] = []

    repeat = 0

    def emit(row: dict[str, Any]) -> None:
        """Print the row and rewrite the results: a run cut off later keeps every row it finished."""
        rows.append(dict(row, **meta, **({"repeat": repeat} if args.repeats > 1 else {})))
        rows.sort(key=_order)
        add_ratios(rows)
        shown = f"skipped: {row['skipped']}" if "skipped" in row else (
            f"{row['step_ms']} ms/step (blocks {row['spread']}), loss {row['loss']}, peak {row['peak_gib']} GiB, "
            f"first run {row['first_run_s']} s")
        print(f"[{row['model']}] {row['mode']}: {shown}", flush=True)
        write_json_and_markdown(out_dir, stem, rows, markdown(rows))

    print(f"automp bench fp8: {device}, torch {torch.__version__}", flush=True)
    # Every mode compiles the same model class's forward (automp's trial two paths of its own): the default limit of
    # 8 compiled versions per frame would let a later mode run eager unnoticed
    with torch._dynamo.config.patch(recompile_limit=64):
        for repeat, name in ((r, n) for r in range(args.repeats) for n in args.models.split(",")):
            modes = []
            for m in args.modes.split(","):  # a missing library skips its rows, not the run
                lib = MODELS[name][1] if missing(MODELS[name][1]) else MODE_LIBS.get(m)
                if lib and missing(lib):
                    emit({**{k: None for k in ROW_KEYS}, "model": name, "mode": m, "skipped": f"pip install {lib}"})
                else:
                    modes.append(m)
            if modes:
                run_model(name, modes if repeat % 2 == 0 else modes[::-1], args, emit)
                free(dynamo=True)
            plot(rows, args.out + ".png")
    print(markdown(rows))
    print(f"wrote {args.out}.json, .md, .png", flush=True)
    return 0
