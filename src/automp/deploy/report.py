"""What `automp optimize` did, as JSON for tools and a short table for people."""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

from automp.files import atomic_output
from automp.deploy.passes.pipeline import PassRecord
from automp.quant.ptq.compare import Error


def build(source: str, precision: str, records: list[PassRecord], ops_before: dict[str, int],
          ops_after: dict[str, int], errors: dict[str, Error], error_data: str, budget: float | None,
          fp16: dict | None = None, int8: dict | None = None, sizes: dict[str, int] | None = None) -> dict[str, Any]:
    rep: dict[str, Any] = {
        "input": source, "precision": precision, "budget": budget,
        "nodes": {"before": sum(ops_before.values()), "after": sum(ops_after.values())},
        "ops_before": ops_before, "ops_after": ops_after,
        "passes": [asdict(r) for r in records],
        "error_vs_fp32": {k: e.to_dict() for k, e in errors.items()}, "error_data": error_data,
        "bytes": sizes or {},
    }
    if fp16 is not None:
        rep["fp16"] = fp16
        rep["fp16_nodes"] = sum(n["dtype"] == "float16" for n in fp16["nodes"])
    if int8 is not None:
        rep["int8"] = int8
        rep["layers_quantized"] = [q["name"] for q in int8.get("quantized", [])]
    return rep


def write(report: dict[str, Any], path: str | os.PathLike) -> None:
    """Atomically (files.atomic_output): a failed write leaves any existing report at `path` as it was."""
    with atomic_output(path) as tmp, open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=float)


def print_summary(report: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"automp optimize · {report['precision']}", title_justify="left")
    for col, just in (("pass", "left"), ("nodes before", "right"), ("nodes after", "right"), ("ms", "right")):
        table.add_column(col, justify=just)
    for r in report["passes"]:
        table.add_row(r["name"], str(r["nodes_before"]), str(r["nodes_after"]), f"{r['ms']:.0f}")
    if "fp16" in report:
        f = report["fp16"]
        table.add_row(f"fp16 ({report['fp16_nodes']} nodes fp16, casts {f['casts'].get('remaining', 0)})",
                      str(report["nodes"]["before"]), str(report["nodes"]["after"]), "")
    if "int8" in report:
        table.add_row(f"int8 ({len(report['layers_quantized'])} layers quantized)", "", str(report["nodes"]["after"]),
                      "")
    console.print(table)
    for name, e in report["error_vs_fp32"].items():
        console.print(f"  {name}: rel err {e['rel_l2']:.2e}, max abs {e['max_abs']:.2e}, cosine {e['cosine']:.6f} "
                      f"({report['error_data']})")
    b = report.get("bytes") or {}
    if b.get("before") and b.get("after"):
        console.print(f"  size: {b['before'] / 1e6:.2f} MB -> {b['after'] / 1e6:.2f} MB")
