"""Which linear layers of a model run FP8: predicted from measured GEMM times, kept only where FP8 stays accurate.

FP8 GEMMs run up to ~2x bf16's on large shapes and lose on small ones, where the amax and cast passes cost more than
the faster GEMM saves; where the line falls depends on the device, the shape and the recipe. So each layer's three
training GEMMs at its real shape (tokens x in x out, seen on the script's first batch) are looked up in the device's
measured table (automp.precision.fp8.table), and a layer is predicted to pay where FP8 plus its casts comes out at
least MIN_GAIN faster than bf16. The whole model is then timed both ways by the runtime's trial: a prediction that
does not hold on the real step is caught there.

Accuracy: on the same first batch, each candidate layer's FP8 output is compared with its bf16 output on the input
it really receives (relative error ‖y_fp8 − y_bf16‖ / ‖y_bf16‖). FP8 e4m3 with one scale per tensor errs by about
0.04 on Gaussian data; an activation with outliers (one huge channel) crushes the rest of the tensor into FP8's few
subnormal steps and errs far more. A layer above MAX_ERROR stays bf16.

The output layer: the last linear layer the forward calls (an LM head, a classifier) stays bf16 unless asked for
(`fp8_output`), as torchao's default filter and Transformer Engine's recipes leave it. Its gradient is the loss's
own, the softmax over a vocabulary: e5m2's two mantissa bits round the small probabilities that carry most of the
learning signal, and with tied embeddings the same error reaches the embedding. Its forward error measures like any
other layer's (~0.04), so the accuracy check cannot see it; a training run did (BENCHMARKS.md, "FP8 loss parity").

A choice is data (`LayerChoice`) keyed by rule, for reports and tests.
"""
from __future__ import annotations

import fnmatch
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn as nn

from automp.precision.fp8 import layers as fp8
from automp.precision.fp8.table import Fp8Timing, GemmShape, bucket

MIN_GAIN = 1.10  # predicted speedup of a layer's three GEMMs, casts included, before it is offered FP8
MAX_ERROR = 0.10  # relative output error against bf16 on the real batch (a few times what Gaussian data gives)
PROBE_ROWS = 2048  # rows of a layer's input the accuracy check uses: enough for a stable norm, bounded memory

# rules
FP8 = "fp8-predicted-gain"
NO_GAIN = "bf16-no-predicted-gain"
SHAPE = "bf16-shape-unsupported"  # a dimension not a multiple of 16: torch._scaled_mm cannot take it
ACCURACY = "bf16-accuracy-guard"
NOT_CALLED = "bf16-not-called"  # the layer did not run on the first batch: nothing to measure it on
NOT_MEASURED = "bf16-not-measured"  # the device table has no time for its shape
KEPT = "bf16-kept"  # named by the configuration's fp8_keep: bf16 whatever its measurements
FP8_GROUP = "fp8-group-gain"  # one of sibling layers run as one FP8 GEMM, predicted to gain as a group
OUTPUT = "bf16-output-layer"  # the last linear layer the forward calls (an LM head): bf16 unless fp8_output


@dataclass(frozen=True)
class LayerChoice:
    dtype: str  # "fp8" or "bf16"
    predicted_gain: float | None
    measured_error: float | None
    rule: str
    shape: tuple[int, int, int] | None = None  # (tokens, in, out) on the first batch
    recipe: str | None = None  # the scaling whose gain and error these are (the one it runs, where dtype is fp8)
    # milliseconds per step FP8 is predicted to save on this layer (its share of a sibling group's): `saving_ms`
    saving_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "predicted_gain": self.predicted_gain, "measured_error": self.measured_error,
                "rule": self.rule, "shape": list(self.shape) if self.shape else None, "recipe": self.recipe,
                "predicted_saving_ms": self.saving_ms}


def saving_ms(entry: Fp8Timing, shape: GemmShape, members: int = 1) -> float:
    """What FP8 is predicted to save per step on one of `members` layers that share the GEMM of `shape`: the table's
    bf16 time less its FP8 time and casts, measured at the shape's bucket and scaled down to the shape's own FLOPs
    (a bucket is up to a quarter larger along each dimension). The runtime's trial adds these up to forecast the
    whole step in bf16 (automp.runtime.trial, TrialConfig.twin_margin)."""
    b = bucket(shape)
    scale = (shape.m * shape.k * shape.n) / (b.m * b.k * b.n)
    return round(scale * (entry.bf16_ms - entry.fp8_gemm_ms - entry.cast_ms) / members, 4)


@dataclass
class Probe:
    """What one forward of the real batch showed: each linear layer's GEMM shape and FP8 error, and the siblings:
    runs of layers called one after another on the same input tensor (query, key and value; gate and up)."""

    shapes: dict[str, GemmShape]
    errors: dict[str, float]
    siblings: list[tuple[str, ...]] = field(default_factory=list)
    group_errors: dict[tuple[str, ...], float] = field(default_factory=dict)  # joined, one weight scale (group_error)


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if fp8.linear_like(m)}


def probe(model: nn.Module, run: Callable[[], Any], recipe: str, low: torch.dtype = torch.bfloat16) -> Probe:
    """`probes` under one recipe."""
    return probes(model, run, (recipe,), low)[recipe]


def probes(model: nn.Module, run: Callable[[], Any], recipes: tuple[str, ...], low: torch.dtype = torch.bfloat16
           ) -> dict[str, Probe]:
    """Run `run()` (one forward of `model` on the script's batch) under no_grad and autocast, in eval mode so that it
    leaves no trace (no BatchNorm statistics, no dropout draws from the script's RNG), recording each linear layer's
    shape and, under each of `recipes`, its FP8 error on the input it receives: one forward for every recipe (the
    shapes and siblings are the same). Training flags are restored after."""
    layers = linear_layers(model)
    shapes: dict[str, GemmShape] = {}
    errors: dict[str, dict[str, float]] = {r: {} for r in recipes}
    runs: list[list[str]] = []
    last: list[Any] = [None]  # the input of the layer called last, held weakly (a dead tensor's id can come back)
    group_errors: dict[str, dict[tuple[str, ...], float]] = {r: {} for r in recipes}
    rows: list[Any] = [None]  # the current run's input rows, until the run ends and its joined error is measured

    def close_run() -> None:
        run = tuple(runs[-1]) if runs else ()
        if len(run) > 1 and rows[0] is not None and all(name in errors[recipes[0]] for name in run):
            for r in recipes:
                group_errors[r][run] = fp8.group_error([layers[n] for n in run], rows[0], r)
        rows[0] = None

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else next(iter(kwargs.values()))
            if name in shapes or not torch.is_tensor(x) or x.dim() < 2:
                return
            x2 = x.reshape(-1, x.shape[-1])[:PROBE_ROWS]
            if last[0] is not None and last[0]() is x:
                runs[-1].append(name)
            else:
                close_run()
                runs.append([name])
                rows[0] = x2
            last[0] = weakref.ref(x)
            w = fp8.weight_nk(module)
            shapes[name] = GemmShape(x.numel() // x.shape[-1], w.shape[1], w.shape[0])
            if fp8.fits(shapes[name].m, shapes[name].k, shapes[name].n):  # PROBE_ROWS keeps rows a multiple of 16
                for r in recipes:
                    errors[r][name] = fp8.relative_error(module, x2, r)
        return hook

    handles = [m.register_forward_pre_hook(hook_for(n), with_kwargs=True) for n, m in layers.items()]
    modes = {m: m.training for m in model.modules()}
    device = next((p.device.type for p in model.parameters()), "cpu")
    try:
        model.eval()
        with torch.no_grad(), torch.autocast(device, dtype=low), fp8.active(False):
            run()
            close_run()
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    siblings = [tuple(r) for r in runs if len(r) > 1]
    return {r: Probe(shapes, errors[r], siblings, group_errors[r]) for r in recipes}


def kept(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a layer name matches one of fp8_keep's patterns, at its full name or below a wrapper's prefix."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, "*." + p) for p in patterns)


def output_layer(probe: Probe) -> str | None:
    """The last linear layer the probe's forward called (the probe records shapes in call order)."""
    return next(reversed(probe.shapes), None)


def choose(probe: Probe, layers: list[str], timing: Callable[[GemmShape], Fp8Timing | None],
           min_gain: float = MIN_GAIN, max_error: float = MAX_ERROR, keep: tuple[str, ...] = (),
           output_fp8: bool = False, recipe: str | None = None, siblings: bool = False) -> dict[str, LayerChoice]:
    """Each layer's choice, in the order given. `timing`: the device table's entry for a shape (None: unmeasured);
    `keep`: patterns of layers kept bf16 (their measurements still reported); `output_fp8`: the output layer may go
    FP8 (else it is kept bf16 under OUTPUT, its measurements reported); `recipe`: the one the probe and the timings
    are of, named in every choice that has a measurement; `siblings`: the probe's sibling layers run as one GEMM
    (automp.precision.siblings), so they are judged together (`group_choices`)."""
    choices = _choose(probe, layers, timing, min_gain, max_error, keep, output_fp8)
    if siblings:
        choices.update(group_choices(probe, choices, timing, min_gain, max_error))
    return {name: replace(c, recipe=recipe) if c.shape is not None else c for name, c in choices.items()}


def group_shape(probe: Probe, group: tuple[str, ...]) -> GemmShape:
    """The GEMM of a sibling group joined into one: its rows and input width, its layers' output widths summed."""
    first = probe.shapes[group[0]]
    return GemmShape(first.m, first.k, sum(probe.shapes[n].n for n in group))


def group_choices(probe: Probe, choices: dict[str, LayerChoice], timing: Callable[[GemmShape], Fp8Timing | None],
                  min_gain: float = MIN_GAIN, max_error: float = MAX_ERROR) -> dict[str, LayerChoice]:
    """Sibling groups that run FP8 together (rule FP8_GROUP): where the group's joined GEMM is predicted to gain
    MIN_GAIN, every member is accurate alone and joined (its error under the group's one weight scale, the probe's
    group_errors, is the one reported), and no member is held bf16 for another reason (kept, the output layer, its
    shape). A 512-wide key projection that loses alone can gain as a third of the query-key-value GEMM. Groups that
    do not qualify keep their members' own choices."""
    out: dict[str, LayerChoice] = {}
    for group in probe.siblings:
        members = [choices.get(n) for n in group]
        joined = probe.group_errors.get(group)
        if joined is None or joined > max_error or any(
                c is None or c.rule not in (FP8, NO_GAIN) or c.measured_error is None or c.measured_error > max_error
                for c in members):
            continue
        entry = timing(group_shape(probe, group))
        gain = round(entry.predicted_gain, 3) if entry is not None else None
        if gain is None or gain < min_gain:
            continue
        saving = saving_ms(entry, group_shape(probe, group), len(group))
        for name, c in zip(group, members):
            out[name] = replace(c, dtype="fp8", predicted_gain=gain, measured_error=round(joined, 4), rule=FP8_GROUP,
                                saving_ms=saving)
    return out


def _choose(probe: Probe, layers: list[str], timing: Callable[[GemmShape], Fp8Timing | None], min_gain: float,
            max_error: float, keep: tuple[str, ...], output_fp8: bool) -> dict[str, LayerChoice]:
    choices: dict[str, LayerChoice] = {}
    last = None if output_fp8 else output_layer(probe)
    for name in layers:
        shape = probe.shapes.get(name)
        if shape is None:
            choices[name] = LayerChoice("bf16", None, None, KEPT if kept(name, keep) else NOT_CALLED)
            continue
        dims = (shape.m, shape.k, shape.n)
        error = probe.errors.get(name)
        if kept(name, keep) or name == last:
            entry = timing(shape) if fp8.fits(*dims) else None
            gain = round(entry.predicted_gain, 3) if entry is not None else None
            choices[name] = LayerChoice("bf16", gain, error, KEPT if kept(name, keep) else OUTPUT, dims,
                                        saving_ms=saving_ms(entry, shape) if entry is not None else None)
            continue
        if not fp8.fits(*dims):
            choices[name] = LayerChoice("bf16", None, error, SHAPE, dims)
            continue
        entry = timing(shape)
        if entry is None:
            choices[name] = LayerChoice("bf16", None, error, NOT_MEASURED, dims)
            continue
        gain = round(entry.predicted_gain, 3)
        if gain < min_gain:
            rule = NO_GAIN
        elif error is None or error > max_error:
            rule = ACCURACY
        else:
            rule = FP8
        choices[name] = LayerChoice("fp8" if rule == FP8 else "bf16", gain, error, rule, dims,
                                    saving_ms=saving_ms(entry, shape))
    return choices


def merge(by_recipe: dict[str, dict[str, LayerChoice]], groups: list[tuple[str, ...]] = ()
          ) -> dict[str, LayerChoice]:
    """Each layer's choice across recipes (fp8_recipe="auto"), from `choose` run once per recipe on the same layers:
    among the recipes under which the layer goes FP8, the one with the highest predicted gain (rowwise's extra scale
    passes cost time, and its finer scales keep a layer with outlier channels accurate where tensorwise is not);
    where none does, the first recipe's bf16 choice and rule. A sibling group chosen as one (FP8_GROUP) takes one
    recipe for all its members, the one its joined GEMM gains most in: only layers of one recipe are joined. Each
    choice names its recipe."""
    first, *_ = by_recipe
    merged: dict[str, LayerChoice] = {}
    for name in by_recipe[first]:
        fp8 = [c for c in (choices[name] for choices in by_recipe.values()) if c.dtype == "fp8"]
        merged[name] = max(fp8, key=lambda c: c.predicted_gain or 0.0) if fp8 else by_recipe[first][name]
    for group in groups:
        joined = [choices for choices in by_recipe.values() if all(choices[n].rule == FP8_GROUP for n in group)]
        if joined:
            best = max(joined, key=lambda choices: choices[group[0]].predicted_gain or 0.0)
            merged.update({n: best[n] for n in group})
    return merged


def summary(choices: dict[str, LayerChoice]) -> dict[str, int]:
    """How many layers each rule decided: the report's one-line view."""
    counts: dict[str, int] = {}
    for c in choices.values():
        counts[c.rule] = counts.get(c.rule, 0) + 1
    return counts
