"""The speed matrix's results: rows keyed by (model, case, batch), merged into `<out>/llm-<gpu>.json` with the rows
of earlier runs (runs of subsets build one file) and rendered as a markdown table beside it; rewritten after every
row, so a run cut off keeps what it finished."""
from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any, Callable

import torch

from automp.bench.harness import fmt, header
from automp.files import write_json_and_markdown


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU has none)."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def one_line(e: BaseException) -> str:
    """An error as a row's one-line note: its type and its first line only, where harness.one_line keeps the whole
    message: a failing decode (an out-of-memory, a compile error) names itself on its first line and follows it with
    allocator or compiler dumps that would fill the row."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


CASES = ("fp16-compiled", "automp-int8", "automp-int4", "torchao-int8", "torchao-int4")
ANCHOR = "fp16-compiled"
ROW_KEYS = ("model", "case", "batch", "ms_per_token", "tokens_per_s", "weight_gib", "roofline_frac")


def row_key(row: dict) -> tuple:
    return row.get("model"), row.get("case"), row.get("batch")


def _order(row: dict) -> tuple:
    case = row.get("case")
    return (str(row.get("model")), row.get("layers") or 0, CASES.index(case) if case in CASES else len(CASES),
            str(case), row.get("batch") or 0)


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """`old` with each row of `new` in place of the row of the same (model, case, batch), sorted."""
    rows = {row_key(r): r for r in old}
    rows.update({row_key(r): r for r in new})
    return sorted(rows.values(), key=_order)


def load_rows(path: str) -> list[dict]:
    """The rows of an earlier run's file, [] where there is none; ValueError for a file that is not one."""
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable as results ({type(e).__name__}); move it away") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "case" in r for r in rows):
        raise ValueError(f"{path} is not a rows file of this benchmark; move it away")
    return rows


class Results:
    """A results file that every added row rewrites (a run cut off keeps what it finished)."""

    def __init__(self, out: str, stem: str, render: Callable[[list[dict]], str]):
        self.out, self.stem, self.render = out, stem, render
        self.rows = load_rows(os.path.join(out, stem + ".json"))
        self.added: list[dict] = []  # this run's rows

    def add(self, row: dict) -> None:
        self.added.append(row)
        self.rows = merge(self.rows, [row])
        write_json_and_markdown(self.out, self.stem, self.rows, self.render(self.rows))


def _vs_anchor(rows: list[dict], row: dict) -> float | None:
    """fp16-compiled's step time over this row's, same model, depth, batch and device: the median of the rounds'
    ratios where both rows hold one sample per round of the same run (llm_rounds: paired, so a drift between rounds
    cancels), else the ratio of their medians."""
    anchor = next((r for r in rows if r.get("case") == ANCHOR and r.get("batch") == row.get("batch") and
                   r.get("model") == row.get("model") and r.get("layers") == row.get("layers") and
                   r.get("device") == row.get("device")), None)
    if not anchor or not anchor.get("ms_per_token") or not row.get("ms_per_token"):
        return None
    a, b = anchor.get("samples"), row.get("samples")
    if a and b and len(a) == len(b) and min(b) > 0 and anchor.get("run") and anchor.get("run") == row.get("run"):
        return statistics.median(x / y for x, y in zip(a, b))
    return anchor["ms_per_token"] / row["ms_per_token"]


def markdown(rows: list[dict]) -> str:
    lines = header("llm", rows, [
        "decode step of the whole batch: (t(N new tokens) - t(1)) / (N - 1), the median of the alternating rounds "
        "(all cases of a batch size timed in each round), spread: the least and the greatest round; tokens/s = "
        "batch x 1000 / ms per step",
        "vs fp16: fp16-compiled's step time over the row's (same model, layers, batch; the median of the rounds' "
        "ratios where both were timed in the same rounds); roofline: bytes a step "
        "reads (weights but the input embedding, plus the KV cache) / copy bandwidth / step time"])
    lines += ["", "| model | layers | case | batch | ms/step | spread | tokens/s | vs fp16 | weights GiB | roofline "
              "| decode | notes |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        notes = "; ".join(f"{k}: {r[k]}" for k in ("skipped", "error") if r.get(k)) or (r.get("note") or "")
        spread = f"{r['spread'][0]:.3f}-{r['spread'][1]:.3f}" if r.get("spread") else ""  # none in older rows
        lines.append(f"| {r['model']} | {r.get('layers', '')} | {r['case']} | {r['batch']} | "
                     f"{fmt(r.get('ms_per_token'), '.3f')} | "
                     f"{spread} | {fmt(r.get('tokens_per_s'), '.1f')} | "
                     f"{fmt(_vs_anchor(rows, r), '.2f')} | {fmt(r.get('weight_gib'), '.2f')} | "
                     f"{fmt(r.get('roofline_frac'), '.2f')} | {r.get('decode') or ''} | {notes.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def finite(row: dict) -> bool:
    """Every number of the required keys is a finite number (what a finished row has)."""
    return all(isinstance(row.get(k), (int, float)) and math.isfinite(row[k]) for k in ROW_KEYS[2:])


def summary(rows: list[dict]) -> dict[str, Any]:
    """Counts of finished, skipped and failed rows, for the log."""
    return {"finished": sum(finite(r) for r in rows), "skipped": sum("skipped" in r for r in rows),
            "errors": sum("error" in r for r in rows)}


