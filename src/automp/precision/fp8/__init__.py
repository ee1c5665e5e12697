"""FP8 training, the whole of it in one place, entered by one call: `convert`.

- layers: the FP8 linear layer (one autograd function over torch._scaled_mm, switched by class swap);
- table: the device's measured FP8 and bf16 GEMM times, per shape and recipe (cached per device);
- choice: which layers run FP8 (predicted gain from the table, error on the real batch, the output layer's rule);
- gather: under FSDP2, the FP8 layers' weights all-gathered in float8;
- guard: the loss watch that takes a diverging FP8 run back to bf16 and keeps non-finite steps off the weights.

The runtime (automp.runtime.fp8_layers) decides *when* (a root's first call, the trial, the switch back); this package
decides *what*, and holds no state of a run beyond what `convert` returns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from automp.precision.fp8 import choice, gather, guard, layers, table

__all__ = ["Conversion", "convert", "choice", "gather", "guard", "layers", "table"]

TableLoader = Callable[..., table.Fp8Table]  # table.load_or_measure's signature
AUTO = "auto"  # convert's recipe: each layer its own (choice.merge)


@dataclass
class Conversion:
    """What `convert` did to one module: every linear layer's choice, the layers made FP8-capable, and their FSDP2
    all-gather (None where FSDP2 shards none of them). `table_error`: why the device's times could not be had."""

    recipe: str
    choices: dict[str, choice.LayerChoice]
    installed: dict[str, nn.Module] = field(default_factory=dict)
    all_gather: gather.Fp8Gather | None = None
    table_error: str | None = None

    @property
    def chosen(self) -> tuple[str, ...]:
        return tuple(self.installed)

    @property
    def saving_ms(self) -> float | None:
        """Milliseconds per step the installed FP8 layers are predicted to save over bf16 (choice.saving_ms summed);
        None where none is installed or one has no prediction."""
        savings = [self.choices[n].saving_ms for n in self.installed]
        return None if not savings or None in savings else round(sum(savings), 3)

    def as_dict(self) -> dict[str, Any]:
        """The report's FP8 entry for this module."""
        out: dict[str, Any] = {"recipe": self.recipe, "fp8_layers": len(self.installed),
                               "layers_seen": len(self.choices), "rules": choice.summary(self.choices),
                               "layers": {n: c.as_dict() for n, c in self.choices.items()},
                               # the lines each layer was judged against (automp report --plot draws them)
                               "min_gain": choice.MIN_GAIN, "max_error": choice.MAX_ERROR}
        if self.all_gather is not None:
            out["all_gather"] = {"rules": self.all_gather.summary(), "why": dict(self.all_gather.why)}
        return out

    def undo(self) -> None:
        """Back to the module as it was: the all-gather closed, every installed layer its own class again."""
        if self.all_gather is not None:
            self.all_gather.close()
            self.all_gather = None
        for module in self.installed.values():
            layers.uninstall(module)
        self.installed.clear()


def convert(module: nn.Module, run: Callable[[], Any], *, device: torch.device, recipe: str = "tensorwise",
            low: torch.dtype = torch.bfloat16, cache_dir: str | None = None,
            table_loader: TableLoader = table.load_or_measure, keep: tuple[str, ...] = (), output_fp8: bool = False,
            all_gather: bool = True, agree: Callable[[dict], dict] | None = None, siblings: bool = False
            ) -> Conversion:
    """Choose and install the FP8 layers of `module`; `run()` calls it once on a real batch (the probe).

    recipe: one of layers.RECIPES for every FP8 layer, or AUTO: each layer the recipe predicted to gain most where it
    stays accurate (choice.merge), probed and timed under every recipe (the device table measures both once).
    siblings: the compiled paths join sibling layers into one GEMM (AutoMPConfig.fuse_siblings), so sibling groups
    are judged at their joined shape too (choice.group_choices).

    agree: makes every rank hold the same choices (rank 0's) before anything is installed; ranks that chose apart
    would run different graphs around the same collectives. Given, the module is one all ranks call in lockstep, and
    FSDP2-sharded FP8 layers get the FP8 all-gather (`all_gather=False`: reported, left to FSDP2's own)."""
    recipes = layers.RECIPES if recipe == AUTO else (recipe,)
    linear = choice.linear_layers(module)
    probed_by_recipe = choice.probes(module, run, recipes, low)
    first = probed_by_recipe[recipes[0]]  # shapes and siblings are every recipe's
    groups = first.siblings if siblings else []
    shapes = [s for s in [*first.shapes.values(), *(choice.group_shape(first, g) for g in groups)]
              if layers.fits(s.m, s.k, s.n)]
    by_recipe: dict[str, dict[str, choice.LayerChoice]] = {}
    table_error = None
    for r, probed in probed_by_recipe.items():
        times: table.Fp8Table | None = None
        if shapes:
            try:
                times = table_loader(device, shapes, r, cache_dir)
            except (RuntimeError, ValueError) as e:
                table_error = table_error or str(e)
        timing = (lambda s, r=r, t=times: t.get(s, r)) if times is not None else (lambda s: None)
        by_recipe[r] = choice.choose(probed, list(linear), timing, keep=keep, output_fp8=output_fp8, recipe=r,
                                     siblings=siblings)
    choices = choice.merge(by_recipe, groups) if len(recipes) > 1 else by_recipe[recipe]
    if agree is not None:
        choices = agree(choices)
    result = Conversion(recipe, choices, table_error=table_error)
    for name, c in choices.items():
        if c.dtype == "fp8":
            layers.install(linear[name], c.recipe or recipe)
            result.installed[name] = linear[name]
    if agree is not None and result.installed:
        sharded = gather.Fp8Gather(module, dict(result.installed), {n: choices[n].recipe or recipe
                                                                    for n in result.installed}, enabled=all_gather)
        if sharded.rules:  # FSDP2 shards some of them
            result.all_gather = sharded
    return result
