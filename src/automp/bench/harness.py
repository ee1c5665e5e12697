"""Timing and result writing shared by every benchmark suite.

Every suite measures its anchor (FP32, cuBLAS, copy bandwidth, ...) in the same process as the thing it compares,
so ratios are meaningful even when clocks or neighbours change between runs.
"""
from __future__ import annotations

import contextlib
import gc
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from automp.files import check_writable, write_json_and_markdown
from automp.precision.fp8.gather import FP8_GATHER
from automp.timing import time_fn


@dataclass
class Result:
    suite: str
    name: str
    ms: float
    anchor: str | None = None
    anchor_ms: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """anchor time / our time: > 1 means faster than the anchor."""
        if self.anchor_ms is None or self.ms <= 0:
            return None
        return self.anchor_ms / self.ms


@contextlib.contextmanager
def cold_compiles(directory: str | None = None) -> Iterator[None]:
    """One mode's compiles on caches of its own, as on a machine that never compiled the model: Inductor's cache
    directory set to `directory` (None: a temporary one, removed after) and Triton's to a folder in it (Inductor
    pins Triton's to the first directory it sees, for the rest of the process: a later mode would load an earlier
    one's kernel binaries), and Inductor's
    in-process caches (compiled modules, Triton kernels) emptied first. So no mode is served another's graphs or
    kernels (torch 2.11's key also ignores the autocast dtype: an fp16 mode could be served bf16 graphs). The caches
    stay on, torch's default, so what a mode compiles twice (automp's trial: the plain and the graphed path) is loaded
    the second time, as in a user's run."""
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="automp-bench-inductor-") as tmp, cold_compiles(tmp):
            yield
        return
    from torch._inductor import utils as inductor_utils
    names = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(zip(names, (directory, os.path.join(directory, "triton"))))
    try:
        getattr(inductor_utils, "clear_caches", lambda: None)()
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def block_ms(step: Callable[[], Any], steps: int, device: str) -> float:
    """Mean ms per call over `steps` back-to-back calls, the device synchronized at the block's ends only, as a
    training or serving loop runs them (a call-by-call synchronized timing adds a launch latency to every call)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps * 1e3


def block_order(modes: list[Any], rounds: int) -> list[list[Any]]:
    """The order of the timed blocks: A B C, C B A, A B C, ... (rounds of them): a host or clock that drifts over the
    run biases no mode."""
    return [list(modes) if r % 2 == 0 else list(modes)[::-1] for r in range(rounds)]


def commit(root: str | os.PathLike | None = None) -> str:
    """The commit the running code was checked out at, read from the checkout's .git (no git binary needed, so a
    copy of the tree with its .git on a GPU host says it too); "unknown" outside a checkout. Uncommitted changes are
    not detected: commit before measuring."""
    top = Path(root) if root is not None else Path(__file__).resolve().parents[3]
    git = top / ".git"
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:12]
        ref = head[5:]
        loose = git / ref
        if loose.is_file():
            return loose.read_text().strip()[:12]
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:12]
    except OSError:
        pass
    return "unknown"


def source_digest(package: str | os.PathLike | None = None) -> str:
    """12 hex digits of SHA-1 over the package's Python files (each one's path in the package and its bytes, in path
    order): the code that ran, where a copy of the tree carries a .git older than its files (`commit` then names an
    earlier commit). The same files give the same digest in any checkout."""
    import hashlib
    top = Path(package) if package is not None else Path(__file__).resolve().parents[1]
    digest = hashlib.sha1()
    for path in sorted(top.rglob("*.py")):
        digest.update(path.relative_to(top).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def provenance(device: str | torch.device | None = None) -> dict[str, str]:
    """What every raw row carries: the device it ran on, torch, the date, the commit of the code and its
    `source_digest`."""
    return {"device": device_name(device), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "commit": commit(), "source": source_digest()}


def over_runs(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What repeated runs of one mode say together: the median of their step_ms and its spread (fastest and slowest
    run), the median of their first_run_s and their highest peak_gib (rows without a figure left out of it). A
    figure is the median of repeated runs, never the favourable one."""
    import statistics
    steps = [r["step_ms"] for r in rows]
    firsts = [r["first_run_s"] for r in rows if r.get("first_run_s") is not None]
    peaks = [r["peak_gib"] for r in rows if r.get("peak_gib") is not None]
    return {"step_ms": round(statistics.median(steps), 3), "spread": [min(steps), max(steps)],
            "first_run_s": round(statistics.median(firsts), 2) if firsts else None,
            "peak_gib": max(peaks) if peaks else None}


def missing(lib: str) -> bool:
    """Whether the optional library `lib` is not installed (its modes' rows then say `pip install <lib>`)."""
    import importlib.util
    return importlib.util.find_spec(lib) is None


def one_line(e: BaseException) -> str:
    """An error as a row's one-line note: its type and its message with every run of whitespace (newlines included)
    made one space, cut at 300 characters."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def device_name(device: str | torch.device | None = None) -> str:
    """The name results carry for `device`: "cpu" for a CPU device; otherwise (CUDA, or None: this process's default)
    the GPU's name (torch.cuda.get_device_name), or "cpu (<processor>)" where no GPU is visible."""
    if device is not None and torch.device(device).type == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def free(dynamo: bool = False) -> None:
    """Drop what a finished model, mode or case left: its tensors and the reference cycles they sit in (models and
    their decoders, CUDA graphs, compiled code), the allocator's cached blocks and (dynamo) every compiled graph,
    dropped first so that what only its graphs held is collected with the rest."""
    if dynamo:
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth_gbps(nbytes: int = 2**30) -> float:
    """Device-to-device copy rate, counting bytes read and written: the ceiling for memory-bound kernels."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def command_line(prefix: str, argv: list[str] | None) -> str:
    """The command a suite was run with, for its results' meta: `prefix` and the arguments (sys.argv's when None)."""
    return (prefix + " " + " ".join(argv if argv is not None else sys.argv[1:])).strip()


def write_results(results: list[Result], out_dir: str, suite: str, command: str) -> tuple[str, str]:
    """Write `<suite>.json` and `<suite>.md` (a table with ratios) and return their paths."""
    meta = {"suite": suite, **provenance(), "command": command}
    rows = [dict(asdict(r), speedup=r.speedup) for r in results]
    return write_json_and_markdown(out_dir, suite, {"meta": meta, "results": rows}, markdown_table(results, meta))


def markdown_table(results: list[Result], meta: dict[str, Any]) -> str:
    lines = [f"{meta['date']} · {meta['device']} · torch {meta['torch']} · `{meta['command']}`", "",
             "| case | ms | anchor | anchor ms | speedup vs anchor | notes |", "|---|---:|---|---:|---:|---|"]
    for r in results:
        sp = f"{r.speedup:.2f}x" if r.speedup is not None else ""
        am = f"{r.anchor_ms:.4f}" if r.anchor_ms is not None else ""
        notes = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items())
        lines.append(f"| {r.name} | {r.ms:.4f} | {r.anchor or ''} | {am} | {sp} | {notes} |")
    return "\n".join(lines) + "\n"


def ratio_bars(rows: list[dict[str, Any]], ratio_key: str, modes: tuple[str, ...] | list[str], anchor: str,
               title: str, path: str) -> None:
    """Grouped bars of each row's `ratio_key` (speed against `anchor`), one group per model, one bar per mode; the
    anchor is the line at 1. Written atomically: a failed save leaves the previous PNG in place."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from automp.files import atomic_output
    models = list(dict.fromkeys(r["model"] for r in rows))
    ratio = {(r["model"], r["mode"]): r.get(ratio_key) for r in rows}
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(models)), 5))
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(models))]
        ax.bar(xs, [ratio.get((m, mode)) or 0 for m in models], width, label=mode)
    ax.axhline(1.0, color="k", lw=1)
    ax.set_xticks(range(len(models)), models)
    ax.set(ylabel=f"speed vs {anchor} (> 1 faster)", title=f"{title} — {rows[0].get('device', '')}")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)


def usage_problem(names: list[tuple[str, str, tuple[str, ...]]], bounds: list[tuple[str, float, float]],
                  out: str, exts: tuple[str, ...] = (".json", ".md", ".png")) -> str | None:
    """A suite's usage error in one line, or None: comma-separated names outside their known set (flag, text,
    known), numbers below their least value (flag, value, least), an --out prefix whose folder cannot be made or
    whose files cannot be written. Checked before anything runs, so a typo costs nothing."""
    for flag, text, known in names:
        unknown = [n for n in text.split(",") if n not in known]
        if unknown:
            return f"{flag}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(known)}"
    for flag, value, low in bounds:
        if value < low:
            return f"{flag} must be at least {low}, got {value:g}"
    folder = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        return f"--out {out}: cannot create the directory {folder} ({e.strerror})"
    try:
        for ext in exts:
            check_writable(out + ext, "--out")
    except (OSError, ValueError) as e:
        return str(e)
    return None


def cpu_refusal(suite: str, device: str, quick: bool) -> str | None:
    """The one line a suite of full-size training workloads refuses to run on a CPU with, or None where it runs (on
    CUDA, or the CPU-sized --quick smoke run): its models take minutes per step there, and a run that trains them
    for an hour without a word helps nobody."""
    if device == "cuda" or quick:
        return None
    return (f"automp bench {suite}: needs a CUDA GPU (these models take minutes per step on a CPU); add --quick for "
            f"a CPU-sized smoke run")


def gpu_slug(name: str) -> str:
    """A device name's short form for file names: its first word with a digit, NVIDIA dropped and lower-cased
    ('NVIDIA GeForce RTX 4090' -> '4090'); 'cpu' -> 'cpu'."""
    m = re.search(r"\b([A-Z]*\d+[A-Z]*)\b", name.upper().replace("NVIDIA", ""))
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def fmt(value: Any, spec: str) -> str:
    """A markdown table cell: `value` formatted, or empty where there is none."""
    return "" if value is None else format(value, spec)


def header(suite: str, rows: list[dict[str, Any]], legend: list[str]) -> list[str]:
    """A suite's markdown title, the device / torch / date line of its rows, and its legend lines."""
    lines = [f"# automp bench {suite}", ""]
    if rows:
        lines += [f"- {rows[0].get('device')} · torch {rows[0].get('torch')} · {rows[0].get('date')}"]
    return lines + [f"- {line}" for line in legend]


def row_notes(row: dict[str, Any]) -> str:
    """A training row's notes cell: why it was skipped, the paths automp ran, how many of each model's linear layers
    ran FP8 (and, under FSDP2, were all-gathered in FP8), whether it had settled."""
    notes = [f"skipped: {row['skipped']}"] if "skipped" in row else []
    if row.get("automp_paths"):
        notes.append("paths: " + ", ".join(f"{k}={v}" for k, v in row["automp_paths"].items()))
    fp8 = row.get("fp8_layers")
    for module, per in (fp8.items() if isinstance(fp8, dict) else ()):  # the report's `fp8`, per model
        gathered = per.get("all_gather", {}).get("rules", {}).get(FP8_GATHER)
        notes.append(f"{module}: {per.get('fp8_layers')} of {per.get('layers_seen')} layers FP8"
                     + (f", {gathered} all-gathered in FP8" if gathered else ""))
    if row.get("settled") is False:
        notes.append("automp not settled")
    return "; ".join(notes)
