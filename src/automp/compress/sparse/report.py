"""What pruning did, per layer, in a form that is saved next to the model and read by people and by CI.

Sparsity is measured (exact zeros in the weight), not the requested amount: what the user ships is what counts.
Accuracies are whatever the user's `evaluate(model) -> float` returns, recorded at three moments: before pruning,
right after it, and at finalize() (after fine-tuning, when there was any).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from automp.files import atomic_output


@dataclass
class LayerReport:
    name: str
    kind: str  # module class, e.g. "Linear"
    shape: list[int]  # weight shape
    pattern: str  # "2:4" | "unstructured" | "dense" (matched by a schedule, not pruned yet)
    sparsity: float  # fraction of exact zeros in the weight
    zeros: int
    numel: int


@dataclass
class SparsityReport:
    pattern: str
    amount: float  # the requested fraction (0.5 for 2:4)
    scope: str  # "layer" | "global"
    layers: list[LayerReport] = field(default_factory=list)
    accuracy: dict[str, float] = field(default_factory=dict)  # before / after_prune / after_finetune
    notes: list[str] = field(default_factory=list)

    @property
    def sparsity(self) -> float:
        """Zeros over weights, across the pruned layers."""
        total = sum(layer.numel for layer in self.layers)
        return sum(layer.zeros for layer in self.layers) / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(asdict(self), sparsity=self.sparsity)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def save(self, path: str | os.PathLike) -> None:
        with atomic_output(path) as tmp, open(tmp, "w") as f:
            f.write(self.to_json())

    def table(self) -> str:
        """A markdown table: one row per layer, then the accuracies."""
        lines = ["| layer | shape | pattern | sparsity |", "|---|---|---|---:|"]
        lines += [f"| {r.name} | {'x'.join(map(str, r.shape))} | {r.pattern} | {r.sparsity:.1%} |" for r in self.layers]
        lines.append(f"| **total** | | {self.pattern} | {self.sparsity:.1%} |")
        if self.accuracy:
            lines += ["", ", ".join(f"{k}: {v:.4g}" for k, v in self.accuracy.items())]
        return "\n".join(lines) + "\n"
