"""One configuration for an automp run, parsed and validated completely before anything is installed.

Every source of settings parses here and nowhere else: keyword arguments (`AutoMPConfig(...)`, `enable(**kw)`), the
environment (`from_env`) and the command line (`from_cli`). Fields are normalized at construction (dtype aliases,
loss_scale strings, the report and cache paths), so the rest of automp reads one canonical value and a bad argument
raises before automp touches torch: no half-patched nn.Module, no scaler hooked into autograd.

This module imports nothing else of automp at import time: every layer may read a config.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path as FsPath
from typing import Any, Mapping

VERSION = "0.3.8"  # the package's version (automp.__version__), here so that any layer can key a cache by it

DTYPES = {"auto": "auto", "fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16",
          "fp8": "fp8", "float8": "fp8"}
FP8_RECIPES = ("tensorwise", "rowwise", "auto")
INNERS = ("inductor", "eager")
SPECS = ("a100", "cpu", "h100", "h200")  # automp.precision.cost.SPECS: the devices a plan can be made for
PATHS = ("auto", "compile", "eager", "fp32", "autocast-compile", "autocast-graphs", "fp8-compile", "fp8-graphs")
# environment variable -> field; read by from_env only (cache_dir's default also at construction, see cache_dir)
ENVIRONMENT = {"AUTOMP_INNER": "inner", "AUTOMP_PATH": "path", "AUTOMP_CACHE_DIR": "cache_dir",
               "AUTOMP_DEBUG": "debug", "AUTOMP_FP8_KEEP": "fp8_keep",
               "AUTOMP_FUSE_SIBLINGS": "fuse_siblings", "AUTOMP_FUSE_LINEAR_CE": "fuse_linear_ce", "RANK": "rank",
               "WORLD_SIZE": "world_size"}
_FLAGS = ("fp8_output", "fp8_all_gather", "fuse_siblings", "fuse_linear_ce", "causal_attention", "fuse_optimizers",
          "release_grads", "tune_cudnn", "tune_layout", "cuda_graphs", "quiet", "debug")


class FieldError(ValueError, TypeError):
    """A field of AutoMPConfig given a value it does not accept (None where None means nothing, another type, an
    unknown name): one error for every field, naming it, what it accepts and what it got. A ValueError, and a
    TypeError too for the wrong types that raised TypeError before."""


@dataclass(frozen=True, kw_only=True)
class AutoMPConfig:
    """dtype: "auto" (bf16 where supported, else fp16), "fp16", "bf16" or "fp8" (aliases float16/half/bfloat16/float8
    accepted, stored canonical). "fp8": bf16 everywhere, and FP8 GEMMs in the linear layers where the device's
    measured times predict a gain and FP8 stays accurate on the real batch, if the trial confirms it on the whole
    step (automp.precision.fp8.choice); it needs FP8 tensor cores (compute capability 8.9+).
    fp8_recipe: "tensorwise" (one scale per tensor; the fastest) or "rowwise" (a scale per row; more accurate with
    outliers), as torchao names them, or "auto": each layer the recipe its measured times predict to gain most among
    those accurate on the real batch (automp.precision.fp8.choice.merge).
    fp8_keep: linear layers that stay bf16 under dtype="fp8" whatever their measurements, as glob patterns over
    their names in the model ("lm_head", "*.self_attn.*"; a pattern also matches below a wrapper: "lm_head" is DDP's
    "module.lm_head"); a comma-separated string is split. For the layers a user knows to be sensitive, or whose FP8
    casts cost memory that matters more than their speed (the LM head's logits gradient).
    fp8_output: let the model's output layer (the last linear layer its forward calls: an LM head, a classifier) run
    FP8 too where measured to pay. Off by default, as torchao's and Transformer Engine's recipes leave it: an LM head
    run in FP8 can make the loss drift from bf16's over a long run where the same model with its head kept bf16 tracks
    it (BENCHMARKS.md, "FP8 loss parity").
    fp8_all_gather: under FSDP2, all-gather the FP8 layers' weights in FP8 once the model runs its FP8 path (the same
    FP8 values, half the bytes of bf16; automp.precision.fp8.gather). Off: FSDP2 gathers them in its own dtype and
    they are cast after the gather, an escape hatch, since the FP8 gather works inside FSDP2's parameter objects.
    loss_scale: "dynamic", "off" (or None/0) or a positive constant (a number or a numeric string such as "1024");
    stored as "dynamic", None (off) or a float. Only fp16 uses it.
    report: path of the JSON precision report (made absolute now: the script may chdir). Under torchrun each rank
    but 0 writes its own file beside it (`report_path`).
    inner: "inductor" or "eager" (rewritten graphs run op by op: fast start, for tests and debugging).
    spec: plan casts for another device's costs ("h100", "cpu", ...).
    path: "auto" measures the candidate paths in the first iterations and keeps the fastest; "compile", "eager",
    "autocast-compile", "autocast-graphs" or "fp32" force automp's compiled pass, low-precision eager, stock Inductor
    under autocast, the same replayed as CUDA graphs, or the script as written.
    cache_dir: where calibration and verdicts are cached: given, else $AUTOMP_CACHE_DIR, else ~/.cache/automp
    (always resolved, so every cache of one run agrees on it).
    fuse_siblings: on the compiled paths, run linear layers that read the same input (query, key and value;
    gate and up) as one GEMM on their weights concatenated in the graph (automp.precision.siblings); the parameters,
    their gradients and state_dict stay as they are. Off by default until measured faster.
    fuse_linear_ce: on the compiled paths, compute an output layer followed by a cross-entropy (a causal LM's
    loss) a block of rows at a time (automp.precision.linear_ce), where the script does not read the logits'
    gradient. Off by default: at Llama-3.2-1B's head it was slower than Inductor's own graph and no smaller
    (BENCHMARKS.md, "Output layer + cross-entropy in blocks").
    causal_attention: on the compiled paths, hand attention a causal mask that the graph builds from fixed sizes
    as `is_causal=True` (automp.precision.causal_mask): the same attention, without computing the masked half. On by
    default; off keeps the script's mask.
    fuse_optimizers: switch torch's Adam/AdamW left at their default implementation to fused=True on CUDA
    (same arithmetic, one kernel per step; see automp.runtime.tuning.fused_optimizers).
    release_grads: where a root's calls showed the script sets the last step's gradients to None after its forward
    and before its backward (`loss = model(x); opt.zero_grad(); loss.backward()`, Lightning's order too), set them
    to None as the forward starts instead while its trial runs: the candidates without CUDA graphs do not hold them
    beside their activations, as the hand-written reduce-overhead loop does not (automp.runtime.graph_pool,
    GradRescue.release). Off keeps them until the script's own zero_grad: for a script that reads them between its
    forward and its zero_grad (a log of the last step's gradient norm placed there), which would find None.
    tune_cudnn: on CUDA, time cuDNN's benchmark mode against its heuristics once the paths are chosen, and keep
    the faster (automp.runtime.tuning.conv_tuning); a script that set the flag itself is left alone.
    tune_layout: on CUDA, time channels_last activations for the convolutions of modules that run eagerly against
    the script's layout, and keep the faster (automp.runtime.tuning.conv_layout); parameters keep their layout.
    cuda_graphs: on CUDA, let the trial time autocast-compiled's graphs replayed as CUDA graphs (Route.GRAPHED); off
    for a script that needs the memory their pool takes.
    quiet: no live status line on the terminal while a trial runs (automp.runtime.progress); the summary at exit
    and the notices stay. Without a terminal on stderr there is none anyway.
    debug: print the tracebacks of graphs that fell back to FP32 (they are always listed in the report).
    rank, world_size: this process's place under torchrun (RANK, WORLD_SIZE), for per-rank report files."""

    dtype: str = "auto"
    fp8_recipe: str = "tensorwise"
    fp8_keep: Any = ()
    fp8_output: bool = False
    fp8_all_gather: bool = True
    loss_scale: Any = "dynamic"
    report: str | None = None
    inner: str = "inductor"
    spec: str | None = None
    path: str = "auto"
    cache_dir: str | None = None
    fuse_siblings: bool = False
    fuse_linear_ce: bool = False
    causal_attention: bool = True
    fuse_optimizers: bool = True
    release_grads: bool = True
    tune_cudnn: bool = True
    tune_layout: bool = True
    cuda_graphs: bool = True
    quiet: bool = False
    debug: bool = False
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        self._check_kinds()
        self._set("dtype", DTYPES[self.dtype])
        self._set("fp8_keep", parse_patterns(self.fp8_keep, "fp8_keep"))
        if self.path.startswith("fp8-") and self.dtype != "fp8":
            raise ValueError(f"path {self.path!r} runs FP8 layers: it needs dtype='fp8', not {self.dtype!r}")
        self._set("loss_scale", parse_loss_scale(self.loss_scale))
        if self.path in ("autocast-graphs", "fp8-graphs") and not self.cuda_graphs:
            raise ValueError(f"path {self.path!r} asks for the CUDA graphs that cuda_graphs=False turns off")
        if self.spec and self.spec.lower() not in SPECS:
            raise ValueError(f"unknown device spec {self.spec!r}: expected one of {list(SPECS)}")
        if self.report is not None:
            self._set("report", os.path.abspath(os.fspath(self.report)))
        self._set("cache_dir", os.path.abspath(os.fspath(self.cache_dir or default_cache_dir(os.environ))))

    def _check_kinds(self) -> None:
        """Every field holds a value of what it accepts (None only where None means something), before any of them
        is read: a wrong one is one FieldError naming the field, what it accepts and what it got."""
        def bad(name: str, accepts: str) -> FieldError:
            return FieldError(f"{name} must be {accepts}, got {getattr(self, name)!r}")

        if self.dtype not in DTYPES or not isinstance(self.dtype, str):
            names, aliases = list(dict.fromkeys(DTYPES.values())), ", ".join(k for k, v in DTYPES.items() if k != v)
            raise FieldError(f"unsupported dtype {self.dtype!r}: dtype must be one of {names} (or an alias: "
                             f"{aliases}), got {self.dtype!r}")
        for name, choices in (("fp8_recipe", FP8_RECIPES), ("inner", INNERS), ("path", PATHS)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                raise bad(name, f"one of {list(choices)}")
        for flag in _FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise bad(flag, "True or False")
        if self.spec is not None and not isinstance(self.spec, str):
            raise bad("spec", f"None or one of {list(SPECS)}")
        if self.report is not None and not isinstance(self.report, (str, os.PathLike)):
            raise bad("report", "None or a file path")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise bad("cache_dir", "None or a directory path")
        for name, least in (("rank", 0), ("world_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise bad(name, f"an integer >= {least}")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # normalizing a frozen field, once, at construction

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "AutoMPConfig":
        """The configuration the environment asks for (AUTOMP_INNER, AUTOMP_PATH, AUTOMP_CACHE_DIR, AUTOMP_DEBUG,
        AUTOMP_FP8_KEEP, AUTOMP_FUSE_SIBLINGS=1, AUTOMP_FUSE_LINEAR_CE=1, torchrun's RANK and WORLD_SIZE), with
        `overrides` (any field) winning over it."""
        env = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        for var, name in ENVIRONMENT.items():
            raw = env.get(var, "")
            if raw == "":
                continue
            if name in ("debug", "fuse_siblings", "fuse_linear_ce"):
                found[name] = raw != "0"
            elif name in ("rank", "world_size"):
                try:
                    found[name] = int(raw)
                except ValueError:
                    raise ValueError(f"{var}={raw!r} is not an integer") from None
            else:
                found[name] = raw
        if "cache_dir" not in found:
            found["cache_dir"] = default_cache_dir(env)
        try:
            return cls(**{**found, **overrides})
        except ValueError as e:  # name the variable when the environment's value is the bad one
            for var, name in ENVIRONMENT.items():
                if name in found and name not in overrides and not _valid(cls, name, found[name]):
                    raise ValueError(f"{var}={env[var]!r}: {e}") from None
            raise

    @classmethod
    def from_cli(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> "AutoMPConfig":
        """`automp run`'s options (those given: an option left at None leaves the environment's value) over the
        environment."""
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if getattr(args, f.name, None) is not None}
        return cls.from_env(environ, **given)

    def low_dtype(self, device: Any = None) -> Any:
        """The torch dtype low precision means on `device`: "auto" is bf16 (no loss scaling needed, fp32 range)
        wherever the hardware has it, else fp16. "fp8" computes everything but its FP8 GEMMs in bf16."""
        import torch
        if self.dtype == "fp8":
            return torch.bfloat16
        if self.dtype != "auto":
            return torch.float16 if self.dtype == "fp16" else torch.bfloat16
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16

    @property
    def wants_loss_scaling(self) -> bool:
        """fp16 needs loss scaling to keep small gradients from flushing to zero, bf16 does not, and a script may
        switch it off. "auto" means fp16 on a CUDA device without bf16."""
        if self.loss_scale is None:
            return False
        import torch
        return self.low_dtype("cuda" if torch.cuda.is_available() else "cpu") == torch.float16

    @property
    def report_path(self) -> str | None:
        """Where this process writes the report: under torchrun every rank is given the same --report, so rank 0
        writes the path given and rank N writes `<stem>.rank<N><suffix>` beside it."""
        if self.report is None or self.rank == 0:
            return self.report
        path = FsPath(self.report)
        return str(path.with_name(f"{path.stem}.rank{self.rank}{path.suffix}"))


def _valid(cls: type, name: str, value: Any) -> bool:
    try:
        cls(**{"cache_dir": ".", name: value})
    except ValueError:
        return False
    return True


def default_cache_dir(environ: Mapping[str, str]) -> str:
    return environ.get("AUTOMP_CACHE_DIR") or str(FsPath.home() / ".cache" / "automp")


def parse_loss_scale(spec: Any) -> str | float | None:
    """"dynamic", None (off: "off", None or 0) or a positive finite constant (a number or numeric string)."""
    if spec in ("dynamic", "off", None) or (isinstance(spec, (int, float)) and not isinstance(spec, bool)
                                            and spec == 0):
        return None if spec != "dynamic" else "dynamic"
    problem = f"loss_scale must be 'dynamic', 'off' or a positive number, got {spec!r}"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise FieldError(problem)
    try:
        value = float(spec)
    except ValueError:
        raise FieldError(problem) from None
    if not math.isfinite(value) or value <= 0:
        raise FieldError(f"loss_scale must be a positive finite number, got {spec!r}")
    return value


def parse_patterns(value: Any, name: str) -> tuple[str, ...]:
    """A tuple of non-empty glob patterns from a comma-separated string ("" is none) or an iterable of strings."""
    if isinstance(value, str):
        items = [p.strip() for p in value.split(",")] if value.strip() else []
    else:
        try:
            items = list(value)
        except TypeError:
            raise FieldError(f"{name} must be a comma-separated string or a list of strings, got {value!r}") from None
        if not all(isinstance(p, str) for p in items):
            raise FieldError(f"{name} must be a comma-separated string or a list of strings, got {value!r}")
        items = [p.strip() for p in items]
    if not all(items):
        raise FieldError(f"{name} has an empty pattern: {value!r}")
    return tuple(items)
