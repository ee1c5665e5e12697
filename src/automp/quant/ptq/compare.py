"""How far a model's outputs are from a reference's, measured one way everywhere.

Every pass and every precision change (ONNX passes, fp16, QDQ int8, the torch PTQ pipeline, protection) is judged the
same way: same inputs through both models, then the normalised error and cosine similarity per output, so "did the
optimization change the answer" has one meaning. The error budgets of PTQ are in these terms (relative L2, worst
output).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class Error:
    max_abs: float
    rel_l2: float  # ||out - ref|| / ||ref||
    cosine: float  # mean over batch rows of cos(out_row, ref_row)
    nonfinite: int

    def to_dict(self) -> dict:
        return asdict(self)


def compare(out: np.ndarray, ref: np.ndarray) -> Error:
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: output {out.shape} vs reference {ref.shape}")
    o, r = out.astype(np.float64), ref.astype(np.float64)
    bad = int((~np.isfinite(o)).sum())
    diff = np.where(np.isfinite(o), o - r, np.inf)
    ref_norm = np.linalg.norm(r)
    rel = float(np.linalg.norm(diff) / ref_norm) if ref_norm > 0 else float(np.linalg.norm(diff))
    o2, r2 = o.reshape(o.shape[0] if o.ndim > 1 else 1, -1), r.reshape(r.shape[0] if r.ndim > 1 else 1, -1)
    denom = np.linalg.norm(o2, axis=1) * np.linalg.norm(r2, axis=1)
    cos = np.where(denom > 0, (o2 * r2).sum(1) / np.where(denom > 0, denom, 1), 1.0)
    return Error(max_abs=float(np.abs(diff).max()) if diff.size else 0.0, rel_l2=rel,
                 cosine=float(np.nanmean(cos)) if bad == 0 else float("nan"), nonfinite=bad)


def compare_all(outs: dict[str, np.ndarray], refs: dict[str, np.ndarray]) -> dict[str, Error]:
    missing = set(refs) - set(outs)
    if missing:
        raise ValueError(f"outputs missing from the optimized model: {sorted(missing)}")
    return {k: compare(outs[k], refs[k]) for k in refs}
