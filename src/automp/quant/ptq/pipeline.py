"""Post-training quantization of a torch module: every nn.Linear on the int8/int4 kernels, the rest in fp16/bf16.

    model = automp.quant.quantize(module, W8A8Config(calib=[batch, ...], budget=0.02))   # what runs this
    model.quant_report                                                                # per-layer decisions, error

Steps, all under no_grad on the module's device:
1. calibration batches run through the FP32 module: reference outputs (the error metric's baseline), per-channel
   activation maxima for SmoothQuant, ranges for static int8 (automp.quant.observers), and each Linear's
   input, on which that Linear alone is quantized: its own relative output error, reported as its sensitivity.
2. a deep copy goes to fp16 (LayerNorm, softmax, GELU run in fp16 as torch does them) and each Linear is swapped
   for its quantized module, built from the FP32 weight by automp.quant's handlers.
3. with a budget, the model's error vs FP32 (automp.quant.ptq.compare: relative L2, worst output) is measured;
   while it is over the budget the most sensitive quantized layer goes back to fp16 (rule ERROR_BUDGET). "Most
   sensitive" is by default automp.quant.fallback's: the model error with only that layer quantized. The
   per-layer error of step 1 is the cheaper option, but a poor proxy: on all-MiniLM-L6-v2 (int8, budget 0.02) it
   needed 21 of 37 layers back in fp16 where the model-level ranking needed 8, because a layer's own error says
   little about how much the output depends on it.
4. the result sits behind QuantizedModel (float32 in, float32 out), with its QuantReport as `quant_report`; it is
   not compiled (automp.deploy.quantized compiles it with CUDA graphs and times it).

The FP32 module is not modified (its train/eval mode is restored): it stays the reference the result was measured
against. Without calibration data (`convert` called directly, as automp.deploy.quantized does) the same layers are
chosen and built, with dynamic int8 activations, and no error is measured.
"""
from __future__ import annotations

import copy
import fnmatch
import math
from dataclasses import replace
from typing import Callable

import torch
import torch.nn as nn

from automp.quant.api import FilterFn, W8A8Config, WeightOnlyConfig, check_ptq, quantize_layer, register_model_handler
from automp.quant.archs import is_causal_lm
from automp.quant.fallback import FallbackConfig, fit_budget
from automp.quant.int8 import int8_static_qparams, nbytes, smooth_factors, weight_group
from automp.quant.names import SHORT
from automp.quant.observers import activation_qparams, make_observer
from automp.quant.ptq import boundary, shared
from automp.quant.ptq.compare import Error, compare_all
from automp.quant.ptq.report import LayerDecision, QuantReport, Rule

PTQConfig = W8A8Config | WeightOnlyConfig


def precision_of(config: PTQConfig) -> str:
    """The report's name of what `config` builds: "int8" (W8A8), "int8-weight" or "int4-weight"."""
    return "int8" if isinstance(config, W8A8Config) else f"int{config.bits}-weight"


def _device(module: nn.Module) -> torch.device:
    devices = {p.device for p in list(module.parameters()) + list(module.buffers())}
    if not devices:
        raise ValueError("the module has no parameters: nothing to quantize")
    if len(devices) > 1:
        raise ValueError(f"the module's tensors are on several devices {sorted(map(str, devices))}; move it to one")
    dev = devices.pop()
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"the module is on {dev}; the automp kernels run on CUDA (Triton) or CPU (Triton "
                         "interpreter under TRITON_INTERPRET=1, else their torch reference)")
    return dev


def _decide(module: nn.Module, precision: str, config: PTQConfig) -> dict[str, tuple[nn.Linear, Rule | None]]:
    """Every Linear (first name of each instance) and the rule keeping it in float, None if it can be quantized."""
    parents = dict(module.named_modules())
    out = {}
    for name, m in module.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        parent = parents[name.rpartition(".")[0]] if name else None
        if isinstance(parent, nn.MultiheadAttention):
            rule = Rule.WEIGHT_READ_BY_PARENT
        elif any(fnmatch.fnmatchcase(name, p) for p in config.exclude):
            rule = Rule.EXCLUDED
        elif precision == "int4-weight" and weight_group(m.in_features, config.group_size) is None:
            rule = Rule.NO_INT4_GROUP
        else:
            rule = None
        out[name] = (m, rule)
    if not out:
        raise ValueError(f"the module ({type(module).__name__}) has no nn.Linear layer to quantize")
    return out


def _quantized_linear(linear: nn.Linear, precision: str, config: PTQConfig,
                      act: tuple[float, int] | None, smooth: torch.Tensor | None) -> nn.Module:
    """The layer automp.quant's handler builds for `precision` (int8 groups: the largest of 128/64/32 dividing K,
    else per channel)."""
    if precision == "int8":
        scheme = W8A8Config(static=None if act is None else {"": act}, smooth=None if smooth is None else {"": smooth})
    else:
        scheme = WeightOnlyConfig(config.bits, weight_group(linear.in_features, config.group_size), config.dtype)
    return quantize_layer(linear, scheme)


SMOOTH_GRID = (0.5, 0.65, 0.8, 0.9)  # SmoothQuant alphas smooth_alpha="auto" measures


def _reference(module: nn.Module, calls: list[boundary.Call]) -> list[dict[str, torch.Tensor]]:
    """The FP32 outputs (kept on the CPU). Run first and without hooks: a batch that does not fit the model fails
    here, and is named as the problem."""
    outs = []
    for i, call in enumerate(calls):
        out = boundary.float_outputs(boundary.run_checked(module, call, i))
        outs.append({k: v.float().cpu() for k, v in out.items()})
    return outs


def _input_absmax(module: nn.Module, names: list[str], calls: list[boundary.Call]) -> dict[str, torch.Tensor]:
    """Each layer's largest |x| per input channel over the calibration batches (what SmoothQuant's factors use)."""
    absmax: dict[str, torch.Tensor] = {}

    def hook(name: str, x: torch.Tensor, _: torch.Tensor) -> None:
        m = x.detach().reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        absmax[name] = m if name not in absmax else torch.maximum(absmax[name], m)
    boundary.hooked_pass(module, names, hook, calls)
    return absmax


def _static_ranges(module: nn.Module, names: list[str], calls: list[boundary.Call], config: W8A8Config,
                   smooth: dict[str, torch.Tensor]) -> dict[str, tuple[float, int]]:
    """Per-tensor int8 ranges by config.observer, on the activations as the layer quantizes them (smoothed)."""
    observers = {n: make_observer(copy.deepcopy(config.observer)) for n in names}

    def hook(name: str, x: torch.Tensor, _: torch.Tensor) -> None:
        x = x.detach().float()
        if name in smooth:
            x = x / smooth[name]
        observers[name].update(x.cpu().numpy())
    boundary.hooked_pass(module, names, hook, calls)
    out = {}
    for n, obs in observers.items():
        scale, zero = activation_qparams(obs)  # one-signed data: asymmetric, all 256 levels on the used side
        out[n] = int8_static_qparams(scale, zero, obs.config.dtype)
    return out


def _sensitivities(module: nn.Module, qmods: dict[str, nn.Module], calls: list[boundary.Call]) -> dict[str, float]:
    """Each layer quantized alone on the FP32 model's own activations: ||Q(x) - L(x)|| / ||L(x)|| over all batches."""
    sq = {n: [0.0, 0.0] for n in qmods}

    def hook(name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        ref = out.float()
        sq[name][0] += float((qmods[name](x).float() - ref).square().sum())
        sq[name][1] += float(ref.square().sum())
    boundary.hooked_pass(module, list(qmods), hook, calls)
    return {n: math.sqrt(e / r) if r > 0 else math.sqrt(e) for n, (e, r) in sq.items()}


class _Swapper:
    """Puts each candidate layer's quantized or float module in place (under every name the layer has) and measures
    the model's error vs the FP32 reference for a set of quantized layers (cached: the search revisits sets)."""

    def __init__(self, model: boundary.QuantizedModel, qmods: dict[str, nn.Module], aliases: dict[str, list[str]],
                 calls: list[boundary.Call], ref: dict) -> None:
        self.model, self.qmods, self.aliases, self.calls, self.ref = model, qmods, aliases, calls, ref
        self.fmods = {n: model.get_submodule(_path(n)) for n in qmods}
        self.errors: dict[frozenset, dict[str, Error]] = {}

    def set_layers(self, qmods: dict[str, nn.Module]) -> None:
        """Measure with these quantized modules from now on (other SmoothQuant factors, same layers)."""
        assert set(qmods) == set(self.qmods)
        self.qmods = qmods
        self.errors.clear()

    def use(self, quantized: set[str]) -> None:
        for name in self.qmods:
            mod = self.qmods[name] if name in quantized else self.fmods[name]
            for alias in self.aliases[name]:
                parent, _, child = _path(alias).rpartition(".")
                setattr(self.model.get_submodule(parent), child, mod)

    def errors_of(self, quantized: set[str]) -> dict[str, Error]:
        key = frozenset(quantized)
        if key not in self.errors:
            self.use(quantized)
            got = [boundary.float_outputs(self.model(*a, **k)) for a, k in self.calls]
            self.errors[key] = compare_all(boundary.stack_outputs(got), self.ref)
        return self.errors[key]

    def error(self, quantized: set[str]) -> float:
        return max(e.rel_l2 for e in self.errors_of(quantized).values())


def _path(name: str) -> str:
    return f"inner.{name}" if name else "inner"


def _aliases(module: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        out.setdefault(id(m), []).append(name)
    return out


def _fit_budget(swap: _Swapper, quantized: set[str], sens: dict[str, float], config: PTQConfig,
                steps: list[list]) -> tuple[list[str], dict[str, float]]:
    """Put layers back in float, most sensitive first, until the budget holds; returns them (in that order) and the
    model-level sensitivities when config.sensitivity asked automp.quant.fallback to measure them.

    "layer" orders by the one-pass per-layer error `sens`; "isolate" / "drop" hand the search to
    automp.quant.fallback.fit_budget, which measures each layer's effect on the model output (one model run per
    layer: slower, but it sees which layers the output actually depends on)."""
    budget = config.budget
    floor = swap.error(set())
    if floor > budget:
        raise ValueError(f"budget {budget} is below the error of the model with every Linear in float ({floor:.3g}): "
                         "no set of quantized layers can meet it; raise the budget")
    if config.sensitivity != "layer":
        res = fit_budget(swap.error, sorted(quantized), budget, FallbackConfig(config.sensitivity),
                         full_error=steps[0][1])
        quantized.difference_update(res.float_layers)
        steps[:] = res.steps
        return res.float_layers, res.sensitivity
    kept: list[str] = []
    for name in sorted(quantized, key=lambda n: -sens[n]):
        if steps[-1][1] <= budget:
            break
        kept.append(name)
        quantized.discard(name)
        steps.append([len(kept), swap.error(quantized)])
    return kept, {}


def takes(model: nn.Module, config: PTQConfig) -> bool:
    """Whether automp.quant.quantize hands `model` to this pipeline: a config with calib, on any module but a causal
    LM for a WeightOnlyConfig (automp.quant.causal_lm takes those, and AWQ's settings are only theirs)."""
    if config.calib is None:
        return False
    return isinstance(config, W8A8Config) or not (config.whole_model or is_causal_lm(model))


@register_model_handler(W8A8Config, takes)
@register_model_handler(WeightOnlyConfig, takes)
def quantize_ptq(model: nn.Module, config: PTQConfig, filter_fn: FilterFn | None = None) -> nn.Module:
    """automp.quant.quantize's model handler for a config with calib: `convert`. The layers kept in float are named
    by the config's exclude patterns (the report gives each its rule), not by a filter_fn."""
    if filter_fn is not None:
        raise ValueError(f"automp.quant.quantize: with calib, {type(config).__name__} names the layers kept in "
                         "float by its exclude patterns; it takes no filter_fn")
    return convert(model, config)


def convert(module: nn.Module, config: PTQConfig) -> boundary.QuantizedModel:
    """A new model: `module` quantized as the module docstring says, float32 in and out, its QuantReport attached as
    `quant_report`.

    config.calib: batches, each what one call of `module` takes (tensor / tuple of args / dict of kwargs). Needed for
    static int8 and for a budget; without it the error vs FP32 is not measured."""
    precision = precision_of(config)
    int8 = precision == "int8"
    if int8 and (config.static is not None or config.smooth is not None):
        raise ValueError("W8A8Config: static and smooth are per-layer values for quantize's layer swap; the PTQ "
                         "pipeline calibrates its own")
    if not int8:
        check_ptq("WeightOnlyConfig", group_size=config.group_size)
    device = _device(module)
    calls = boundary.calib_calls(config.calib, device, config.max_calib_batches)
    if int8 and config.activations == "auto":
        config = replace(config, activations="static" if calls else "dynamic")
    decided = _decide(module, precision, config)
    names = [n for n, (_, rule) in decided.items() if rule is None]
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            # one GEMM for the layers that read one input: it pays once compiled (requant.dedupe merges the calls)
            groups = shared.input_groups(module, names, calls[0]) if (
                int8 and config.shared_gemm and calls) else []
            ref_outs = _reference(module, calls)
            absmax = _input_absmax(module, names, calls) if (
                int8 and config.smooth_alpha is not None and calls) else {}
            alphas = (SMOOTH_GRID if config.smooth_alpha == "auto" else (config.smooth_alpha,)) if absmax else (None,)
            qmods = _layers(module, names, decided, calls, precision, config, alphas[0], absmax, groups)
            io_dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
            # inference only: the custom ops have no backward, and no_grad need not be the caller's job
            inner = copy.deepcopy(module).to(config.dtype).requires_grad_(False)
            model = boundary.QuantizedModel(inner, config.dtype, io_dtype).eval()
            ids = _aliases(module)
            swap = _Swapper(model, qmods, {n: ids[id(decided[n][0])] for n in names}, calls,
                            boundary.stack_outputs(ref_outs) if calls else {})
            alpha, smooth_errors = alphas[0], {}
            if len(alphas) > 1:
                alpha, smooth_errors, qmods = _choose_smoothing(
                    swap, alphas,
                    lambda a: _layers(module, names, decided, calls, precision, config, a, absmax, groups), qmods)
            sens = _sensitivities(module, qmods, calls) if calls else {}
            quantized, kept, steps, model_sens = set(names), [], [], {}
            if calls:
                steps = [[0, swap.error(quantized)]]
                if config.budget is not None and steps[0][1] > config.budget:
                    kept, model_sens = _fit_budget(swap, quantized, sens, config, steps)
            swap.use(quantized)
            errors = swap.errors_of(quantized) if calls else {}
    finally:
        module.train(was_training)

    smoothed = int8 and any(getattr(q, "inv_smooth", None) is not None for q in qmods.values())
    report = QuantReport(precision, config.activations if int8 else None, SHORT[config.dtype],
                         str(device), config.budget, smooth=alpha if smoothed else None,
                         smooth_search=smooth_errors, error=errors,
                         fallback_steps=steps, sensitivity=config.sensitivity, fallback_sensitivity=model_sens,
                         bytes={"before": nbytes(module), "after": nbytes(model)})
    if calls:
        report.error_data = f"calibration data ({len(calls)} batches)"
    for name, (lin, rule) in decided.items():
        rule = Rule.ERROR_BUDGET if name in kept else rule
        report.layers.append(LayerDecision(
            name, lin.in_features, lin.out_features, precision if rule is None else SHORT[config.dtype],
            rule or Rule.QUANTIZED, _reason(rule, precision, config, lin, alpha if smoothed else None),
            getattr(qmods.get(name), "group", None), sens.get(name),
            next((g for g in groups if name in g), ()) if rule is None else ()))
    model.quant_report = report
    return model


def _layers(module: nn.Module, names: list[str], decided: dict, calls: list[boundary.Call], precision: str,
            config: PTQConfig, alpha: float | None, absmax: dict[str, torch.Tensor],
            groups: list[tuple[str, ...]]) -> dict[str, nn.Module]:
    """The quantized module of every candidate layer, smoothed with `alpha` (None: not smoothed); the layers of a
    group are slices of one shared layer, with factors over their concatenated weights (see shared)."""
    smooth = {} if alpha is None else {n: smooth_factors(absmax[n], module.get_submodule(n).weight, alpha)
                                       for n in names if n in absmax}
    for g in groups:
        if g[0] in smooth:
            joint = smooth_factors(absmax[g[0]], shared.concatenated(module, g)[0], alpha)
            smooth.update({n: joint for n in g})
    static = precision == "int8" and config.activations == "static"
    acts = _static_ranges(module, names, calls, config, smooth) if static else {}
    grouped = {n for g in groups for n in g}
    out = {n: _quantized_linear(decided[n][0], precision, config, acts.get(n), smooth.get(n))
           for n in names if n not in grouped}
    for g in groups:
        out.update(shared.shared_layers(module, g, acts.get(g[0]), smooth.get(g[0])))
    return {n: out[n] for n in names}


def _choose_smoothing(swap: _Swapper, alphas: tuple, build: Callable[[float], dict[str, nn.Module]],
                      first: dict[str, nn.Module]) -> tuple[float, dict[float, float], dict[str, nn.Module]]:
    """(alpha, {alpha: model error with every layer quantized}, its layers): the alpha of least error vs FP32 on the
    calibration data, each one measured with the whole model quantized (one model run per alpha). `first`: the
    layers already built at alphas[0] (each build is a calibration pass)."""
    errors, best = {}, None
    for alpha in alphas:
        qmods = first if alpha == alphas[0] else build(alpha)
        swap.set_layers(qmods)
        errors[alpha] = swap.error(set(qmods))
        if best is None or errors[alpha] < errors[best[0]]:
            best = (alpha, qmods)
    swap.set_layers(best[1])
    return best[0], errors, best[1]


def _reason(rule: Rule | None, precision: str, config: PTQConfig, lin: nn.Linear,
            alpha: float | None) -> str:
    if rule is None:
        if precision == "int8":
            sq = f", SmoothQuant alpha {alpha}" if alpha is not None else ""
            return f"W8A8: per-channel int8 weights, {config.activations} int8 activations{sq}"
        g = weight_group(lin.in_features, config.group_size)
        return f"{precision}: {'per-channel' if g is None else f'groups of {g}'} along K={lin.in_features}"
    return {Rule.ERROR_BUDGET: f"among the most sensitive layers while the error was over budget {config.budget}",
            Rule.NO_INT4_GROUP: f"K={lin.in_features} is not a multiple of 32: no int4 group of 128/64/32 fits",
            Rule.EXCLUDED: f"matches exclude {config.exclude}",
            Rule.WEIGHT_READ_BY_PARENT: "nn.MultiheadAttention reads out_proj.weight directly"}[rule]
