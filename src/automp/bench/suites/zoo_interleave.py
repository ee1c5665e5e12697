"""Drift-free ratios for `automp bench zoo --interleave`: automp-bf16 and the anchor in alternating blocks, one process.

The zoo runs its modes one after another, minutes apart, and a shared GPU host drifts by tens of percent over
minutes: the same anchor, and automp's ratio to it, can move more between two runs than the effect being measured
(BENCHMARKS.md, "Noise"). Here both loops live in one process: the anchor
(autocast-bf16 + torch.compile) is built and warmed up, automp runs its own trial to a verdict as a user's run would,
then blocks of steps alternate A B, B A, ... and each side's median block time is compared. A drift slower than a block
hits both.

Both models are resident, so this measures time only: peak memory and loss stay the separate rows'. Both also run
under the allocator setting automp makes (automp.runtime.tuning.allocator), which the anchor's separate row does not
have. bf16 only: the anchor runs inside the automp session (automp steps aside for a module called under the script's
own autocast, as the report says), and under fp16 that step-aside would also take automp's loss scaling off for the
automp loop.
"""
from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from automp.bench import zoo_modes as zoo
from automp.bench.harness import block_ms, block_order, free

ROUNDS = 6  # even: each side leads in half of them
# The bar a model's automp row is held to: the hand-written autocast + compile loop for the large models,
# the eager loops for the small scripts, where compiling does not pay. The detector's own compile takes minutes
# (data-dependent shapes), so its practical bar is the eager loop as well.
EAGER_BAR = ("gan", "recsys", "lstm", "mlp", "detector")


def anchor_for(name: str, strongest: bool = False) -> str:
    """The mode `--interleave` times automp against for model `name`; strongest: the run measures the expert's loop
    (autocast + reduce-overhead + fused Adam), which then is the large models' bar."""
    if name in EAGER_BAR:
        return "autocast-bf16-eager"
    return zoo.STRONGEST if strongest else zoo.ANCHOR


def interleaved(name: str, quick: bool, device: str, steps: int, warmup: int, max_warmup: int,
                rounds: int = ROUNDS, timer: Callable[[Callable[[], Any], int, str], float] = block_ms,
                anchor_mode: str = zoo.ANCHOR, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """{"anchor_ms", "automp_ms", "ratio" (anchor / automp), "blocks": {side: [ms, ...]}, "paths"} for one model.
    anchor_mode: the zoo mode automp is timed against (the small scripts' bar is eager: "autocast-bf16-eager").
    options: further automp.enable arguments, for ablations (e.g. {"tune_cudnn": False}).
    Only the script's own autocast modes: the anchor runs inside automp's session, which leaves a module called
    under the script's autocast as written, but would take over an FP32 loop's modules too."""
    if not anchor_mode.startswith("autocast-bf16"):
        raise ValueError(f"anchor {anchor_mode!r}: interleaving needs an autocast-bf16 anchor (automp's session "
                         f"would also run an FP32 anchor's modules)")
    import automp
    # process-wide: automp may choose another (automp.runtime.tuning.conv_tuning)
    scripts_flag = torch.backends.cudnn.benchmark
    torch.manual_seed(0)
    anchor = zoo.ModeLoop(zoo.MODELS[name][0](quick, device), anchor_mode, device)
    for _ in range(warmup):
        anchor.step()
    torch.manual_seed(0)
    loop = zoo.ModeLoop(zoo.MODELS[name][0](quick, device), "fp32-eager", device)
    # the rest of the configuration from the environment, as `automp run` reads it (a forced path, for diagnostics)
    automp.enable(dtype="bf16", **(options or {}))
    try:
        n = 0
        while n < warmup or (not automp.settled() and n < max_warmup):
            loop.step()
            n += 1
        settled = automp.settled()
        steps_of = {"anchor": anchor.step, "automp": loop.step}
        for side in steps_of:  # the anchor's first calls under the session: automp notes it and steps aside
            timer(steps_of[side], 1, device)
        blocks: dict[str, list[float]] = {"anchor": [], "automp": []}
        for order in block_order(["anchor", "automp"], rounds):
            for side in order:
                chosen = torch.backends.cudnn.benchmark
                if side == "anchor":  # the anchor runs as its own script would: with the flag it set
                    torch.backends.cudnn.benchmark = scripts_flag
                blocks[side].append(timer(steps_of[side], steps, device))
                torch.backends.cudnn.benchmark = chosen
    finally:
        report = automp.disable()
    a, m = statistics.median(blocks["anchor"]), statistics.median(blocks["automp"])
    paths = {c["module"]: c["path"] for c in report.get("choices", []) if c.get("path")}
    return {"anchor_ms": round(a, 3), "automp_ms": round(m, 3), "ratio": round(a / m, 3), "blocks": blocks,
            "paths": paths, "settled": settled,
            "settings": {e["setting"]: e["value"] for e in report.get("settings", [])}}


def add_to_row(row: dict[str, Any], name: str, quick: bool, device: str, steps: int, warmup: int,
               max_warmup: int, timeout: float, strongest: bool = False) -> None:
    """automp-bf16's zoo row gets ratio_interleaved (anchor ms / automp ms), step_ms_interleaved,
    anchor_ms_interleaved and anchor_interleaved (the mode it was timed against, anchor_for); or interleave_error,
    the separate rows standing without it."""
    anchor = anchor_for(name, strongest)
    print(f"[{name}] automp-bf16 interleaved with {anchor} ...", flush=True)
    try:
        with zoo.time_limit(timeout) as expired:
            got = interleaved(name, quick, device, steps, warmup, max_warmup, anchor_mode=anchor)
    except Exception as e:  # noqa: BLE001 - the separate rows stand without it
        row["interleave_error"] = str(expired[0]) if expired else f"{type(e).__name__}: {str(e)[:200]}"
        print(f"[{name}] interleaved: {row['interleave_error']}", flush=True)
        return
    finally:
        free(dynamo=True)
    row.update(ratio_interleaved=got["ratio"], step_ms_interleaved=got["automp_ms"],
               anchor_ms_interleaved=got["anchor_ms"], anchor_interleaved=anchor)
    blocks = got.get("blocks") or {}
    if blocks.get("anchor") and blocks.get("automp"):  # the spread beside the medians: each block's anchor/automp
        ratios = [a / m for a, m in zip(blocks["anchor"], blocks["automp"])]
        row["ratio_interleaved_spread"] = [round(min(ratios), 3), round(max(ratios), 3)]
    print(f"[{name}] interleaved: automp-bf16 {got['automp_ms']:.2f} ms vs {anchor} {got['anchor_ms']:.2f} ms: "
          f"{got['ratio']:.3f}x (paths: {got['paths']})", flush=True)
