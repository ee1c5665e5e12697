"""Modules whose input gradient the script takes, maybe twice, stay off torch.compile.

A gradient penalty (WGAN-GP), a physics-informed network or an input-saliency loss differentiates a module's output
with respect to its input with `create_graph=True`, then backpropagates through that gradient. AOTAutograd's
backward can be run only once: through a compiled module the script's own `torch.autograd.grad` call raises
"torch.compile with aot_autograd does not currently support double backward", inside the script's backward, where
automp can no longer switch paths. The sign is visible earlier, at the module's call: its input is a leaf tensor
that requires grad (the script asked for gradients with respect to that input, not to parameters). Such a module
runs only the eager paths; a plain GAN's discriminator, whose input is the generator's output (not a leaf), keeps
every path. A parameter passed as an input does not count: its gradient is the usual one.

A gradient of a gradient with respect to parameters (MAML-style meta-learning) shows nothing at the call. There the
script's backward fails once: `automp run` then prints what happened and how to run now (`--path eager`), and
records it with the module's verdict, so the next run times only the eager paths for it.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn as nn

REASON = ("called with an input that is a leaf tensor requiring grad (a gradient with respect to the input, as in "
          "a gradient penalty or a physics-informed loss): torch.compile's backward cannot be differentiated again, "
          "so it runs on the eager paths only")
REASON_CRASHED = ("an earlier run differentiated a gradient through its compiled graph (create_graph=True), which "
                  "torch.compile's backward cannot do: it runs on the eager paths only")


def asks_input_grad(args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether a call's top-level tensor arguments include a leaf that requires grad (parameters aside)."""
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor) and a.requires_grad and a.is_leaf and not isinstance(a, nn.Parameter):
            return True
    return False


# What AOTAutograd raises when a backward through a compiled graph is itself differentiated (create_graph=True)
_DOUBLE_BACKWARD = ("does not currently support double backward", "requires create_graph=False")
HINT = ("automp: this script differentiates a gradient (create_graph=True) through a module automp ran as a "
        "torch.compile'd graph, whose backward cannot be differentiated again. automp has recorded it: the next "
        "run times only the eager paths for {modules}. To run now, `automp run --path eager` keeps every module "
        "off torch.compile.")


def is_double_backward(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from, is AOTAutograd refusing a double backward."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RuntimeError) and any(m in str(e) for m in _DOUBLE_BACKWARD):
            return True
        e = e.__cause__ or e.__context__
    return False
