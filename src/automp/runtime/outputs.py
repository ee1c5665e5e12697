"""What a root module returns to the script: its FP32 dtypes back, paid for only where the script reads them.

A script written for FP32 must see FP32 tensors after the call (a loss outside the model, a `.numpy()`), so
low-precision results are cast back at the module's boundary. For a plain tensor or tuple the cast is fused into the
compiled graph's last kernel. But a transformers model returns a ModelOutput that often holds a huge tensor nobody
reads: GPT-2's `model(**batch).loss` leaves 8x1024x50257 logits untouched, and casting them anyway costs an FP32
copy of them (over a gigabyte) at the peak and a few percent of the step. So ModelOutput-like results are cast
lazily: each low-precision field turns FP32 the first time it is read (attribute, key, values(), to_tuple(), ...), and a
field never read never costs anything. Read or not, the script only ever sees FP32.

A plain `@dataclass` result (not a ModelOutput) is a single leaf to torch's pytree, so its fields are walked here:
it comes back as a copy with FP32 fields, frozen or not (and, out of a CUDA graph's memory, with copied fields).
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

HALVES = (torch.float16, torch.bfloat16)


def _to_float(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in HALVES else t


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], out: Any) -> Any:
    """`out` with fn applied to every tensor in it: in pytree's containers (tuples, lists, dicts, NamedTuples,
    ModelOutputs) and in the fields of dataclasses, which pytree sees as single leaves."""
    if isinstance(out, torch.Tensor):  # the usual result, without pytree's walk (every root call on the eager path)
        return fn(out)
    return pytree.tree_map(lambda leaf: _map_leaf(fn, leaf), out)


def _map_leaf(fn: Callable[[torch.Tensor], torch.Tensor], leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return fn(leaf)
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return _rebuilt(leaf, fn)
    return leaf


def _rebuilt(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A new instance of `obj`'s class with fn mapped over its fields (the module may have returned an object it
    keeps, which must not change under it). Rebuilt by dataclasses.replace, which frozen dataclasses accept; fields
    outside __init__, or a class replace refuses (an InitVar without default), are set on a shallow copy. Every
    field is passed on, changed or not: an identity test on a tuple field would break the graph Dynamo traces."""
    fields = dataclasses.fields(obj)
    mapped = {f.name: map_tensors(fn, getattr(obj, f.name, None)) for f in fields}
    init = {f.name: mapped[f.name] for f in fields if f.init}
    try:
        new = dataclasses.replace(obj, **init)
    except (TypeError, ValueError):
        new, init = copy.copy(obj), {}
    for name, value in mapped.items():
        if name not in init:
            object.__setattr__(new, name, value)
    return new


def restore_float32(out: Any) -> Any:
    """Every half tensor in `out` cast to FP32, eagerly. Any half type, not only the session's: autocast runs some
    ops in its own choice (cuDNN RNNs in fp16 under a bf16 autocast on torch 2.11)."""
    return map_tensors(_to_float, out)


def is_lazy_candidate(out: Any) -> bool:
    """A transformers ModelOutput (an ordered mapping with dataclass fields and to_tuple), whose fields can be cast
    on first read. Checked by shape, not by import: transformers is optional."""
    return (isinstance(out, Mapping) and hasattr(out, "to_tuple") and hasattr(type(out), "__dataclass_fields__")
            and not isinstance(out, _LazyFloat))


def restore_outside_graph(out: Any) -> Any:
    """Inside a compiled function: everything but a ModelOutput is restored now (the cast fuses into the graph);
    a ModelOutput is left for `restore_lazily`, outside the graph."""
    return out if is_lazy_candidate(out) else restore_float32(out)


def out_of_pool(out: Any, keep: tuple[str, ...] = ()) -> Any:
    """`out` with copies of its tensors, made outside a call replayed as a CUDA graph (Route.GRAPHED): the graph's
    next replay writes into the same memory, so what the previous call returned would change under a script that kept
    it (losses collected on the device and summed at the end of an epoch; torch raises where it notices). A loss is
    one element; a classifier's logits a few MB. ModelOutput fields named in `keep` (detached because the script does
    not read them: automp.runtime.guards.unread_outputs) stay where they are: copying GPT-2's unread logits would move 0.8 GB a
    step."""
    if not is_lazy_candidate(out):
        return map_tensors(torch.clone, out)
    for name in list(dict.keys(out)):
        if name not in keep:
            out[name] = map_tensors(torch.clone, dict.__getitem__(out, name))
    return out


def restore_lazily(out: Any, watch: Any = None) -> Any:
    """`out` with FP32 promised: a ModelOutput becomes its lazy twin (same object, class swapped), anything else is
    restored now. `watch.on_read(out, name)` is told of every field read before it happens
    (automp.runtime.guards.unread_outputs)."""
    if not is_lazy_candidate(out):
        return restore_float32(out)
    if watch is None and not any(isinstance(v, torch.Tensor) and v.dtype in HALVES for v in dict.values(out)):
        return out
    out.__class__ = _lazy_class(type(out))
    if watch is not None:
        object.__setattr__(out, "_automp_watch", watch)
    return out


_LAZY: dict[type, type] = {}


def _lazy_class(cls: type) -> type:
    lazy = _LAZY.get(cls)
    if lazy is None:
        lazy = type(cls.__name__, (_LazyFloat, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                      "__doc__": cls.__doc__, "_original": cls})
        _LAZY[cls] = lazy
    return lazy


class _LazyFloat:
    """Mixin placed in front of a ModelOutput class. Its fields are both attributes and mapping items (ModelOutput
    keeps the two in step on assignment), so a field is cast once, where it is first read, and stored back."""

    def _cast_field(self, name: str) -> None:
        watch = object.__getattribute__(self, "__dict__").get("_automp_watch")
        if watch is not None:
            watch.on_read(self, name)
        value = dict.get(self, name)
        if isinstance(value, torch.Tensor) and value.dtype in HALVES:
            setattr(self, name, value.float())  # ModelOutput.__setattr__ updates the item and the attribute

    def _cast_all(self) -> None:
        for name in list(dict.keys(self)):
            self._cast_field(name)

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_") and dict.__contains__(self, name):
            object.__getattribute__(self, "_cast_field")(name)
        return super().__getattribute__(name)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            self._cast_field(key)
            return dict.__getitem__(self, key)  # ModelOutput's own would copy (and so cast) every field
        self._cast_all()
        return super().__getitem__(key)

    # every other way to reach the tensors casts them all first
    def values(self) -> Any:
        self._cast_all()
        return super().values()

    def items(self) -> Any:
        self._cast_all()
        return super().items()

    def to_tuple(self) -> tuple:
        self._cast_all()
        return super().to_tuple()

    def get(self, key: Any, default: Any = None) -> Any:
        self._cast_all()
        return super().get(key, default)

    def pop(self, *args: Any) -> Any:
        self._cast_all()
        return super().pop(*args)

    def popitem(self, *args: Any) -> Any:
        self._cast_all()
        return super().popitem(*args)

    def copy(self) -> Any:
        self._cast_all()
        return super().copy()

    def __reduce__(self) -> Any:
        """Pickled (torch.save, DataLoader workers) as the original class: the twin shares its name, so pickle would
        find the original by name and refuse the twin; every field is FP32 by then, nothing lazy is lost."""
        self._cast_all()
        fn, args, *rest = super().__reduce__()
        if rest and isinstance(rest[0], dict) and "_automp_watch" in rest[0]:  # automp's, not the output's state
            rest[0] = {k: v for k, v in rest[0].items() if k != "_automp_watch"}
        return (type(self)._original if fn is type(self) else fn, args, *rest)

    def __eq__(self, other: Any) -> bool:
        self._cast_all()
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # as dict's
