"""2:4 weights on sparse tensor cores, only where that is faster: `to_semi_structured(model, example_inputs)`.

A 2:4 GEMM does half the multiply-adds, but whether it beats cuBLAS depends on the shape: published measurements of
torch's semi-structured kernels (cuSPARSELt, CUTLASS) range from well below dense speed to a little above it, losing on
skinny token counts and small layers. So each 2:4 nn.Linear is measured at its real shape (the token count its input has
for `example_inputs`): dense F.linear against the compressed weight, same input, same bias. The layer becomes sparse
only when that wins by `min_gain`; every decision lands in the report with both timings and the reason.

Where it cannot run (a CPU, a GPU without sparse tensor cores, a torch without the kernels, fp32 weights, a shape
the kernels do not take) the layer stays dense and the report says why; with choose=False (force) those raise.
Timer and backend are parameters, so the decision logic is tested on a CPU with fakes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.compress.sparse.masks import is_two_four
from automp.compress.sparse.pruning import is_pruned
from automp.timing import time_fn

Timer = Callable[[str, str, Callable[[], Any]], float]  # (layer, "dense" | "sparse", fn) -> milliseconds
HALF = (torch.float16, torch.bfloat16)
# (weight rows, weight cols) multiples each backend needs, when torch does not say (it has, torch 2.2 - 2.13)
_FALLBACK_SHAPES = {"cusparselt": (16, 16), "cutlass": (32, 64)}


@dataclass(frozen=True)
class Backend:
    """How to compress a weight for sparse tensor cores, and which weight shapes that takes."""
    name: str
    compress: Callable[[torch.Tensor], torch.Tensor]
    multiple: dict[torch.dtype, tuple[int, int]]  # dtype -> (rows, cols) the weight's shape must be multiples of


@dataclass
class LayerChoice:
    name: str
    shape: list[int]  # weight [out, in]
    tokens: int | None  # rows of the layer's input for the example (batch * seq)
    dtype: str
    decision: str  # "sparse" | "dense"
    reason: str
    dense_ms: float | None = None
    sparse_ms: float | None = None

    @property
    def speedup(self) -> float | None:
        """dense / sparse time: > 1 means the sparse kernel is faster."""
        if self.dense_ms is None or not self.sparse_ms:
            return None
        return self.dense_ms / self.sparse_ms


@dataclass
class SemiStructuredReport:
    available: bool
    backend: str | None
    reason: str  # why semi-structured sparse is (un)available here
    min_gain: float
    layers: list[LayerChoice] = field(default_factory=list)

    @property
    def converted(self) -> list[str]:
        return [c.name for c in self.layers if c.decision == "sparse"]

    def as_dict(self) -> dict[str, Any]:
        return dict(asdict(self), converted=self.converted,
                    layers=[dict(asdict(c), speedup=c.speedup) for c in self.layers])


def detect_backend(device: torch.device) -> tuple[Backend | None, str]:
    """The semi-structured backend torch offers on `device`, or None and why not."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"semi-structured sparse kernels need a CUDA GPU; the model is on {device.type}"
    sparse = torch.sparse
    if not hasattr(sparse, "SparseSemiStructuredTensorCUSPARSELT"):
        return None, f"this torch ({torch.__version__}) has no semi-structured sparse tensors"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return None, (f"{torch.cuda.get_device_name(device)} (sm{major}{minor}) has no sparse tensor cores "
                      f"(needs sm80 or newer)")
    cusparselt = getattr(torch.backends, "cusparselt", None)
    cls = (sparse.SparseSemiStructuredTensorCUSPARSELT if cusparselt is not None and cusparselt.is_available()
           else sparse.SparseSemiStructuredTensorCUTLASS)
    name = cls.BACKEND if isinstance(getattr(cls, "BACKEND", None), str) else cls.__name__
    table = getattr(cls, "_DTYPE_SHAPE_CONSTRAINTS", {})
    multiple = {dt: (table[dt].sparse_min_rows, table[dt].sparse_min_cols) if dt in table
                else _FALLBACK_SHAPES.get(name, (64, 64)) for dt in HALF}
    return Backend(name, lambda w: cls.from_dense(w.detach().contiguous()), multiple), f"{name} on sm{major}{minor}"


def default_timer(warmup: int = 5, iters: int = 30) -> Timer:
    return lambda layer, kind, fn: time_fn(fn, warmup=warmup, iters=iters)


def to_semi_structured(model: nn.Module, example_inputs: tuple, choose: bool = True, min_gain: float = 1.05,
                       timer: Timer | None = None, backend: Backend | None = None,
                       rtol: float = 2e-2) -> SemiStructuredReport:
    """Give each 2:4 nn.Linear of a finalized, half-precision model a compressed semi-structured weight where the
    measured sparse kernel is at least `min_gain` times faster than dense at that layer's shape (choose=True), or
    everywhere it can run (choose=False: raises where it cannot). Inference only: converted weights are frozen.
    rtol: the largest relative L2 difference between sparse and dense outputs accepted for the example input."""
    if is_pruned(model):
        raise ValueError("to_semi_structured: the model still has training masks; call finalize(model) first "
                         "(compressed weights are for inference)")
    if not isinstance(example_inputs, tuple):
        raise TypeError(f"example_inputs must be a tuple of the model's positional inputs, got "
                        f"{type(example_inputs).__name__}")
    if min_gain <= 0:
        raise ValueError(f"min_gain must be > 0, got {min_gain!r}")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if backend is None:
        backend, why = detect_backend(device)
    else:
        why = f"{backend.name} (given)"
    if backend is None and not choose:
        raise RuntimeError(f"to_semi_structured(choose=False): semi-structured sparse is unavailable: {why}")
    report = SemiStructuredReport(backend is not None, backend.name if backend else None, why, min_gain)
    choices: dict[str, LayerChoice] = {}
    eligible: dict[str, nn.Linear] = {}
    for name, m in linears.items():
        w = m.weight
        c = choices[name] = LayerChoice(name, list(w.shape), None, str(w.dtype).replace("torch.", ""), "dense", "")
        if _already_sparse(w):
            c.decision, c.reason = "sparse", "already semi-structured"
            continue
        c.reason = _ineligible(m, backend, why) or ""
        if not c.reason:
            eligible[name] = m
        elif not choose and is_two_four(w):
            raise RuntimeError(f"to_semi_structured(choose=False): layer {name!r} cannot run sparse: {c.reason}")
    if not choose and not eligible:
        raise ValueError("to_semi_structured(choose=False): no nn.Linear with a 2:4 sparse weight to convert")
    inputs = _layer_inputs(model, eligible, example_inputs)
    timer = timer or default_timer()
    for name, m in eligible.items():
        _decide(name, m, inputs.get(name), choices[name], backend, choose, min_gain, timer, rtol)
    report.layers = list(choices.values())
    return report


def _already_sparse(w: torch.Tensor) -> bool:
    cls = getattr(torch.sparse, "SparseSemiStructuredTensor", None)
    return cls is not None and isinstance(w, cls)


def _ineligible(m: nn.Linear, backend: Backend | None, why: str) -> str | None:
    w = m.weight
    if not is_two_four(w):
        return "not 2:4 sparse"
    if backend is None:
        return why
    if w.dtype not in HALF:
        return f"weight is {w.dtype}: semi-structured kernels run fp16/bf16 only (convert the model with .half())"
    if w.dtype not in backend.multiple:
        return f"{backend.name} does not take {w.dtype}"
    rows, cols = backend.multiple[w.dtype]
    if w.shape[0] % rows or w.shape[1] % cols:
        return (f"weight {list(w.shape)} is not a multiple of ({rows}, {cols}), which {backend.name} needs "
                f"(padding the weight would change the layer's output shape)")
    return None


def _layer_inputs(model: nn.Module, layers: dict[str, nn.Linear], example_inputs: tuple) -> dict[str, torch.Tensor]:
    """The first input each layer sees on the example, as [tokens, in_features]."""
    seen: dict[str, torch.Tensor] = {}

    def grab(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            if name not in seen and args and isinstance(args[0], torch.Tensor):
                seen[name] = args[0].detach().reshape(-1, args[0].shape[-1]).contiguous()
        return hook

    handles = [m.register_forward_pre_hook(grab(n)) for n, m in layers.items()]
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _decide(name: str, m: nn.Linear, x: torch.Tensor | None, c: LayerChoice, backend: Backend, choose: bool,
            min_gain: float, timer: Timer, rtol: float) -> None:
    def refuse(reason: str) -> None:
        if not choose:
            raise RuntimeError(f"to_semi_structured(choose=False): layer {name!r} cannot run sparse: {reason}")
        c.reason = reason

    if x is None:
        return refuse("not called on the example inputs: its token count is unknown")
    c.tokens = int(x.shape[0])
    w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()
    x = x.to(w.dtype)
    try:
        ws = backend.compress(w)
        with torch.no_grad():
            dense_out, sparse_out = F.linear(x, w, b), F.linear(x, ws, b)
    except (RuntimeError, NotImplementedError, ValueError) as e:
        return refuse(f"{backend.name} failed on this layer: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    err = float((sparse_out.float() - dense_out.float()).norm() / dense_out.float().norm().clamp_min(1e-30))
    if not err <= rtol:
        return refuse(f"sparse output differs from dense by {err:.3g} (relative L2 > {rtol})")
    with torch.no_grad():
        c.dense_ms = float(timer(name, "dense", lambda: F.linear(x, w, b)))
        c.sparse_ms = float(timer(name, "sparse", lambda: F.linear(x, ws, b)))
    gain = c.dense_ms / c.sparse_ms if c.sparse_ms > 0 else float("inf")
    if choose and gain < min_gain:
        c.reason = f"sparse {gain:.2f}x dense at {c.tokens} tokens (< {min_gain:.2f}x): kept dense"
        return None
    m.weight = nn.Parameter(ws, requires_grad=False)
    c.decision = "sparse"
    c.reason = f"sparse {gain:.2f}x dense at {c.tokens} tokens" + ("" if choose else " (forced)")
    return None
