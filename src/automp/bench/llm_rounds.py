"""The speed matrix's timing phase (automp.bench.llm_speed): the warmed cases of one batch size, timed in alternating
rounds.

A host and a GPU drift while a run goes on (clocks and temperature settle, other work comes and goes, the allocator's
state changes), so cases timed one after another are timed under different conditions, and the drift lands in their
ratio as if one case were faster than it is. Here each round takes one sample of every case, in the order of
harness.block_order (A B C, then C B A, ...): over a pair of rounds a drift that is linear in time adds the same to
every case, and no case is always first or last. A case's figure is the median of its rounds, and its spread (the
least and the greatest) says how far one round could be off.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Hashable

from automp.bench.harness import block_order


def time_rounds(calls: dict[Hashable, Callable[[], float]], rounds: int, deadline: float = math.inf,
                failed: Callable[[Hashable, Exception], None] | None = None) -> dict[Hashable, list[float]]:
    """Each call's samples over `rounds` alternating rounds. A call that raises is passed to `failed` and left out of
    the later rounds (and of the answer); the others go on. Past `deadline` (time.perf_counter) no sample starts, and
    what was taken stands: a call may come back with fewer samples than rounds, or none."""
    samples: dict[Hashable, list[float]] = {k: [] for k in calls}
    for order in block_order(list(calls), rounds):
        for key in order:
            if key not in samples:
                continue
            if time.perf_counter() >= deadline:
                return samples
            try:
                samples[key].append(calls[key]())
            except Exception as e:
                del samples[key]
                if failed is not None:
                    failed(key, e)
    return samples


def timed_row(row: dict, steps: list[float], batch: int, rounds: int) -> dict:
    """`row` (warmed: its step_gib and bandwidth_gbps filled) with the figures of its samples, ms per decode step of
    the whole batch: ms_per_token their median, spread [least, greatest], rounds their number; tokens/s and the
    roofline fraction from the median."""
    step = statistics.median(steps)
    notes = [row["note"]] if row.get("note") else []
    row.update(spread=[round(min(steps), 4), round(max(steps), 4)], rounds=len(steps),
               samples=[round(x, 5) for x in steps])  # one per round, in round order: paired with the anchor's
    if len(steps) < rounds:
        notes.append(f"--time-limit ended the timing after {len(steps)} of {rounds} rounds")
    if step > 0:
        row.update(ms_per_token=step, tokens_per_s=batch * 1e3 / step,
                   roofline_frac=row["step_gib"] * 2**30 / (row["bandwidth_gbps"] * 1e9) / (step / 1e3))
    else:
        notes.append("decode time below timing noise")
    if notes:
        row["note"] = "; ".join(notes)
    return row
