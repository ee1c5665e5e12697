"""`automp bench convergence`: does reduced precision train as well as FP32?

Every case of automp.models.convergence (six families + one whose gradients underflow fp16) trains from the same
init on the same data in each mode: FP32 (the anchor, same run), fp16 without loss scaling, fp16 with a constant
scale, fp16 with automp's dynamic scale, and bf16. The table gives the held-out metric, its gap to FP32 and
whether that is within the family's tolerance; one PNG of loss curves per case.

Backends: "automp" is automp.enable()/disable() around the unchanged training loop (what `automp run` does).
On a CPU it plans with a GPU's cost table (spec="h100": a CPU's own costs keep these tiny shapes in FP32).
"autocast" is torch.autocast for the fp16/bf16 compute plus automp's loss-scaling hook, for comparison.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from automp.bench.harness import Result, device_name, write_results
from automp.models.convergence import CASES, make_task
from automp.scaling import LossScaler, install, uninstall

MODES = ("fp32", "fp16-noscale", "fp16-constant", "fp16-dynamic", "bf16")
CONSTANT_SCALE = 2.0 ** 12
_LOSS_SCALE = {"fp16-noscale": "off", "fp16-constant": CONSTANT_SCALE, "fp16-dynamic": "dynamic", "bf16": "off"}


@dataclass
class CaseResult:
    case: str
    mode: str
    backend: str
    losses: list[float]
    metric_name: str
    metric: float
    higher_is_better: bool
    tolerance: float
    eval_loss: float
    ms_per_step: float
    info: dict[str, Any] = field(default_factory=dict)

    def gap(self, ref: "CaseResult") -> float:
        """How much worse than ref (positive = worse), in the metric's units."""
        return (ref.metric - self.metric) if self.higher_is_better else (self.metric - ref.metric)

    def matches(self, ref: "CaseResult") -> bool:
        return self.gap(ref) <= self.tolerance and all(map(_finite, self.losses[-5:]))


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


@contextlib.contextmanager
def precision(mode: str, backend: str, device: torch.device) -> Iterator[dict[str, Any]]:
    """Everything inside runs in `mode`; on exit the dict holds the loss-scale summary (and, for automp, the
    share of graph nodes it put in low precision)."""
    if mode not in MODES:
        raise ValueError(f"unknown precision mode {mode!r}: expected one of {MODES}")
    info: dict[str, Any] = {}
    if mode == "fp32":
        yield info
        return
    dtype, loss_scale = ("bf16" if mode == "bf16" else "fp16"), _LOSS_SCALE[mode]
    if backend == "automp":
        import automp
        # inner="eager": the same precision decisions without Inductor's compile time; this suite measures
        # training quality, not speed (Inductor's fusions would only keep more intermediates in FP32)
        # on a CPU, plan with a GPU's costs: the CPU's own cost model keeps these tiny shapes in FP32, and this suite is
        # about what low precision does to training, so the low-precision decisions must actually be taken
        automp.enable(dtype=dtype, loss_scale=loss_scale, inner="eager", path="compile",
                      spec="h100" if device.type == "cpu" else None)
        try:
            yield info
        finally:
            rep = automp.disable() or {}
            nodes = [n for g in rep.get("graphs", []) for n in g["nodes"]]
            info["low_precision_nodes"] = sum(n["dtype"] in ("float16", "bfloat16") for n in nodes) / max(len(nodes), 1)
            if loss_scale != "off":
                info["loss_scale"] = rep.get("loss_scale")
        return
    if backend != "autocast":
        raise ValueError(f"unknown backend {backend!r}: expected 'automp' or 'autocast'")
    scaler = install(LossScaler.from_spec(loss_scale)) if loss_scale != "off" else None
    low = torch.bfloat16 if dtype == "bf16" else torch.float16
    try:
        # cache off: autocast's cast cache lives until the context exits, and this one spans optimizer steps
        with torch.autocast(device.type, dtype=low, cache_enabled=False):
            yield info
    finally:
        if scaler is not None:
            info["loss_scale"] = scaler.summary()
            uninstall()


def run_case(case: str, mode: str, steps: int | None = None, size: str = "tiny", backend: str = "automp",
             device: str | torch.device = "cpu", seed: int = 0) -> CaseResult:
    device = torch.device(device)
    task = make_task(case, size=size, device=device, seed=seed)
    steps = steps or task.default_steps
    with precision(mode, backend, device) as info:
        t0 = time.perf_counter()
        losses = [task.train_step(i) for i in range(steps)]
        curve = torch.stack(losses).tolist()  # one sync for the whole curve
        seconds = time.perf_counter() - t0
    eval_loss, metric = task.evaluate()
    return CaseResult(case, mode, backend, curve, task.metric_name, metric, task.higher_is_better, task.tolerance,
                      eval_loss, 1e3 * seconds / steps, info)


def _plot(case: str, results: list[CaseResult], out: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        k = max(1, len(r.losses) // 50)  # moving average so the modes can be told apart
        ys = [sum(r.losses[i:i + k]) / k for i in range(0, len(r.losses) - k + 1)]
        ax.plot(range(len(ys)), ys, label=r.mode, lw=2 if r.mode == "fp32" else 1)
    ax.set(title=f"{case}: training loss ({results[0].backend})", xlabel="step", ylabel="loss", yscale="log")
    ax.legend()
    path = os.path.join(out, f"convergence-{case}.png")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def _result(r: CaseResult, ref: CaseResult) -> Result:
    extra: dict[str, Any] = {r.metric_name: r.metric, "gap_vs_fp32": r.gap(ref),
                             "within_tol": f"{r.matches(ref)} (tol {r.tolerance:g})", "final_loss": r.losses[-1]}
    scale = r.info.get("loss_scale")
    if scale:
        extra.update(scale=scale["scale"], overflow_steps=scale["overflow_steps"])
    if "low_precision_nodes" in r.info:
        extra["low_prec_nodes"] = r.info["low_precision_nodes"]
    return Result("convergence", f"{r.case}/{r.mode}", r.ms_per_step, anchor=f"{r.case}/fp32",
                  anchor_ms=ref.ms_per_step, extra=extra)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="automp bench convergence")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--backend", default="automp", choices=["auto", "automp", "autocast"],
                   help="automp (default; 'auto' is an alias) or autocast + automp's loss-scaling hook")
    p.add_argument("--quick", action="store_true", help="tiny models, few steps (CPU smoke run)")
    p.add_argument("--steps", type=int, default=None, help="override every case's step count")
    p.add_argument("--out", default="bench-results")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = "automp" if args.backend == "auto" else args.backend
    size = "tiny" if args.quick or device.type == "cpu" else "full"
    modes = ["fp32"] + [m for m in args.modes.split(",") if m != "fp32"]
    print(f"device: {device_name()}  torch {torch.__version__}  backend: {backend}  size: {size}")
    os.makedirs(args.out, exist_ok=True)
    results = []
    for case in args.cases.split(","):
        runs = [run_case(case, m, args.steps, size, backend, device) for m in modes]
        results += [_result(r, runs[0]) for r in runs]
        print(f"{case}: " + "  ".join(f"{r.mode} {r.metric_name}={r.metric:.4g}" for r in runs))
        _plot(case, runs, args.out)
    paths = write_results(results, args.out, "convergence",
                          f"automp bench convergence {' '.join(argv)} (backend {backend}, size {size})")
    print(open(paths[1]).read())
    return 0
