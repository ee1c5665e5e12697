"""Accuracy-driven fallback: keep the layers that hurt most in float until the error budget holds.

The budget is a float: the largest tolerated relative output error ||y_int8 - y_fp32|| / ||y_fp32|| (L2 over
the evaluation samples, worst model output). A metric drop works the same way if the caller's `evaluate`
returns the drop instead - this module only needs "smaller is better, 0 = float model".

Sensitivity of a layer (method="isolate", default): the error with *only* that layer quantized - cheap to read
and independent of the other layers. method="drop": the error reduction from un-quantizing only that layer,
which accounts for interactions but needs a full-model baseline. Either way the most sensitive layers go back to
float one by one, re-measuring the whole model after each, until the budget holds (all-float always does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class FallbackConfig:
    method: str = "isolate"   # isolate | drop (see module docstring)

    def __post_init__(self) -> None:
        if self.method not in ("isolate", "drop"):
            raise ValueError(f"fallback method must be 'isolate' or 'drop', got {self.method!r}")


@dataclass
class FallbackResult:
    float_layers: list[str]          # layers kept in float, most sensitive first
    sensitivity: dict[str, float]    # every candidate layer's sensitivity
    error: float                     # model error with float_layers in float
    steps: list[list]                # [number of float layers, error] after each step, starting at 0


def check_budget(budget: float | None, owner: str) -> None:
    if budget is not None and (not isinstance(budget, (int, float)) or not budget > 0):
        raise ValueError(f"{owner}: budget must be a positive float (max relative output error), got {budget!r}")


def sensitivities(evaluate: Callable[[set[str]], float], layers: list[str], method: str,
                  full_error: float) -> dict[str, float]:
    """evaluate(quantized layer names) -> error."""
    every = set(layers)
    if method == "isolate":
        return {name: evaluate({name}) for name in layers}
    return {name: full_error - evaluate(every - {name}) for name in layers}


def fit_budget(evaluate: Callable[[set[str]], float], layers: list[str], budget: float,
               config: FallbackConfig = FallbackConfig(), full_error: float | None = None) -> FallbackResult:
    check_budget(budget, "fit_budget")
    quantized = set(layers)
    error = evaluate(quantized) if full_error is None else full_error
    steps = [[0, error]]
    if error <= budget:
        return FallbackResult([], {}, error, steps)
    sens = sensitivities(evaluate, layers, config.method, error)
    kept: list[str] = []
    for name in sorted(layers, key=lambda n: -sens[n]):
        kept.append(name)
        quantized.discard(name)
        error = evaluate(quantized) if quantized else 0.0
        steps.append([len(kept), error])
        if error <= budget:
            break
    return FallbackResult(kept, sens, error, steps)
