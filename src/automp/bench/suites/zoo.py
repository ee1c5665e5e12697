"""`automp bench zoo`: training step time of third-party models and hand-written scripts, automp vs the loops a user
writes by hand (the modes: automp.bench.zoo_modes).

Each model trains in every mode in one process, from the same seed on the same fixed batch. TF32 stays off in every
mode, so the FP32 parts of mixed-precision modes are as in the fp32 baseline. automp measures candidate execution
paths in its first steps, so its warmup runs until `automp.settled()` (up to --max-warmup steps); every mode's warmup
(compilation included) is reported as compile_s, the first-run cost. Inductor's and AOTAutograd's caches are on,
torch's default, each mode run on an empty cache directory of its own with Inductor's in-process caches emptied
(harness.cold_compiles): every mode compiles cold and none is served another's graphs, so compile_s compares like
with like. A mode that runs past --mode-timeout ends with an error row.

Results go to <out>/zoo-<gpu>.json (rows merged by model, so runs of model subsets build one file), .md and .png.
On a CPU the suite runs only with --quick (tiny configs, a smoke run): the full-size models take minutes per step there.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch

from automp.bench.suites import zoo_interleave
from automp.bench.zoo_modes import (ANCHOR, EXTRA_MODELS, EXTRA_MODES, MODELS, MODES, STRONGEST, ModeLoop,
                                     missing_libraries, time_limit)
from automp.bench.harness import (block_order, cold_compiles, cpu_refusal, fmt, free, gpu_slug, one_line, provenance,
                                  ratio_bars)
from automp.files import write_json_and_markdown
from automp.timing import time_fn

COMPILE_TIMEOUT_FACTOR = 2  # automp modes get this many times --mode-timeout: two compiles before the trial settles
SKIP_HINT = "skipped: pip install automp[zoo]"
__all__ = ["ANCHOR", "EXTRA_MODELS", "EXTRA_MODES", "MODELS", "MODES", "STRONGEST", "ModeLoop", "missing_libraries", "time_limit"]


def run_mode(name: str, mode: str, quick: bool, device: str, steps: int, warmup: int, max_warmup: int,
             timeout: float = 0) -> dict[str, Any]:
    """One row: fresh model (seed 0), warmup (automp: until settled), then `steps` timed steps."""
    import automp
    row: dict[str, Any] = {"model": name, "mode": mode, "step_ms": None, "peak_gib": None, "loss": None}
    torch.manual_seed(0)
    use_automp = mode.startswith("automp")
    if use_automp:
        automp.enable(dtype=mode.split("-")[1])  # the rest from the environment, as `automp run` reads it
    report = None
    try:
        with time_limit(timeout) as expired:
            _measure(row, name, mode, quick, device, steps, warmup, max_warmup, expired)
    except Exception as e:  # noqa: BLE001 - a failing mode (OOM, compile error) must not lose the others' rows
        # Dynamo may wrap the timeout in its own error: say what happened
        row["error"] = str(expired[0]) if expired else one_line(e)
    finally:
        if use_automp:
            report = automp.disable()
    if report:
        _note_report(row, report)
    return row


def _measure(row: dict[str, Any], name: str, mode: str, quick: bool, device: str, steps: int, warmup: int,
             max_warmup: int, expired: list[TimeoutError]) -> None:
    """Fills row in place, so a failure late in the mode keeps what was measured before it."""
    import automp
    use_automp = mode.startswith("automp")
    loop = ModeLoop(MODELS[name][0](quick, device), mode, device)
    losses: list[torch.Tensor] = []

    def step() -> torch.Tensor:
        losses.append(loop.step())
        if expired:
            raise expired[0]
        return losses[-1]

    settled = getattr(automp, "settled", lambda: True)
    if device == "cuda":  # the first run's peak counts from this mode's start: compile, warm-up and automp's trial
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    while len(losses) < warmup or (use_automp and not settled() and len(losses) < max_warmup):
        step()
    if device == "cuda":  # the cached blocks warm-up (and automp's trial) left go back: reserved counts what stays
        torch.cuda.synchronize()
        row.update(first_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                   first_peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row.update(compile_s=round(time.perf_counter() - t0, 2), warmup_steps=len(losses))
    if use_automp:
        row["settled"] = bool(settled())
    ms = time_fn(step, warmup=0, iters=steps, device=device)
    # the loss of the same step in every mode (fp32's last): automp's longer warmup must not look like progress
    loss = float(losses[warmup + steps - 1])
    row.update(step_ms=round(ms, 3), loss=loss if math.isfinite(loss) else None)
    if not math.isfinite(loss):
        row["note"] = f"loss {loss}"
    if device == "cuda":
        # CUDA graphs replay into a private pool the allocated count misses once they are recorded (a graphed
        # model's allocated peak can read a fraction of what its process holds): reserved counts it
        row.update(peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3),
                   peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 3))


def _note_report(row: dict[str, Any], report: dict[str, Any]) -> None:
    """What automp chose for each root module (its path) and where it fell back to FP32: the why of a number."""
    if report.get("choices"):
        row["automp_paths"] = {c["module"]: c["path"] for c in report["choices"]}
        for c in report["choices"]:
            print(f"    automp: {c['module']} runs {c['path']}: {c['reason'][:300]}", flush=True)
    for e in report.get("settings", []):
        row.setdefault("automp_settings", {})[e["setting"]] = e["value"]
        print(f"    automp: {e['setting']} = {e['value']}: {e['reason'][:300]}", flush=True)
    if report.get("fallbacks"):
        row["automp_fallbacks"] = len(report["fallbacks"])
        for fb in report["fallbacks"][:3]:
            print(f"    automp FP32 fallback: {fb['where']}: {fb['reason'][:160]}", flush=True)


def run_model(name: str, modes: list[str], quick: bool, device: str, steps: int, warmup: int, max_warmup: int,
              timeout: float = 0, passes: int = 1, interleave: bool = False) -> list[dict[str, Any]]:
    """One row per mode. With passes > 1 the modes run again in reversed order (A B C, C B A, ...) and each row keeps
    the median step time of its passes: a host whose speed drifts during the run (10-40% between modes on a shared GPU
    host) then biases no mode more than another. interleave: automp-bf16's row also gets its ratio to
    the anchor timed in alternating blocks in one process (zoo_interleave)."""
    missing = missing_libraries(name)
    if missing:
        return add_ratios([{"model": name, "mode": mode, "step_ms": None, "peak_gib": None, "loss": None,
                            "error": f"{SKIP_HINT} ({', '.join(missing)} not installed)"} for mode in modes])
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for order in block_order(modes, passes):
        for mode in order:
            print(f"[{name}] {mode} ...", flush=True)
            # automp's warm-up compiles up to two paths (its pass and stock Inductor) before its trial settles
            limit = timeout * COMPILE_TIMEOUT_FACTOR if mode.startswith("automp") else timeout
            with cold_compiles():
                row = run_mode(name, mode, quick, device, steps, warmup, max_warmup, limit)
            free(dynamo=True)  # this mode's model, optimizer state and compiled graphs, before the next one
            runs[mode].append(row)
            shown = row.get("error") or (f"{row['step_ms']:.2f} ms/step, loss {row['loss']}, peak {row['peak_gib']} "
                                         f"GiB, warmup {row['compile_s']} s")
            print(f"[{name}] {mode}: {shown}", flush=True)
    rows = add_ratios([_median_pass(r) for r in runs.values()])
    if interleave and "automp-bf16" in modes:
        with cold_compiles():
            zoo_interleave.add_to_row(next(r for r in rows if r["mode"] == "automp-bf16"), name, quick, device,
                                      steps, warmup, max_warmup, timeout * (1 + COMPILE_TIMEOUT_FACTOR),
                                      strongest=STRONGEST in modes)
    return rows


def _median_pass(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first pass's row (its loss, warm-up and notes: later passes of automp start from a cached verdict), with
    the median step time and the largest peak of the passes that finished; an error in any pass is kept."""
    row = dict(rows[0])
    done = [r for r in rows if r.get("step_ms") is not None]
    if len(rows) > 1:
        row["step_ms_passes"] = [r.get("step_ms") for r in rows]
        if done:
            row["step_ms"] = statistics.median(r["step_ms"] for r in done)
            for key in ("peak_gib", "peak_reserved_gib", "first_peak_gib", "first_peak_reserved_gib"):
                peaks = [r[key] for r in done if r.get(key) is not None]
                row[key] = max(peaks) if peaks else None
        errors = [r["error"] for r in rows if r.get("error")]
        if errors and not row.get("error"):
            row["error"] = errors[0]
    return row


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ratio_vs_anchor = anchor ms / mode ms (> 1: faster than the anchor); loss_vs_fp32 = loss - FP32's. The anchor
    is the strongest hand-written loop the run measured: autocast-bf16-graphs where it ran, else autocast+compile."""
    by_mode = {r["mode"]: r for r in rows}
    anchor = STRONGEST if by_mode.get(STRONGEST, {}).get("step_ms") else ANCHOR
    anchor_ms = by_mode.get(anchor, {}).get("step_ms")
    fp32_loss = by_mode.get("fp32-eager", {}).get("loss")
    for r in rows:
        if anchor_ms and r["step_ms"]:
            r["ratio_vs_anchor"], r["anchor"] = round(anchor_ms / r["step_ms"], 3), anchor
        if fp32_loss is not None and r["loss"] is not None:
            r["loss_vs_fp32"] = r["loss"] - fp32_loss
    return rows


def _order(row: dict[str, Any]) -> tuple[int, str, int]:
    names, modes = list(MODELS), list(MODES + EXTRA_MODES)
    return (names.index(row["model"]) if row["model"] in names else len(names), row["model"],
            modes.index(row["mode"]) if row["mode"] in modes else len(modes))


def merge_rows(path: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The file's rows with those of the models in `rows` replaced: two runs on model subsets make one file."""
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    ran = {r["model"] for r in rows}
    return sorted([r for r in old if r["model"] not in ran] + rows, key=_order)


def _peak(row: dict[str, Any]) -> str:
    reserved = row.get("peak_reserved_gib")
    return fmt(row["peak_gib"], ".2f") + ("" if reserved is None else f" / {reserved:.2f}")


def markdown(rows: list[dict[str, Any]]) -> str:
    devices = sorted({f"{r.get('device')} · torch {r.get('torch')} · {r.get('date')}" for r in rows})
    lines = ["# automp bench zoo", "", *[f"- {d}" for d in devices],
             f"- anchor: {STRONGEST} where the run has it, else {ANCHOR}; vs anchor = anchor ms / mode ms (> 1: "
             f"faster than the anchor)",
             "- TF32 off in every mode (torch.backends.cuda.matmul.allow_tf32 = cudnn.allow_tf32 = False)",
             "- loss: of step warmup+steps in every mode (same seed and batch); Δ loss: minus fp32-eager's",
             "- warmup s: the warmup steps' wall time, compilation included",
             "- peak GiB: allocated / reserved in steady state (reserved counts CUDA graphs' private memory pool)",
             "", "| model | mode | step ms | vs anchor | peak GiB | loss | Δ loss vs fp32 | warmup s | notes |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        notes = [r.get("error") or r.get("note") or ""]
        if r.get("automp_paths"):
            notes.append("paths: " + ", ".join(f"{k}={v}" for k, v in r["automp_paths"].items()))
        if r.get("automp_settings"):
            notes.append(", ".join(f"{k.split('.')[-1]}={v}" for k, v in r["automp_settings"].items()))
        if r.get("automp_fallbacks"):
            notes.append(f"{r['automp_fallbacks']} automp FP32 fallback(s)")
        if r.get("settled") is False:
            notes.append("automp not settled")
        if r.get("ratio_interleaved") is not None:
            spread = r.get("ratio_interleaved_spread")
            notes.append(f"interleaved with {r.get('anchor_interleaved', ANCHOR)}: {r['ratio_interleaved']:.2f}x "
                         + (f"(blocks {spread[0]:.2f}-{spread[1]:.2f}x) " if spread else "")
                         + f"({r['step_ms_interleaved']:.2f} vs {r['anchor_ms_interleaved']:.2f} ms)")
        if r.get("interleave_error"):
            notes.append(f"interleaved: {r['interleave_error']}")
        lines.append(f"| {r['model']} | {r['mode']} | {fmt(r['step_ms'], '.2f')} | "
                     f"{fmt(r.get('ratio_vs_anchor'), '.2f')} | {_peak(r)} | "
                     f"{fmt(r['loss'], '.4f')} | {fmt(r.get('loss_vs_fp32'), '+.4f')} | "
                     f"{fmt(r.get('compile_s'), '.1f')} | {'; '.join(n for n in notes if n)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Grouped bars of ratio_vs_anchor, one group per model, one bar per mode (harness.ratio_bars)."""
    ratio_bars(rows, "ratio_vs_anchor", MODES, ANCHOR, "automp bench zoo", path)


def write_outputs(rows: list[dict[str, Any]], out_dir: str, stem: str) -> tuple[list[dict[str, Any]], str]:
    """Merge `rows` into <stem>.json and rewrite <stem>.md and .png from the merged rows; returns them and the md."""
    base = os.path.join(out_dir, stem)
    merged = merge_rows(base + ".json", rows)
    md = markdown(merged)
    write_json_and_markdown(out_dir, stem, merged, md)
    plot(merged, base + ".png")
    return merged, md


def _names(arg: str, known: tuple[str, ...], what: str, p: argparse.ArgumentParser) -> list[str]:
    names = [n for n in arg.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="automp bench zoo", description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(m for m in MODELS if m not in EXTRA_MODELS),
                   help=f"comma-separated (default: all but {', '.join(EXTRA_MODELS)}; see --list)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated, from {', '.join(MODES + EXTRA_MODES)} (default: all but {STRONGEST})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="warmup steps per mode (automp: more until settled)")
    p.add_argument("--max-warmup", type=int, default=300,
                   help="cap on automp's warmup while it has not settled (the DCGAN settles after ~170 steps: two "
                        "modules, their re-measurement, then the convolution layout and cuDNN trials)")
    p.add_argument("--mode-timeout", type=float, default=150,
                   help="seconds one mode may take (build, compile, steps) before it ends with an error row; 0: none. "
                        "automp modes get twice this: they compile two paths before their trial settles")
    p.add_argument("--passes", type=int, default=1,
                   help="run the modes this many times, in alternating order, and report each mode's median step time")
    p.add_argument("--interleave", action="store_true",
                   help="also time automp-bf16 against its bar in alternating blocks in one process (a ratio the "
                        "host's drift between modes cannot bias; compiles both once more): the anchor for the large "
                        "models, autocast-bf16-eager for the small scripts and the detector")
    p.add_argument("--quick", action="store_true", help="tiny configs (CPU smoke run); writes zoo-<gpu>-quick.*")
    p.add_argument("--out", default="benchmarks")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--list", action="store_true", help="list the models and exit")
    args = p.parse_args(argv)
    if args.list:
        for name, (build, libs) in MODELS.items():
            print(f"{name:9s} {build.__doc__.splitlines()[0]}" + (f"  [{', '.join(libs)}]" if libs else ""))
        return 0
    models, modes = _names(args.models, tuple(MODELS), "model", p), _names(args.modes, MODES + EXTRA_MODES, "mode", p)
    if args.passes < 1:
        p.error(f"--passes must be at least 1, got {args.passes}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU visible")
    refusal = cpu_refusal("zoo", args.device, args.quick)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    meta = {**provenance(args.device), "steps": args.steps, "quick": args.quick, "passes": args.passes,
            "interleave": args.interleave}
    print(f"automp bench zoo: {meta['device']}, torch {meta['torch']}, TF32 off, {args.steps} timed steps",
          flush=True)
    stem = f"zoo-{gpu_slug(meta['device'])}" + ("-quick" if args.quick else "")
    md = ""
    try:
        for name in models:  # written after each model: a run cut off by a time limit keeps what it measured
            rows = run_model(name, modes, args.quick, args.device, args.steps, args.warmup, args.max_warmup,
                             args.mode_timeout, args.passes, args.interleave)
            _, md = write_outputs([dict(r, **meta) for r in rows], args.out, stem)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    print(md)
    print(f"wrote {os.path.join(args.out, stem)}.json, .md, .png", flush=True)
    return 0
