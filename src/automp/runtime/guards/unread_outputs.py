"""Fields of a model's output that the script never reads leave the compiled backward.

Why: a transformers model called with labels returns its loss and its logits, and a training loop reads the loss.
With the loss computed inside the compiled graph, the logits are an output that requires grad but never receives one,
and AOTAutograd (pytorch/pytorch#131794, open through torch 2.13) hands the compiled backward a materialized zero
gradient of their size: batch x sequence x vocabulary, the largest tensor of a language model's step, at its peak. A
field detached inside the compiled function is an output without a gradient, so the backward takes none for it.

Which fields: the tensors that required grad in the module's outputs and were not read by the script
(automp.runtime.outputs sees every read of a ModelOutput field: attribute, key, to_tuple, values, ...) in the calls
before the module's first compilation, i.e. the trial's eager steps. Decided once per module, at its first compilation,
and cached with the trial's verdict, so a later run of the same script detaches the same fields from its first call.
Where the first compilation comes before any call was seen (a GPU trial starts on the compiled path the hand-written
loop runs; a forced path), a language model given `labels` has its `logits` detached on a guess (`guess_unread`): the
loss is its output, and its logits are the largest tensor of the step. Guessed wrong, the read below brings them back.
Otherwise nothing is detached (a second compilation to detach later would cost more than it saves in a short run).

Never a missing gradient: a detached field read before the backward of its call has run may feed a loss. Such a
read re-runs the call with every field attached (the compiled function is guarded on the detached names, so it
recompiles once), the output object takes the new values of all its fields, and from then on nothing of that module
is detached; the report says which field and why. A field read after its call's backward (metrics, logging after
the step) has the same value either way and is returned as it is; where it was detached on a guess, the read
disproves the guess: that value is copied (a CUDA graph's next replay would overwrite it) and nothing is detached
from the next call on. Not covered: a second backward through the same
graph (retain_graph=True) that starts from a field read after the first backward.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class FieldReads:
    """Per root module: its ModelOutput fields seen requiring grad, those the script read, and the fields its
    compiled functions detach (read while Dynamo traces them, so a change recompiles)."""
    seen: set[str] = field(default_factory=set)
    read: set[str] = field(default_factory=set)
    detach: tuple[str, ...] = ()
    decided: bool = False
    guessed: bool = False  # detach came from guess_unread, before any call was seen
    reattached: str | None = None  # why detaching stopped, for the report
    on_reattach: Callable[[str], None] | None = field(default=None, repr=False, compare=False)

    def observe(self, out: Any) -> None:
        self.seen.update(k for k, v in dict.items(out) if isinstance(v, torch.Tensor) and v.requires_grad)

    def decide(self, guess: tuple[str, ...] = ()) -> tuple[str, ...]:
        """The fields to detach, fixed at the module's first compilation: the unread ones among those seen, or
        `guess` where no call was seen yet."""
        if not self.decided:
            self.decided = True
            self.guessed = not self.seen and bool(guess)
            self.detach = tuple(sorted(self.seen - self.read)) if self.seen else tuple(guess)
        return self.detach

    def reattach(self, name: str, before_backward: bool = True) -> None:
        self.detach = ()
        why = "detached on a guess (a language model given labels)" if self.guessed else (
            "detached (unread in the first calls)")
        self.reattached = (f"output field {name!r} was {why} and then read before its backward: that call ran again "
                           f"with every field attached, and does from now on" if before_backward else
                           f"output field {name!r} was {why} and then read after its backward: every field is "
                           f"attached from the next call on")
        if self.on_reattach is not None:
            self.on_reattach(self.reattached)


def guess_unread(module: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[str, ...]:
    """The fields a first call's outputs are guessed not to be read by: ("logits",) for a transformers model with an
    output layer (get_output_embeddings: causal and masked LMs) called with tensor `labels`, so that it computes its
    loss itself; else none. A classifier's logits are small and often read for metrics: not guessed."""
    head = getattr(module, "get_output_embeddings", None)
    if not isinstance(kwargs.get("labels"), torch.Tensor) or not callable(head):
        return ()
    try:
        return ("logits",) if isinstance(head(), torch.nn.Module) else ()
    except (AttributeError, NotImplementedError, TypeError):
        return ()


def detach_unread(out: Any, fields: FieldReads | None) -> Any:
    """Inside a compiled function: `out`'s fields named in fields.detach, detached (a ModelOutput is edited in
    place, as the module returned it)."""
    if fields is None or not fields.detach or not hasattr(out, "to_tuple"):
        return out
    for name in fields.detach:
        value = out.get(name)
        if isinstance(value, torch.Tensor):
            out[name] = value.detach()
    return out


class FieldWatch:
    """Attached to one returned output: records its reads and re-runs its call when a detached field is read
    before that call's backward."""

    def __init__(self, out: Any, fields: FieldReads, detached: tuple[str, ...],
                 rerun: Callable[[], Any] | None) -> None:
        self.fields, self.rerun = fields, rerun
        # A call without any output that requires grad (no_grad, evaluation, frozen model) had no gradient to lose:
        # its detached fields hold what the script would have had, and reading them never re-runs it.
        tracked = any(isinstance(v, torch.Tensor) and v.requires_grad for v in dict.values(out))
        self.detached = tuple(n for n in detached if tracked and isinstance(dict.get(out, n), torch.Tensor))
        self.backward_done = False
        if self.detached:
            fn = next((v.grad_fn for v in dict.values(out) if isinstance(v, torch.Tensor) and v.grad_fn is not None),
                      None)
            if fn is not None:
                ref = weakref.ref(self)
                fn.register_hook(lambda *_: _mark_done(ref))

    def on_read(self, out: Any, name: str) -> None:
        self.fields.read.add(name)
        if name not in self.detached:
            return
        if self.backward_done:
            if self.fields.guessed and self.fields.detach:
                # a guess the reads disprove: a field read after its backward (metrics kept across steps) must not
                # stay detached, whose value a CUDA graph's next replay would overwrite (outputs.out_of_pool copies
                # only what is attached); this one is copied now, and the next call compiles with every field attached
                out[name] = dict.__getitem__(out, name).clone()
                self.fields.reattach(name, before_backward=False)
                self.detached = ()
            return
        self.fields.reattach(name)
        self.detached = ()
        if self.rerun is None:
            raise RuntimeError(f"automp: output field {name!r} was computed without its gradient and cannot be "
                               f"recomputed")
        fresh = self.rerun()
        for key in list(dict.keys(fresh)):
            out[key] = dict.__getitem__(fresh, key)  # ModelOutput keeps attribute and item in step


def _mark_done(ref: "weakref.ref[FieldWatch]") -> None:
    watch = ref()
    if watch is not None:
        watch.backward_done = True
