"""One rank of `automp bench dist` (automp.bench.suites.dist), run under torchrun: every requested model x mode in
turn on this world size, each built, warmed up, timed and freed before the next; rank 0 writes the rows.

Every rank seeds the model identically (torch.manual_seed(0) before building) and draws its own data shard (batches
from a generator seeded 1234 + rank). NCCL on CUDA (one GPU per local rank), gloo on CPU.

Collectives are kept in lockstep: every decision that ends a loop (automp's warm-up) is all-reduced, so ranks never
disagree on how many steps they take. A mode that raises (OOM, a compile error, --mode-timeout) is caught on its rank;
after the mode every rank gathers the failures, so one rank's failure skips the row on all of them. A failure that
leaves a rank stuck inside a collective cannot be caught here: the parent's time limit on the launch ends the worker
and reports the modes that had not finished.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from automp.bench import fp8_workloads as wl
from automp.bench.fp8_run import cold_cache
from automp.bench.harness import block_ms, cold_compiles, free, one_line
from automp.bench.kernel_profile import comm_overlap, kernel_spans
from automp.bench.zoo_modes import fuse_adam, time_limit
from automp.files import atomic_output

MODELS = ("llama-d2048-ddp", "llama-d4096-fsdp2")
MODES = ("bf16-compile", "torchao-float8", "automp-bf16", "automp-fp8", "automp-fp8-bf16-gather")
DEFAULT_MODES = MODES[:4]
ROW_KEYS = ("model", "mode", "gpus", "step_ms", "spread", "tokens_per_s_per_gpu", "scaling_eff", "ratio_vs_bf16",
            "peak_gib", "loss", "first_run_s", "automp_paths", "fp8_layers")
PROFILE_KEYS = ("comm_ms", "comm_exposed_ms", "comm_overlap")  # --profile: comm_overlap, the worst rank's
COLLECTIVE_TIMEOUT_S = 900.0  # a rank stuck this long in a collective fails it (the launch's own limit ends the rest)


class Rank:
    """Where this process stands: rank, world size, device, and the collectives the suite needs on top of
    torch.distributed (a reduction of Python numbers on the backend's device). `timeout_s`: how long a collective
    waits for the other ranks before torch.distributed fails it."""

    def __init__(self, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.local = int(os.environ.get("LOCAL_RANK", 0))
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda":
            torch.cuda.set_device(self.local)
        elif sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo on one host: loopback, whatever the NICs are
        dist.init_process_group("nccl" if self.device == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def where(self) -> str:
        return f"cuda:{self.local}" if self.device == "cuda" else "cpu"

    def reduce(self, values: list[float], op: Any) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.where)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def all_settled(self, mine: bool) -> bool:
        """True when every rank's automp has settled (MIN over ranks): the warm-up stops on all ranks at once."""
        return bool(self.reduce([float(mine)], dist.ReduceOp.MIN)[0])


def build(model: str, rank: Rank, opts: argparse.Namespace) -> wl.Workload:
    """The model's workload on this rank's device, identical weights on every rank, this rank's data shard."""
    torch.manual_seed(0)
    seed = 1234 + rank.rank
    if model == "llama-d2048-ddp":
        return wl.llama_d2048(opts.quick, rank.where, 0, seed=seed, depth=opts.layers_d2048)
    return wl.llama_d4096(opts.quick, rank.where, opts.layers_d4096, seed=seed)


def wrap(model: str, mode: str, work: wl.Workload, rank: Rank) -> nn.Module:
    """torchao's conversion (before wrapping, as torchao requires), then DDP or FSDP2. FSDP2 follows torchtitan:
    bf16-compile and torchao-float8 compile each decoder layer before fully_shard, then shard each layer and the
    root. DDP's compiled loop compiles the DDP module itself (see loop)."""
    fsdp = model.endswith("fsdp2")
    if mode == "torchao-float8":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True) if fsdp else Float8LinearConfig()
        convert_to_float8_training(work.model, config=config, module_filter_fn=wl.torchao_filter)
    if not fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(work.model, device_ids=[rank.local] if rank.device == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(rank.device, (rank.world,))
    for layer in work.model.model.layers:
        if not mode.startswith("automp"):
            layer.compile()
        fully_shard(layer, mesh=mesh)
    fully_shard(work.model, mesh=mesh)
    return work.model


def loop(model: str, mode: str, work: wl.Workload, net: nn.Module, device: str) -> Callable[[], torch.Tensor]:
    """bf16-compile / torchao-float8: autocast bf16 + torch.compile (default mode: CUDA graphs do not mix with the
    collectives) + fused AdamW. automp-*: the plain FP32 loop over the wrapped model, plain AdamW."""
    opt = torch.optim.AdamW(net.parameters(), lr=wl.LR)
    if mode.startswith("automp"):
        return wl._step_fn(work, net, opt, None)
    fuse_adam([opt])
    compiled = torch.compile(net) if model.endswith("ddp") else net  # FSDP2: its layers are compiled (wrap)
    return wl._step_fn(work, compiled, opt, device)


def shared_cache(rank: Rank) -> tuple[str, Any]:
    """automp's verdict cache for one mode: rank 0's cold cache, its path broadcast, so every rank reads and
    writes the same one."""
    tmp = cold_cache() if rank.rank == 0 else None
    box = [tmp.name if tmp else None]
    dist.broadcast_object_list(box, src=0)
    return box[0], tmp


class Mode:
    """One model x mode on this rank: its row, filled as it goes."""

    def __init__(self, model: str, mode: str, rank: Rank, opts: argparse.Namespace):
        self.model, self.mode, self.rank, self.opts = model, mode, rank, opts
        self.row: dict[str, Any] = {k: None for k in ROW_KEYS + (PROFILE_KEYS if opts.profile else ())}
        self.row.update(model=model, mode=mode, gpus=rank.world)
        self.common = max(opts.warmup, opts.first_steps) + opts.blocks * opts.steps  # where every mode reads its loss
        self.n, self.tokens = 0, 0  # steps taken; tokens per step on this rank
        self.loss: torch.Tensor | None = None
        self.step_fn: Callable[[], torch.Tensor] | None = None

    def step(self) -> None:
        loss = self.step_fn()
        self.n += 1
        if self.n == self.common:  # a copy: a later step may overwrite a compiled graph's output
            self.loss = loss.detach().clone().float()

    def measure(self) -> tuple[float, float]:
        """Build, warm up, time; returns (first_run_s, peak_gib) of this rank for the MAX over ranks."""
        import automp
        opts, rank, cuda = self.opts, self.rank, self.rank.device == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        if cuda:
            sync()
            torch.cuda.reset_peak_memory_stats()
        automp_mode = self.mode.startswith("automp")
        t0 = time.perf_counter()
        work = build(self.model, rank, opts)
        self.tokens = work.batches[0]["input_ids"].numel()
        self.step_fn = loop(self.model, self.mode, work, wrap(self.model, self.mode, work, rank), rank.device)
        first = math.nan
        target = max(opts.warmup, opts.first_steps)
        settled = not automp_mode
        while self.n < target or (not settled and self.n < opts.max_warmup):
            self.step()
            if self.n == opts.first_steps:
                sync()
                first = time.perf_counter() - t0
            if automp_mode and self.n >= target:
                settled = rank.all_settled(automp.settled())
        if automp_mode:
            self.row["settled"] = settled
        means = [block_ms(self.step, opts.steps, rank.device) for _ in range(opts.blocks)]
        means = rank.reduce(means, dist.ReduceOp.MAX)  # per block, the slowest rank sets the pace
        ms = statistics.median(means)
        self.row.update(step_ms=round(ms, 3), spread=[round(min(means), 3), round(max(means), 3)],
                        tokens_per_s_per_gpu=round(self.tokens / (ms / 1e3), 1))
        if self.loss is not None:
            loss = rank.reduce([float(self.loss)], dist.ReduceOp.SUM)[0] / rank.world
            self.row["loss"] = loss if math.isfinite(loss) else None
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan
        if opts.profile:
            self.profile()
        return first, peak

    def profile(self) -> None:
        """One more step under torch.profiler on every rank, its collectives' overlap with compute in the row
        (kernel_profile.comm_overlap): the longest collective and exposed times and the lowest overlap of any rank,
        the rank the others wait for. A CPU has no kernels to read: the keys stay None there."""
        from torch.profiler import ProfilerActivity, profile
        cuda = self.rank.device == "cuda"
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            self.step()
            if cuda:
                torch.cuda.synchronize()
        if not cuda:
            return
        o = comm_overlap(kernel_spans(prof))
        longest = self.rank.reduce([o["comm_ms"], o["comm_exposed_ms"]], dist.ReduceOp.MAX)
        lowest = self.rank.reduce([o["comm_overlap"] if o["comm_overlap"] is not None else 2.0], dist.ReduceOp.MIN)[0]
        self.row.update(comm_ms=round(longest[0], 3), comm_exposed_ms=round(longest[1], 3),
                        comm_overlap=round(lowest, 3) if lowest <= 1.0 else None)

    def run(self) -> dict[str, Any]:
        """The row, or the row skipped with the first failing rank's reason; everything the mode built freed."""
        import automp
        failure, first_peak, cache = None, [math.nan, math.nan], None
        expired: list[TimeoutError] = []
        try:
            if self.mode.startswith("automp"):
                path, cache = shared_cache(self.rank)
                automp.enable(dtype=self.mode.split("-")[1], cache_dir=path,
                              fp8_all_gather=self.mode != "automp-fp8-bf16-gather")
            with time_limit(self.opts.mode_timeout) as expired:
                first_peak = list(self.measure())
                if expired:  # swallowed by the code it interrupted
                    raise expired[0]
        except Exception as e:  # noqa: BLE001 - a failing mode (OOM, compile error) must not lose the others' rows
            failure = str(expired[0]) if expired else one_line(e)
        finally:
            self._finish_automp()
        failures: list[str | None] = [None] * self.rank.world
        dist.all_gather_object(failures, failure)
        if cache is not None:
            cache.cleanup()
        failed = [(r, f) for r, f in enumerate(failures) if f]
        if failed:
            r, reason = failed[0]  # the same failure on every rank (FP8 unavailable, OOM everywhere): said once
            self.row["skipped"] = reason if len(set(failures)) == 1 else f"rank {r}: {reason}"
            return self.row
        first, peak = self.rank.reduce([_nan0(v) for v in first_peak], dist.ReduceOp.MAX)
        self.row["first_run_s"] = round(first, 2) if first > 0 else None
        self.row["peak_gib"] = round(peak, 3) if self.rank.device == "cuda" else None
        return self.row

    def _finish_automp(self) -> None:
        import automp
        self.step_fn = None
        if self.mode.startswith("automp") and automp.is_enabled():
            report = automp.disable() or {}
            self.row["automp_paths"] = {c["module"]: c["path"] for c in report.get("choices", [])}
            if self.mode.startswith("automp-fp8"):
                self.row["fp8_layers"] = report.get("fp8") or None


def _nan0(v: float) -> float:
    return 0.0 if math.isnan(v) else v


def write_rows(path: str, rows: list[dict[str, Any]]) -> None:
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=2)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="automp.bench.dist_worker", description=__doc__.splitlines()[0])
    p.add_argument("--models", required=True)
    p.add_argument("--modes", required=True)
    p.add_argument("--result", required=True, help="rank 0 writes the rows here (JSON), after every mode")
    p.add_argument("--layers-d2048", type=int, default=16)
    p.add_argument("--layers-d4096", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-warmup", type=int, default=300)
    p.add_argument("--first-steps", type=int, default=20)
    p.add_argument("--mode-timeout", type=float, default=240)
    p.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT_S,
                   help="seconds a collective waits for the other ranks (init_process_group's timeout)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--quick", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = parser().parse_args(argv)
    rank = Rank(opts.collective_timeout)
    rows: list[dict[str, Any]] = []
    # Every mode compiles the same model class's forward (automp's trial two paths of its own): the default limit of
    # 8 compiled versions per frame would let a later mode run eager unnoticed. Each mode of each rank compiles on
    # empty caches of its own (harness.cold_compiles)
    with torch._dynamo.config.patch(recompile_limit=64):
        for model in opts.models.split(","):
            for mode in opts.modes.split(","):
                dist.barrier()
                with cold_compiles():
                    row = Mode(model, mode, rank, opts).run()
                free(dynamo=True)
                if rank.rank == 0:
                    rows.append(row)
                    write_rows(opts.result, rows)
                    shown = f"skipped: {row['skipped']}" if "skipped" in row else (
                        f"{row['step_ms']} ms/step, {row['tokens_per_s_per_gpu']} tokens/s/GPU, loss {row['loss']}")
                    print(f"[{model} x{rank.world}] {mode}: {shown}", flush=True)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
