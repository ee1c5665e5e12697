"""The edges of a converted model: the caller's float32 I/O kept, and calibration batches checked.

The converted model computes in fp16 (or bf16), but callers keep passing what they passed to the FP32 module and
get float32 back - as the ONNX path keeps float32 I/O - so swapping the model in changes no calling code. Integer
inputs (token ids, masks) pass through untouched.

A calibration batch is what one call of the model takes: a tensor (one positional argument), a tuple/list of
positional arguments, or a dict of keyword arguments (a tokenizer's output).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

Call = tuple[tuple, dict]  # (positional args, keyword args) of one model call


def _cast_floats(tree: Any, src: tuple[torch.dtype, ...], dst: torch.dtype) -> Any:
    return pytree.tree_map(lambda t: t.to(dst) if isinstance(t, torch.Tensor) and t.dtype in src else t, tree)


class QuantizedModel(nn.Module):
    """`inner` (fp16/bf16, quantized Linears) behind the FP32 model's dtype boundary.

    Inputs: float32 tensors become the compute dtype. Outputs: compute-dtype tensors come back as io_dtype (the
    FP32 model's parameter dtype). Both casts are plain tensor ops, so torch.compile fuses them into the graph.
    """

    def __init__(self, inner: nn.Module, dtype: torch.dtype, io_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inner = inner
        self.dtype, self.io_dtype = dtype, io_dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _cast_floats((args, kwargs), (self.io_dtype,), self.dtype)
        return _cast_floats(self.inner(*args, **kwargs), (self.dtype,), self.io_dtype)


def as_call(batch: Any, index: int) -> Call:
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    raise TypeError(f"calibration batch {index}: expected a tensor, a tuple/list of positional arguments or a dict of "
                    f"keyword arguments, got {type(batch).__name__}")


def describe(call: Call) -> str:
    """`(2x7 int64, mask=2x7 int64)`: shapes and dtypes, for error messages."""
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return "x".join(map(str, v.shape)) + f" {str(v.dtype).removeprefix('torch.')}"
        return type(v).__name__
    args, kwargs = call
    return "(" + ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]) + ")"


def _signature(call: Call) -> tuple:
    """What must agree between batches: argument structure, and per tensor its rank and float-ness (batch size and
    sequence length may vary)."""
    leaves, spec = pytree.tree_flatten(call)
    return str(spec), tuple((t.dim(), t.is_floating_point()) if isinstance(t, torch.Tensor) else type(t)
                            for t in leaves)


def first_batches(calib: Iterable | None, limit: int) -> list | None:
    """Up to `limit` batches of `calib` as a list (None stays None): an iterator is read once, here."""
    if calib is None:
        return None
    if isinstance(calib, (torch.Tensor, Mapping)):
        raise TypeError("calib must be an iterable of batches (e.g. a list of tensors or of dicts), not a single "
                        f"{type(calib).__name__}; wrap one batch as [batch]")
    return list(itertools.islice(calib, limit))


def calib_calls(calib: Iterable | None, device: torch.device, limit: int) -> list[Call]:
    """Up to `limit` batches as (args, kwargs) on the model's device; batches that disagree in structure or rank
    with the first are an error naming both (a model would fail on them, or worse, broadcast)."""
    batches = first_batches(calib, limit)
    if batches is None:
        return []
    calls: list[Call] = []
    for i, batch in enumerate(batches):
        call = as_call(batch, i)
        if not any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(call)):
            raise ValueError(f"calibration batch {i} holds no tensor: {describe(call)}")
        if calls and _signature(call) != _signature(calls[0]):
            raise ValueError(f"calibration batch {i} {describe(call)} does not match batch 0 {describe(calls[0])}: "
                             "every batch needs the same arguments with the same ranks")
        calls.append(pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, call))
    if not calls:
        raise ValueError("calib is empty: give at least one batch, or calib=None")
    return calls


def hooked_pass(module: nn.Module, names: Iterable[str], hook: Callable[[str, torch.Tensor, torch.Tensor], None],
                calls: list[Call]) -> None:
    """Run every call through `module` with hook(name, input, output) on each named submodule."""
    handles = [module.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: hook(n, a[0], o)) for n in names]
    try:
        for args, kwargs in calls:
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()


def run_checked(model: nn.Module, call: Call, index: int) -> Any:
    """model(*args, **kwargs), with a failure reported as a calibration-data problem naming the batch."""
    args, kwargs = call
    try:
        return model(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any model error here means the batch does not fit the model
        raise ValueError(f"calibration batch {index} {describe(call)} does not fit the model: "
                         f"{type(e).__name__}: {e}") from e


def float_outputs(out: Any) -> dict[str, torch.Tensor]:
    """The floating tensors of a model output (tensor, tuple, dict, ModelOutput, nested), keyed by their path."""
    def name(path: tuple) -> str:
        keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
        return ".".join(map(str, keys)) or "output"
    leaves, _ = pytree.tree_flatten_with_path(out)
    named = {name(path): t for path, t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()}
    if not named:
        raise ValueError(f"the model returned no floating-point tensor to compare ({type(out).__name__})")
    return named


def stack_outputs(per_batch: list[dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """Each output over all batches as one float32 array: concatenated along the batch axis where the batches agree
    on the other dims, else flattened end to end (the L2 error is the same either way)."""
    out = {}
    for name in per_batch[0]:
        arrs = [b[name].detach().float().cpu().numpy() for b in per_batch]
        same = all(a.ndim >= 1 and a.shape[1:] == arrs[0].shape[1:] for a in arrs)
        out[name] = np.concatenate(arrs) if same else np.concatenate([a.ravel() for a in arrs])
    return out
