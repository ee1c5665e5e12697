"""The decode step's KV cache: transformers' StaticCache, built with whichever constructor a version has, and the
step state some versions keep inside it.

transformers 5.x does not write a step's keys and values at the positions it is given: each StaticLayer advances its
own `cumulative_length` tensor by the tokens it is handed, and both the slot written and the slots attended follow
that counter. A step run twice (a measuring run before tracing, two attention variants on the same step, timed
replays of a captured step) would therefore append its token twice, and every later token would see a sequence that
was never generated. `mark` saves that state (every tensor of a layer other than its keys and values: the counters,
and a recurrent layer's states) before a step; `rewind` puts it back, in place because a captured graph reads it at
its addresses, before each further run of the same step. Caches without such state (transformers 4.x, which writes
at the positions given) mark nothing.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn

_KV = ("keys", "values")  # a layer's cache proper: rewriting a slot with the same step's values needs no rewind


def static_cache(model: nn.Module, batch: int, max_len: int, device: torch.device, dtype: torch.dtype):
    """A transformers StaticCache built with whichever constructor this version has, or None if there is none."""
    try:
        from transformers import StaticCache
    except ImportError:
        return None
    if not getattr(model, "_supports_static_cache", True):  # 4.x flag; 5.x dropped it (every model supports it)
        return None
    params = inspect.signature(StaticCache.__init__).parameters
    kw = {"config": model.config, "max_cache_len": max_len}
    batch_arg = "batch_size" if "batch_size" in params else "max_batch_size"
    for name, value in ((batch_arg, batch), ("device", device), ("dtype", dtype)):
        if name in params:
            kw[name] = value
    return StaticCache(**kw)


def step_state(cache) -> list[torch.Tensor]:
    """The tensors a step advances besides its keys and values (see the module docstring), in a fixed order."""
    return [t for layer in getattr(cache, "layers", None) or ()
            for name, t in sorted(vars(layer).items()) if torch.is_tensor(t) and name not in _KV]


def mark(cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The cache's step state and a copy of it, taken before a step that may run more than once."""
    state = step_state(cache)
    return state, [t.clone() for t in state]


def rewind(marked: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
    """The step state back to what `mark` saw, in place (one foreach copy: the timed replays each pay it alike)."""
    state, saved = marked
    if state:
        torch._foreach_copy_(state, saved)
