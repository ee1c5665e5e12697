"""One verb for every quantization scheme: `quantize(model, Config(), filter_fn=None)`.

    quantize(model, WeightOnlyConfig(bits=4, group_size=128))    # every nn.Linear -> WeightOnlyLinear (W4A16)
    quantize(model, W8A8Config())                                 # every nn.Linear -> Int8Linear (dynamic activations)
    quantize(model, QATConfig())                                  # nn.Linear / nn.Conv2d -> fake-quant QAT layers
    quantize(llm, WeightOnlyConfig(bits=4, awq=True, calib=ids)) # a causal LM's projections (automp.quant.causal_lm)
    q = quantize(model, W8A8Config(calib=batches, budget=0.02))  # PTQ (automp.quant.ptq): a new model, q.quant_report
    q = quantize(model, WeightOnlyConfig(bits=4, calib=batches, budget=0.05))   # the same for W4A16

Without calibration data a config swaps layers in place. With `calib`, on any module but a causal LM (causal_lm
takes those), it runs the post-training pipeline of automp.quant.ptq instead, because only the whole model's output
can say which layers the error budget allows: calibrated static activations, SmoothQuant, the most sensitive layers
kept in float until the budget holds, and a per-layer report. That result is a new model (float32 in and out, the
rest in fp16/bf16): the module passed in stays the FP32 reference it was measured against.

A scheme is a config dataclass and a handler registered for its type (`@register_handler(ConfigType)`): the handler
turns one module into its quantized replacement. Adding a scheme is adding a pair, with no change to the verb or to
its callers (automp.deploy.quantized and automp.llm build their layers through the same handlers or classes). A
scheme that must see the whole model (a causal LM: which projections, AWQ's calibration across blocks, the
embeddings; PTQ: the error of the whole model) registers a model handler too (`register_model_handler(ConfigType,
accepts)`), which takes the models and configs it accepts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from automp.quant.fallback import check_budget
from automp.quant.int8 import GROUPS, Int8Linear
from automp.quant.names import SHORT
from automp.quant.observers import ObserverConfig
from automp.quant.qat import QATConfig, to_qat
from automp.quant.weight_only import MIN_GROUP, WeightOnlyLinear, valid_group

Handler = Callable[[nn.Module, Any, str], nn.Module]
FilterFn = Callable[[nn.Module, str], bool]


def _alpha(v: Any) -> bool:
    return v is None or v == "auto" or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0)


# The PTQ settings, each checked one way wherever a config takes it (W8A8Config, WeightOnlyConfig with calib,
# automp.deploy.quantized.TorchQuantConfig): field -> (valid, what it must be).
_PTQ_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "activations": (lambda v: v in ("auto", "dynamic", "static"), "'auto', 'dynamic' or 'static'"),
    "smooth_alpha": (_alpha, "a SmoothQuant alpha in [0, 1], 'auto' or None"),
    "sensitivity": (lambda v: v in ("layer", "isolate", "drop"), "'layer', 'isolate' or 'drop'"),
    "observer": (lambda v: isinstance(v, ObserverConfig) and v.axis is None,
                 "an ObserverConfig with axis=None (static activations are per tensor)"),
    "dtype": (lambda v: v in SHORT, "torch.float16 or torch.bfloat16"),
    "group_size": (lambda v: v in GROUPS, f"one of {GROUPS} (the largest weight group tried)"),
    "max_calib_batches": (lambda v: isinstance(v, int) and v >= 1, "an int >= 1"),
}


def check_ptq(owner: str, **fields: Any) -> None:
    """One-line errors naming `owner` and the field, for the PTQ settings given (TorchQuantConfig's `smooth` is
    checked as smooth_alpha)."""
    for name, value in fields.items():
        if name == "budget":
            check_budget(value, owner)
        elif name == "exclude":
            if isinstance(value, str):
                raise TypeError(f"{owner}: exclude must be a tuple of module-name patterns, not a string")
        else:
            valid, must = _PTQ_FIELDS["smooth_alpha" if name == "smooth" else name]
            if not valid(value):
                raise ValueError(f"{owner}: {name} must be {must}, got {value!r}")


def _needs_calib(owner: str, calib: Any, budget: float | None) -> None:
    if budget is not None and calib is None:
        raise ValueError(f"{owner}: budget needs calib (the error vs FP32 is measured on the calibration batches)")


@dataclass(frozen=True)
class WeightOnlyConfig:
    """W8A16 / W4A16: int8 or int4 weights in groups of `group_size` along K (None: one scale per output row),
    activations in `dtype`. A group must divide K (checked per layer).

    On a causal LM of automp.quant.archs (automp.quant.causal_lm): awq searches activation-aware scales on `calib`
    (int64 token ids [B, T]); lm_head and embeddings quantize the output head and the input embedding too, at
    `edge_bits` (None: `bits`). Elsewhere these must stay at their defaults.

    On any other module, `calib` (batches, each what one call of the module takes) runs automp.quant.ptq: group_size
    is then the largest group tried (128, 64 or 32: the largest dividing each K; an int4 layer that none divides
    stays in float), `budget` the largest relative output error vs FP32 on the calibration data (None: no fallback),
    `sensitivity` how the budget search ranks layers, `exclude` fnmatch patterns of module names kept in float,
    `max_calib_batches` the batches read from calib."""
    bits: int = 4
    group_size: int | None = 128
    dtype: torch.dtype = torch.float16
    awq: bool = False
    calib: Any = field(default=None, compare=False)
    lm_head: bool = False
    embeddings: bool = False
    edge_bits: int | None = None
    budget: float | None = None
    sensitivity: str = "isolate"
    exclude: tuple[str, ...] = ()
    max_calib_batches: int = 8

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"WeightOnlyConfig: bits must be 4 or 8, got {self.bits!r}")
        if not valid_group(self.group_size):
            raise ValueError(f"WeightOnlyConfig: group_size must be a power of two >= {MIN_GROUP} or None "
                             f"(per-channel), got {self.group_size!r}")
        if self.edge_bits not in (None, 4, 8):
            raise ValueError(f"WeightOnlyConfig: edge_bits must be 4, 8 or None, got {self.edge_bits!r}")
        check_ptq("WeightOnlyConfig", dtype=self.dtype, budget=self.budget, sensitivity=self.sensitivity,
                  exclude=self.exclude, max_calib_batches=self.max_calib_batches)
        _needs_calib("WeightOnlyConfig", self.calib, self.budget)

    @property
    def whole_model(self) -> bool:
        """Whether it asks for what only a causal LM's model handler does."""
        return self.awq or self.lm_head or self.embeddings or self.edge_bits is not None


@dataclass(frozen=True, eq=False)
class W8A8Config:
    """W8A8: int8 weights per output channel, int8 activations per row taken in the forward (dynamic), or per tensor
    from calibration for the layers named in `static` ({layer name: (scale, zero point)}, see
    automp.quant.int8.int8_static_qparams). `smooth`: SmoothQuant factors per layer name (see Int8Linear).

    With `calib` (batches, each what one call of the module takes) automp.quant.ptq calibrates both instead:
    activations "static" (one scale per tensor from `observer`: the fast form once compiled), "dynamic" (per-row
    scales: no ranges to calibrate, but a row reduction in every forward) or "auto" (static). smooth_alpha: the
    SmoothQuant migration strength in [0, 1], "auto" (each alpha of automp.quant.ptq.pipeline.SMOOTH_GRID measured,
    the one of least error vs FP32 kept: per-tensor scales need more migration than per-row ones) or None (off).
    budget, sensitivity, exclude, max_calib_batches: as WeightOnlyConfig's. dtype: compute dtype of everything not
    quantized. shared_gemm: layers that read one input (query, key, value) become slices of one GEMM, which pays only
    once the model is compiled (automp.deploy.quantized.requant merges the slices' calls)."""
    static: dict[str, tuple[float, int]] | None = None
    smooth: dict[str, torch.Tensor] | None = None
    calib: Any = field(default=None, compare=False)
    budget: float | None = None
    activations: str = "auto"
    smooth_alpha: float | str | None = "auto"
    sensitivity: str = "isolate"
    observer: ObserverConfig = field(default_factory=ObserverConfig)
    dtype: torch.dtype = torch.float16
    exclude: tuple[str, ...] = ()
    max_calib_batches: int = 8
    shared_gemm: bool = False

    def __post_init__(self) -> None:
        check_ptq("W8A8Config", activations=self.activations, smooth_alpha=self.smooth_alpha,
                  sensitivity=self.sensitivity, observer=self.observer, dtype=self.dtype, budget=self.budget,
                  exclude=self.exclude, max_calib_batches=self.max_calib_batches)
        _needs_calib("W8A8Config", self.calib, self.budget)
        if self.calib is not None and (self.static is not None or self.smooth is not None):
            raise ValueError("W8A8Config: static and smooth are given per layer by hand; with calib they are "
                             "calibrated: leave them None (smooth_alpha sets SmoothQuant's strength)")
        if self.activations == "static" and self.calib is None and self.static is None:
            raise ValueError("W8A8Config: activations 'static' needs calib (static int8 activations need "
                             "calibration data) or static ranges per layer")


@dataclass(frozen=True)
class _Entry:
    handler: Handler
    default_filter: FilterFn


_HANDLERS: dict[type, _Entry] = {}
ModelHandler = Callable[[nn.Module, Any, "FilterFn | None"], nn.Module]
Accepts = Callable[[nn.Module, Any], bool]
_MODEL_HANDLERS: dict[type, list[tuple[Accepts, ModelHandler]]] = {}


def _is_linear(module: nn.Module, name: str) -> bool:
    return type(module) is nn.Linear


def register_handler(config_type: type, default_filter: FilterFn = _is_linear) -> Callable[[Handler], Handler]:
    """Register `handler(module, config, name) -> replacement` for configs of `config_type`; `default_filter`
    picks the modules `quantize` replaces when the caller gives no filter_fn."""
    def register(handler: Handler) -> Handler:
        _HANDLERS[config_type] = _Entry(handler, default_filter)
        return handler
    return register


def register_model_handler(config_type: type, accepts: Accepts) -> Callable[[ModelHandler], ModelHandler]:
    """Register `handler(model, config, filter_fn) -> model` for the models and configs `accepts(model, config)`
    takes: `quantize` hands it the whole model instead of swapping modules one by one."""
    def register(handler: ModelHandler) -> ModelHandler:
        _MODEL_HANDLERS.setdefault(config_type, []).append((accepts, handler))
        return handler
    return register


def _entry(config: Any) -> _Entry:
    entry = _HANDLERS.get(type(config))
    if entry is None:
        known = ", ".join(sorted(t.__name__ for t in _HANDLERS))
        raise TypeError(f"automp.quant.quantize: no handler for {type(config).__name__}; registered configs: {known}")
    return entry


def quantize_layer(module: nn.Module, config: Any, name: str = "") -> nn.Module:
    """The quantized replacement of one module (what `quantize` puts in its place)."""
    return _entry(config).handler(module, config, name)


def quantize(model: nn.Module, config: Any, filter_fn: FilterFn | None = None) -> nn.Module:
    """Replace, in place, every module of `model` that filter_fn(module, name) selects (default: the config's, e.g.
    every nn.Linear) by the handler's result; returns `model` (or the replacement, when `model` itself matched). A
    model a model handler accepts goes to it whole (register_model_handler).

    With calibration data (W8A8Config / WeightOnlyConfig `calib`, a module that is not a causal LM) the result is a new
    model instead, automp.quant.ptq's QuantizedModel with its QuantReport as `quant_report`, and `model` is left as
    it was: the FP32 reference the result's error was measured against.

    A module reachable under several names is replaced once, under all of them; the inside of a replaced module is
    not visited. Selecting nothing is an error, never a silent no-op."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"automp.quant.quantize takes an nn.Module, got {type(model).__name__}")
    whole = next((h for accepts, h in _MODEL_HANDLERS.get(type(config), ()) if accepts(model, config)), None)
    if whole is not None:
        return whole(model, config, filter_fn)
    if getattr(config, "whole_model", False):
        raise ValueError(f"automp.quant.quantize: {type(config).__name__}'s awq, lm_head, embeddings and edge_bits "
                         f"apply to the causal LMs of automp.quant.archs, not to {type(model).__name__}")
    entry = _entry(config)
    keep = filter_fn or entry.default_filter
    names: dict[int, list[str]] = {}
    chosen: dict[int, nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
        if keep(module, name):
            chosen[id(module)] = module
    if not chosen:
        raise ValueError(f"automp.quant.quantize: no module of {type(model).__name__} matched the filter for "
                         f"{type(config).__name__}")
    if id(model) in chosen:
        return entry.handler(model, config, "")
    replaced: list[str] = []
    for key, module in chosen.items():
        aliases = names[key]
        if any(a.startswith(p + ".") for a in aliases for p in replaced):
            continue  # inside a module already replaced
        new = entry.handler(module, config, aliases[0])
        for alias in aliases:
            set_module(model, alias, new)
        replaced += aliases
    return model


def set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """root's submodule at dotted `path` replaced by `module`."""
    parent, _, leaf = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def _dense(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"automp.quant: expected an nn.Linear, got {type(module).__name__}")
    return module.weight.detach().float(), None if module.bias is None else module.bias.detach().float()


@register_handler(WeightOnlyConfig)
def _weight_only(module: nn.Module, config: WeightOnlyConfig, name: str) -> nn.Module:
    w, b = _dense(module)
    if config.group_size is not None and w.shape[1] % config.group_size:
        raise ValueError(f"automp.quant: group_size {config.group_size} does not divide K={w.shape[1]} of layer "
                         f"{name or type(module).__name__}; pick a power of two dividing it, or group_size=None")
    return WeightOnlyLinear.from_weight(w, b, config.bits, config.group_size, config.dtype)


@register_handler(W8A8Config)
def _w8a8(module: nn.Module, config: W8A8Config, name: str) -> nn.Module:
    w, b = _dense(module)
    act = (config.static or {}).get(name)
    return Int8Linear(w, b, act, (config.smooth or {}).get(name))


register_handler(QATConfig, lambda m, n: type(m) in (nn.Linear, nn.Conv2d))(lambda m, config, name: to_qat(m, config))
