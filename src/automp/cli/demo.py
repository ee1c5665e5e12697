"""`automp demo`: train a small GPT and a small CNN in FP32 and with automp, side by side, and show what changed.

Both modes of a model start from the same weights and see the same batches, so the final losses differ only by
precision. The FP32 run is plain eager PyTorch (what a user has before automp); the automp run is that same loop
under automp.enable(), exactly what `automp run` does to a script. Its speedup therefore includes Inductor's
fusion as well as the lower precision; `automp bench train` separates the two against hand-written autocast.

Where automp keeps a model in FP32 as written, both runs execute the same code: a ratio of their step times would be
noise (or a cold first run) dressed up as a speed-up, so that row says in words what automp did and shows none. Every
demo measures afresh, in a verdict cache of its own that it deletes afterwards: a first and a later demo do the same
thing, and the demo's toy models leave nothing in the cache the user's own scripts read.
"""
from __future__ import annotations

import copy
import json
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import automp
from automp.models.cnn import CNN, CNNConfig
from automp.models.data import MarkovCorpus, PatternImages
from automp.models.gpt import GPT, GPTConfig
from automp.runtime.report import calls_in_words

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Workload:
    """One model with its data: built once, copied for each mode so both start from the same weights."""

    name: str
    model: nn.Module
    train: list[Batch]
    eval: Batch
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    lr: float


@dataclass
class RunResult:
    model: str
    mode: str  # "fp32" or "automp"
    final_loss: float
    step_ms: float
    losses: list[float] = field(repr=False)
    path: str | None = None  # automp's: the path it kept, as its report names it
    label: str = ""  # what the table shows for the run (automp's: what it did, in words)
    speedup: bool = True  # whether a step-time ratio against FP32 measures something automp changed


def describe(choice: dict[str, Any] | None, dtype: str) -> tuple[str, bool]:
    """The table's words for an automp run that ended on `choice` (a report's entry for its module), and whether its
    step time differs from FP32's by more than noise: only where it ran a low-precision or compiled path."""
    path = choice.get("path") if choice else None
    if path == "fp32-eager":
        # its trial's calls ran the other paths: the final loss may differ from FP32's by what they changed
        trial = calls_in_words(((choice.get("calls") or {}).get("trial")), dtype)
        if trial or len(choice.get("timings_ms") or {}) > 1:  # a trial measured the other paths
            return ("automp: kept FP32 as written — no low-precision path measured faster here"
                    + (f" (trial: {trial})" if trial else "")), False
        return f"automp: FP32 as written — {choice.get('reason', '')}", False
    if path == "as-written":
        return f"automp: runs as written in FP32 — {choice.get('reason', '')}", False
    if path == "unsettled":
        return "automp: still timing its paths when training ended (more --steps let it settle)", False
    if path is None:
        return "automp: no path recorded", False
    return f"automp ({dtype}, {path})", True


def _lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _cls_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def gpt_workload(steps: int, device: torch.device, seed: int = 0) -> Workload:
    big = device.type == "cuda"
    cfg = GPTConfig(vocab=256, ctx=256, d=512, layers=6, heads=8) if big else GPTConfig()
    batch = 32 if big else 16
    corpus = MarkovCorpus(vocab=cfg.vocab, successors=4, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)

    def split(tokens: torch.Tensor) -> Batch:
        tokens = tokens.to(device)
        return tokens[:, :-1], tokens[:, 1:]

    train = [split(corpus.batch(batch, cfg.ctx, gen)) for _ in range(steps)]
    held_out = split(corpus.batch(4 * batch, cfg.ctx, torch.Generator().manual_seed(seed + 2)))
    torch.manual_seed(seed)
    return Workload("gpt", GPT(cfg).to(device), train, held_out, _lm_loss, lr=3e-3)


def cnn_workload(steps: int, device: torch.device, seed: int = 0) -> Workload:
    big = device.type == "cuda"
    cfg = CNNConfig(widths=(64, 128, 256, 512)) if big else CNNConfig()
    data = PatternImages(size=32 if big else 16, seed=seed)
    batch = 256 if big else 64
    gen = torch.Generator().manual_seed(seed + 1)

    def move(b: Batch) -> Batch:
        return b[0].to(device), b[1].to(device)

    train = [move(data.batch(batch, gen)) for _ in range(steps)]
    held_out = move(data.batch(4 * batch, torch.Generator().manual_seed(seed + 2)))
    torch.manual_seed(seed)
    # A gentle lr: BatchNorm's running statistics lag fast-moving weights, and the held-out loss (eval mode) then
    # measures that lag, which swings by several percent with any perturbation, precision or otherwise.
    return Workload("cnn", CNN(cfg).to(device), train, held_out, _cls_loss, lr=1e-3)


def train(work: Workload, mode: str) -> RunResult:
    """The plain training loop a user writes; the held-out loss is taken in eval mode under no_grad."""
    model = copy.deepcopy(work.model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=work.lr, weight_decay=0.01)
    cuda = next(model.parameters()).is_cuda
    losses, times = [], []
    for batch in work.train:
        settled = automp.settled()  # automp's first iterations time its candidate paths: not its steady state
        t0 = time.perf_counter()
        loss = work.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if settled:
            times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.detach())
    model.eval()
    with torch.no_grad():
        final = work.loss(model, work.eval).item()
    return RunResult(work.name, mode, final, statistics.median(times) if times else float("nan"),
                     [float(x) for x in losses])


def run_demo(steps: int, device: torch.device, dtype: str = "auto",
             inner: str = "inductor") -> tuple[list[RunResult], dict[str, Any]]:
    """FP32 runs first, then every automp run under one enable(), so one report covers both models."""
    if steps < 1:
        raise ValueError(f"automp demo: --steps must be at least 1, got {steps}")
    works = [gpt_workload(steps, device), cnn_workload(steps, device)]
    results = [train(w, "fp32") for w in works]
    with tempfile.TemporaryDirectory(prefix="automp-demo-cache-") as cache:  # measured afresh, every demo
        automp.enable(dtype=dtype, loss_scale="dynamic", inner=inner,  # the environment may force a path
                      cache_dir=cache)
        try:
            results += [train(w, "automp") for w in works]
        finally:
            report = automp.disable() or {}
    choices = {c["module"]: c for c in report.get("choices", [])}
    modules = {"gpt": "GPT", "cnn": "CNN"}
    for r in results:
        if r.mode == "automp":
            choice = choices.get(modules[r.model])
            r.path = choice["path"] if choice else None
            r.label, r.speedup = describe(choice, report.get("dtype", dtype))
        else:
            r.label = "FP32 eager (as written)"
    return results, report


def print_results(results: list[RunResult], device: torch.device) -> None:
    from rich.console import Console
    from rich.table import Table

    fp32 = {r.model: r for r in results if r.mode == "fp32"}
    t = Table(title=f"automp demo on {device.type}: same weights, same batches",
              caption="step time: median over the training steps (automp: after its first iterations, which time "
                      "its candidate paths); speedup vs FP32 eager, only where automp ran something else")
    for col in ("model", "mode", "final loss", "vs FP32", "step ms", "speedup"):
        t.add_column(col, justify="left" if col in ("model", "mode") else "right")
    for r in sorted(results, key=lambda r: r.model):
        ref = fp32[r.model]
        rel = (r.final_loss - ref.final_loss) / abs(ref.final_loss) if ref.final_loss else float("nan")
        ratio = f"{ref.step_ms / r.step_ms:.2f}x" if r.mode == "automp" and r.speedup else "-"
        t.add_row(r.model, r.label or r.mode, f"{r.final_loss:.4f}", f"{100 * rel:+.2f}%",
                  "-" if math.isnan(r.step_ms) else f"{r.step_ms:.1f}", ratio)
    Console().print(t)


def main(steps: int = 80, device: str | None = None, dtype: str = "auto",
         report: str | None = "automp-demo-report.json") -> int:
    """Entry point of `automp demo`. The report JSON also carries the demo's results under "demo"."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("automp demo: --device cuda asked for, but torch sees no CUDA device")
    inner = automp.AutoMPConfig.from_env().inner
    results, rep = run_demo(steps, dev, dtype, inner)
    print_results(results, dev)
    from automp.runtime.report import print_report
    if rep.get("graphs") is not None:
        print_report(rep)
    if report:
        rep["demo"] = [{k: v for k, v in asdict(r).items() if k != "losses"} for r in results]
        from automp.files import atomic_output
        with atomic_output(report) as tmp, open(tmp, "w") as f:
            json.dump(rep, f, indent=1)
        print(f"precision report written to {report} (view it with `automp report {report}`)")
    return 0
