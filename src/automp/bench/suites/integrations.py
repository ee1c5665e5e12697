"""`automp bench integrations`: automp as one argument of a framework against `automp run` of the same script.

A user of transformers' Trainer adds `AutoMPCallback()`, a Lightning user the `AutoMP()` plugin; either should train
as fast as the same script does under `automp run` (modes trainer-run, lightning-run: the script without the
callback or the plugin), and make the same choice; the plain loop under `automp run` is the reference of all three
(the frameworks' own work per step is in their figures, not in the loop's). An integration starts automp once the
framework has built the model and optimizer, `automp run` before the script starts: mode loop-late is the plain loop
calling enable() at that point, which tells what the order costs apart from what a framework costs. Each mode is
GPT-2 (124M, B8 T1024; --quick: tiny) written one way (automp.bench.integrations_worker), each run in a process of
its own so that every run is a first run: automp's verdict cache and Inductor's cache start empty in each
(--warm-inductor: one Inductor cache for the run). A framework's process cannot hold another's session, so the modes
cannot alternate in one process: they take turns across processes instead, in alternating order (loop trainer
lightning, then lightning trainer loop, ...), so a host that drifts over the run biases none, and each mode's figure
is the median over --repeats processes with their spread.

Rows, one per process: {"mode", "repeat", "steps", "step_ms" (the steps of the last third, between two device
synchronizations), "first_run_s" (from the worker's start, torch imported, to the end of step --first: the model's
build, the framework's set-up, compilation and automp's trial),
"loss", "peak_gib" (allocated, CUDA), "paths" (automp's choice per module), "report" (that process's automp report,
kept in OUT-reports/), "device", "torch", "date", "commit"}, or
with "error" where the process failed. The markdown's summary gives each mode's median, spread, ratio against the
loop's median and, for an integration, against its script's under `automp run` (> 1: faster)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from automp.bench import integrations_worker as worker
from automp.bench.harness import block_order, device_name, fmt, gpu_slug, over_runs, provenance, usage_problem
from automp.files import atomic_output, write_json_and_markdown

ANCHOR = "loop"
# an integration -> its script under `automp run`; loop-late (enable() after the build) -> the loop
TWIN = {"trainer": "trainer-run", "lightning": "lightning-run", "loop-late": "loop"}


def order(modes: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, mode) in the order the processes run: the modes in turn, every other repeat reversed."""
    return [(r, m) for r, ms in enumerate(block_order(modes, repeats)) for m in ms]


def command(mode: str, opts: argparse.Namespace, workdir: str, out: str) -> list[str]:
    """The process of one mode: the worker itself, under `automp run` for the plain loop."""
    args = [worker.__file__, "--mode", mode, "--steps", str(opts.steps), "--first", str(opts.first),
            "--workdir", workdir, "--out", out, *(["--quick"] if opts.quick else [])]
    if mode in worker.UNDER_RUN:
        return [sys.executable, "-m", "automp", "run", "--quiet", "--report", os.path.join(workdir, "report.json"),
                *args]
    return [sys.executable, *args]


def run_one(mode: str, repeat: int, opts: argparse.Namespace) -> dict[str, Any]:
    """One process of `mode`, cold: its own automp verdict cache and Inductor cache (a first run each time); with
    --warm-inductor the Inductor cache is the run's one (opts.inductor_dir), automp's verdicts still start empty."""
    row: dict[str, Any] = {"mode": mode, "repeat": repeat}
    with tempfile.TemporaryDirectory() as tmp:
        out, workdir = os.path.join(tmp, "row.json"), os.path.join(tmp, "work")
        os.makedirs(workdir)
        env = {**os.environ, "AUTOMP_CACHE_DIR": os.path.join(tmp, "automp"),
               "TORCHINDUCTOR_CACHE_DIR": opts.inductor_dir or os.path.join(tmp, "inductor")}
        try:
            done = subprocess.run(command(mode, opts, workdir, out), env=env, capture_output=True, text=True,
                                  timeout=opts.mode_timeout or None)
        except subprocess.TimeoutExpired:
            return {**row, "error": f"over --mode-timeout {opts.mode_timeout} s"}
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            return {**row, "error": f"exit status {done.returncode}: {tail[:300]}"}
        with open(out, encoding="utf-8") as f:
            row.update(json.load(f))
        report = next((p for p in (os.path.join(workdir, n) for n in ("report.json", worker.REPORT))
                       if os.path.exists(p)), None)
        if report is not None:
            if "paths" not in row:
                with open(report, encoding="utf-8") as f:
                    row["paths"] = {c["module"]: c["path"] for c in json.load(f).get("choices", [])}
            row["report"] = keep_report(report, opts.out, f"{mode}-{repeat}.json")
    return row


def keep_report(path: str, out: str, name: str) -> str:
    """A process's automp report copied beside the results (OUT-reports/NAME), so that two modes that differ in
    speed can be told apart by what automp did in each; the copy's path relative to OUT's folder."""
    folder = f"{out}-reports"
    os.makedirs(folder, exist_ok=True)
    with atomic_output(os.path.join(folder, name)) as tmp:
        shutil.copyfile(path, tmp)
    return os.path.relpath(os.path.join(folder, name), os.path.dirname(os.path.abspath(out)))


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per mode: harness.over_runs of its processes' rows, its median's ratio to the loop's and, for an integration,
    to its script's under `automp run` (TWIN)."""
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("step_ms"):
            by_mode.setdefault(r["mode"], []).append(r)
    med = {m: statistics.median(r["step_ms"] for r in rs) for m, rs in by_mode.items()}
    out = []
    for mode, rs in by_mode.items():
        out.append({"mode": mode, "runs": len(rs), **over_runs(rs),
                    "vs_loop": round(med[ANCHOR] / med[mode], 3) if ANCHOR in med else None,
                    "vs_run": round(med[TWIN[mode]] / med[mode], 3) if TWIN.get(mode) in med else None,
                    "paths": rs[-1].get("paths")})
    return out


def markdown(rows: list[dict[str, Any]], device: str, opts: argparse.Namespace) -> str:
    lines = [f"# automp bench integrations · {device}", "",
             f"GPT-2{' (tiny, --quick)' if opts.quick else ' 124M, B8 T1024'}, {opts.steps} steps per process, "
             f"each mode in {opts.repeats} processes in alternating order; step ms: the last third's mean; "
             f"vs loop: `automp run` of the loop, median / the mode's; vs run: the same script under `automp run`, "
             f"median / the mode's (> 1: faster)", "",
             "| mode | processes | step ms, median (spread) | vs loop | vs run | first run s, median | peak GiB | "
             "automp chose |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for s in summary(rows):
        lines.append(f"| {s['mode']} | {s['runs']} | {s['step_ms']:.2f} ({s['spread'][0]:.2f}-{s['spread'][1]:.2f}) | "
                     f"{fmt(s['vs_loop'], '.3f')} | {fmt(s['vs_run'], '.3f')} | {fmt(s['first_run_s'], '.1f')} | "
                     f"{fmt(s['peak_gib'], '.2f')} | "
                     f"{', '.join(f'{k}: {v}' for k, v in (s['paths'] or {}).items())} |")
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["", *(f"- {r['mode']} (repeat {r['repeat']}): {r['error']}" for r in failed)]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="automp bench integrations", description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(worker.MODES), help=f"comma-separated, from {', '.join(worker.MODES)}")
    p.add_argument("--repeats", type=int, default=3, help="processes per mode")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--first", type=int, default=20, help="first_run_s is the time to the end of this step")
    p.add_argument("--mode-timeout", type=int, default=600, help="seconds one process may take; 0: no limit")
    p.add_argument("--quick", action="store_true", help="a tiny GPT-2 (a CPU smoke run)")
    p.add_argument("--warm-inductor", action="store_true",
                   help="the processes share one Inductor cache (the first ones fill it): more processes per minute "
                        "for step times; first_run_s is then not a cold start (automp's own trial still is)")
    p.add_argument("--out", default=None, help="writes OUT.json and .md (default: benchmarks/integrations-<gpu>)")
    return p


def main(argv: list[str] | None = None) -> int:
    import torch
    opts = _parser().parse_args(argv)
    device = device_name("cuda" if torch.cuda.is_available() else "cpu")
    opts.out = opts.out or os.path.join("benchmarks", f"integrations-{gpu_slug(device)}"
                                        + ("-quick" if opts.quick else ""))
    error = usage_problem([("--modes", opts.modes, worker.MODES)],
                          [("--repeats", opts.repeats, 1), ("--steps", opts.steps, 3), ("--first", opts.first, 1),
                           ("--mode-timeout", opts.mode_timeout, 0)], opts.out, exts=(".json", ".md"))
    if error:
        print(f"automp bench integrations: {error}", file=sys.stderr)
        return 2
    meta = {**provenance(), "device": device, "inductor_cache": "shared" if opts.warm_inductor else "cold"}
    rows: list[dict[str, Any]] = []
    out_dir, stem = os.path.split(os.path.abspath(opts.out))
    with tempfile.TemporaryDirectory() as shared:
        opts.inductor_dir = shared if opts.warm_inductor else None
        for repeat, mode in order(opts.modes.split(","), opts.repeats):
            rows.append({**run_one(mode, repeat, opts), **meta})
            r = rows[-1]
            print(f"[{mode} {repeat}] " + (r["error"] if r.get("error") else
                                           f"{r['step_ms']} ms/step, first run {r['first_run_s']} s, "
                                           f"paths {r.get('paths')}"), flush=True)
            # written after every process: a run cut off by a time limit keeps the processes that finished
            write_json_and_markdown(out_dir, stem, rows, markdown(rows, device, opts))
    print(markdown(rows, device, opts) + f"wrote {opts.out}.json, .md", flush=True)
    return 0
