"""The ranks of a torch.distributed job agree on what automp does with a module they all call in lockstep.

A DDP or FSDP module runs collectives inside its forward and backward: every rank must run the same graph around them,
so every rank takes rank 0's cached verdict or candidates (`rank0_start`), ends its trial at the same iteration
(`for_ranks`: no early drop, which depends on a rank's own timings) and runs rank 0's verdict (`agreed`). A module
called on some ranks only (an evaluation on rank 0) decides alone: it must not wait for the others at a broadcast.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from automp.runtime.decisions import RANK0, Route, Verdict
from automp.runtime.trial import TrialConfig
from automp.world import distributed

# Modules every rank calls at the same point of every iteration: their forward runs collectives of its own (DDP,
# FSDP1 by class; FSDP2 by its FSDPModule mixin, on the root or any submodule). A root called on some ranks only (an
# evaluation on rank 0) must not wait for the others at automp's broadcasts.
_LOCKSTEP = ("DistributedDataParallel", "FullyShardedDataParallel")


def lockstep(module: Any) -> bool:
    """Whether every rank calls `module` at the same point of every iteration (see _LOCKSTEP)."""
    if type(module).__name__ in _LOCKSTEP:
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in module.modules())


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (one broadcast; every rank must call it at the same point); `value` itself
    outside torch.distributed."""
    import torch

    if not distributed():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def writer() -> bool:
    """Whether this process writes what a job writes once (the verdict cache): rank 0, or a process on its own."""
    import torch

    return not distributed() or torch.distributed.get_rank() == 0


def for_ranks(config: TrialConfig) -> TrialConfig:
    """The trial's settings under torch.distributed: no candidate is dropped early. Rank 0's verdict is broadcast at
    the iteration the trial ends (`agreed`), so every rank must end it at the same iteration; a drop depends on a
    rank's own timings, and a rank whose trial ran longer would meet that broadcast with its gradient all-reduce."""
    if not distributed():
        return config
    return replace(config, give_up=math.inf, give_up_first=math.inf, twin_margin=math.inf)


def rank0_start(cached: Verdict | None, candidates: list[Route], why: str
                ) -> tuple[Verdict | None, list[Route], str]:
    """Under torch.distributed every rank starts a new module it calls in lockstep (a DDP module) as rank 0 does: from
    rank 0's cached verdict, or with rank 0's candidates for a trial. Ranks may hold different verdict caches (one
    per node) and measure their devices slightly apart; a rank that ran a trial the others skipped would wait at its
    verdict's broadcast."""
    if not distributed():
        return cached, candidates, why
    cached, values, why = from_rank0((cached, [p.value for p in candidates], why))
    return cached, [Route(v) for v in values], why


def agreed(verdict: Verdict) -> Verdict:
    """Under torch.distributed every rank runs rank 0's verdict for a module it calls in lockstep (a DDP module): ranks
    timing slightly differently must not end up running different paths (different graphs around DDP's all-reduce
    hooks). Rank 0's timings come with it, so the re-measurement that follows (`confirmation`) is started, or not,
    on every rank alike."""
    if not distributed():
        return verdict
    path, timings = from_rank0((verdict.path.value, verdict.timings_ms))
    if path == verdict.path.value:
        return replace(verdict, timings_ms=timings)
    return replace(verdict, path=Route(path), timings_ms=timings, rule=RANK0,
                   reason=f"rank 0's verdict (all ranks run one path); this rank measured: {verdict.reason}")
