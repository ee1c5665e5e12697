"""One process of `automp bench integrations` (automp.bench.suites.integrations says what is compared and why): GPT-2
trained one way, its timings and report written to --out as one JSON row.

    python -m automp run --quiet --report R.json integrations_worker.py --mode loop ...   # the plain loop
    python integrations_worker.py --mode loop-late ...    # the plain loop calling automp.enable() once it has built
                                                          # its model and optimizer, as the integrations do
    python integrations_worker.py --mode trainer ...      # transformers.Trainer + AutoMPCallback
    python integrations_worker.py --mode lightning ...    # lightning.pytorch.Trainer + the AutoMP plugin
    python -m automp run ... integrations_worker.py --mode trainer-run ...     # the Trainer script, no callback
    python -m automp run ... integrations_worker.py --mode lightning-run ...   # the Lightning script, no plugin

Every mode trains the same model from the same seed on the same 8 batches (a Dataset of 8 x B sequences, batch B,
through a DataLoader that reshuffles), FP32 AdamW at one learning rate, no gradient clipping: the same script written
three ways. Timed: the wall time to the end of step --first (build and automp's trial included), and the steps of the
last third, between two device synchronizations (none in between: a host-bound step keeps its overlap)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

import torch

from automp.integrations.bracket import REPORT_NAME as REPORT  # loop-late writes it where an integration would

MODES = ("loop", "loop-late", "trainer", "trainer-run", "lightning", "lightning-run")
UNDER_RUN = ("loop", "trainer-run", "lightning-run")  # run by `automp run` around the process, not by an integration
LR = 1e-4


class Clock:
    """Step marks: `tick()` after every optimizer step; synchronizes only at the marks it keeps."""

    def __init__(self, device: str, steps: int, first: int) -> None:
        self.device, self.steps, self.first, self.n = device, steps, first, 0
        self.window = max(1, steps // 3)
        self.t0 = time.perf_counter()
        self.first_s = self.steady_ms = None
        self._start: float | None = None

    def _now(self) -> float:
        if self.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def tick(self) -> None:
        self.n += 1
        if self.n == self.first:
            self.first_s = round(self._now() - self.t0, 2)
        if self.n == self.steps - self.window:
            self._start = self._now()
        if self.n == self.steps and self._start is not None:
            self.steady_ms = round((self._now() - self._start) * 1e3 / self.window, 3)


def _data(quick: bool, device: str) -> tuple[torch.nn.Module, torch.utils.data.Dataset, int]:
    from automp.bench.fp8_workloads import gpt2
    torch.manual_seed(0)
    work = gpt2(quick, device, 0)
    ids = torch.cat([b["input_ids"] for b in work.batches]).cpu()

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": ids[i], "labels": ids[i]}
    return work.model, Tokens(), work.batches[0]["input_ids"].shape[0]


def _loader(data: torch.utils.data.Dataset, batch: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, drop_last=True,
                                       generator=torch.Generator().manual_seed(0))


def run_loop(opts: argparse.Namespace, clock: Clock) -> tuple[float, dict[str, Any] | None]:
    """The plain FP32 loop: automp comes from `automp run` around this process, its report from --report; or
    (loop-late) from the loop's own enable() once model and optimizer exist, where a framework's integration starts
    it, so that what that order costs is told apart from what a framework costs."""
    import automp
    model, data, batch = _data(opts.quick, opts.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    late = opts.mode == "loop-late"
    if late:
        automp.enable(quiet=True, report=os.path.join(opts.workdir, REPORT))
    loss = torch.zeros(())
    while clock.n < opts.steps:
        for b in _loader(data, batch):
            b = {k: v.to(opts.device, non_blocking=True) for k, v in b.items()}
            loss = model(**b).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            clock.tick()
            if clock.n == opts.steps:
                break
    return float(loss), automp.disable() if late else None


def run_trainer(opts: argparse.Namespace, clock: Clock) -> tuple[float, dict[str, Any] | None]:
    """The Trainer with AutoMPCallback, or (trainer-run) without it, automp coming from `automp run`."""
    import transformers

    from automp.integrations.transformers import AutoMPCallback
    model, data, batch = _data(opts.quick, opts.device)
    integrated = opts.mode == "trainer"

    class Tick(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.tick()
    automp_cb = AutoMPCallback()
    args = transformers.TrainingArguments(
        output_dir=opts.workdir, max_steps=opts.steps, per_device_train_batch_size=batch, learning_rate=LR,
        max_grad_norm=0.0, optim="adamw_torch", lr_scheduler_type="constant", report_to=[], save_strategy="no",
        logging_steps=10**9, dataloader_drop_last=True, use_cpu=opts.device == "cpu", disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[automp_cb, Tick()] if integrated else [Tick()])
    out = trainer.train()
    return float(out.training_loss), automp_cb.report if integrated else None


def run_lightning(opts: argparse.Namespace, clock: Clock) -> tuple[float, dict[str, Any] | None]:
    """Lightning with the AutoMP plugin, or (lightning-run) without it, automp coming from `automp run`."""
    import lightning.pytorch as pl

    from automp.integrations.lightning import AutoMP
    model, data, batch = _data(opts.quick, opts.device)
    last: list[float] = [float("nan")]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, b: dict[str, torch.Tensor], i: int) -> torch.Tensor:
            return self.net(**b).loss

        def on_train_batch_end(self, outputs: Any, b: Any, i: int) -> None:
            clock.tick()
            if clock.n == opts.steps:
                last[0] = float(outputs["loss"])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)
    plugin = AutoMP() if opts.mode == "lightning" else None
    trainer = pl.Trainer(max_steps=opts.steps, accelerator="gpu" if opts.device == "cuda" else "cpu", devices=1,
                         plugins=[plugin] if plugin else None, default_root_dir=opts.workdir,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         logger=False)
    trainer.fit(Module(), _loader(data, batch))
    return last[0], plugin.report if plugin else None


RUNS: dict[str, Callable[[argparse.Namespace, Clock], tuple[float, dict[str, Any] | None]]] = {
    "loop": run_loop, "loop-late": run_loop, "trainer": run_trainer, "trainer-run": run_trainer,
    "lightning": run_lightning, "lightning-run": run_lightning}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="integrations_worker", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--first", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workdir", required=True, help="the frameworks' output folder (the report lands there)")
    p.add_argument("--out", required=True, help="the row, as JSON")
    opts = p.parse_args(argv)
    opts.device = "cuda" if torch.cuda.is_available() else "cpu"
    if opts.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    clock = Clock(opts.device, opts.steps, min(opts.first, opts.steps))
    loss, report = RUNS[opts.mode](opts, clock)
    row = {"mode": opts.mode, "steps": clock.n, "step_ms": clock.steady_ms, "first_run_s": clock.first_s,
           "loss": loss, "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)
           if opts.device == "cuda" else None}
    if report is not None:
        row["paths"] = {c["module"]: c["path"] for c in report.get("choices", [])}
    with open(opts.out, "w", encoding="utf-8") as f:
        json.dump(row, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
