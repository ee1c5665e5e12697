"""Gradual magnitude pruning (Zhu & Gupta, "To prune, or not to prune", 2017): sparsity grows along a cubic ramp
while the model trains, so the network adapts to each small cut instead of losing half its weights at once.

    s(t) = s_f * (1 - (1 - (t - t0) / n)^3)   for t0 <= t <= t0 + n,   0 before, s_f after

Fast at first, while many weights are redundant, slow at the end. Masks are recomputed every `every` steps (and
at the last step of the ramp, so the final amount is reached exactly), always on top of the previous masks.

2:4 cannot be ramped within a layer (a layer is 2:4 or it is not), so the ramp runs over layers instead: s(t) is
the fraction of matched layers that are 2:4 at step t, and each update prunes next the layers that lose the
least weight norm to 2:4 at that moment. The weights of a layer pruned late have had the most time to adapt.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from automp.compress.sparse import masks as M
from automp.compress.sparse import pruning as P
from automp.compress.sparse.report import SparsityReport


class SparsitySchedule:
    """Call `step()` after every optimizer.step() (or `attach(optimizer)` once to have it called for you).

    steps: length n of the ramp in optimizer steps; every: steps between mask updates; begin: step t0 at which the
    ramp starts (dense training before it); evaluate(model) -> float, optional: recorded now as "before"."""

    def __init__(self, model: nn.Module, config: P.SparsityConfig, steps: int, every: int = 1, begin: int = 0,
                 evaluate: P.Evaluate | None = None):
        if not isinstance(config, P.SparsityConfig):
            raise TypeError(f"config must be a SparsityConfig, got {type(config).__name__}")
        for name, v, low in (("steps", steps, 1), ("every", every, 1), ("begin", begin, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        if P.is_pruned(model):
            raise ValueError("this model already has sparsity masks: finalize() it before starting a schedule")
        self.model, self.config = model, config
        self.steps, self.every, self.begin = steps, every, begin
        self.t = 0
        self.layers = P.select_layers(model, config)
        before = P.measure(evaluate, model) if evaluate is not None else None
        ones = {n: torch.ones_like(m.weight, dtype=torch.bool) for n, m in self.layers.items()}
        state = P.install(model, config, self.layers, ones, {n: "dense" for n in self.layers})
        if before is not None:
            state.accuracy["before"] = before
        self._update()

    def amount_at(self, t: int) -> float:
        """Target sparsity at step t (for 2:4: the fraction of layers that are 2:4)."""
        final = 1.0 if self.config.pattern == "2:4" else self.config.target
        if t < self.begin:
            return 0.0
        progress = min(1.0, (t - self.begin) / self.steps)
        return final * (1.0 - (1.0 - progress) ** 3)

    @property
    def done(self) -> bool:
        return self.t >= self.begin + self.steps

    def step(self) -> None:
        """Advance one optimizer step: keep the zeros, and update the masks when this step is due."""
        self.t += 1
        since = self.t - self.begin
        if 0 <= since <= self.steps and (since % self.every == 0 or since == self.steps):
            self._update()
        else:
            P.apply_masks(self.model)

    def attach(self, optimizer: torch.optim.Optimizer):
        """Have `optimizer.step()` call `self.step()` after each step; returns the handle (`.remove()` detaches)."""
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step())

    def report(self) -> SparsityReport:
        return P.sparsity_report(self.model)

    def _update(self) -> None:
        state = P._require(self.model, "SparsitySchedule")  # noqa: SLF001 — the schedule is part of the pruner
        keep = {n: ~layer.zero for n, layer in state.layers.items() if n in self.layers}
        amount = self.amount_at(self.t)
        if self.config.pattern == "2:4":
            patterns = {n: state.layers[n].pattern for n in self.layers}
            todo = [n for n, p in patterns.items() if p == "dense"]
            want = math.ceil(amount * len(self.layers) - 1e-9) - (len(self.layers) - len(todo))
            todo.sort(key=lambda n: M.two_four_damage(self.layers[n].weight))
            chosen = {n: self.layers[n] for n in todo[:max(0, want)]}
            keep.update(P.compute_masks(chosen, self.config, keep))
            patterns.update({n: "2:4" for n in chosen})
        else:
            keep = P.compute_masks(self.layers, self.config, keep, amount)
            patterns = {n: "unstructured" if amount > 0 else "dense" for n in self.layers}
        P.install(self.model, self.config, self.layers, keep, patterns)
