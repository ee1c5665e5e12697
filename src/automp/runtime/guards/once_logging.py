"""Log-once calls no longer split compiled graphs.

transformers models call `logger.warning_once(...)` inside forward (GPT-2's loss, for one). Dynamo cannot trace a
Logger method, so each such call is a graph break: the forward becomes several graphs, the loss is compiled apart
from the model and Inductor cannot fuse across the seam. Without the break automp's compiled GPT-2 step is clearly
faster (the hand-written anchor gains nothing from the same switch), at the price of
more peak memory, still well under the FP32 script's. That price is torch's pytorch/pytorch#131794: with the loss in the
same graph, the logits become an output nobody differentiates, and AOTAutograd (through torch 2.13) hands the
backward a materialized zero gradient of their size (checked on a CPU: the single graph's backward takes a [B, T,
vocab] tangent, the split graphs' do not). A once-only message has been printed by the eager calls that precede
compilation (automp's trial runs the module eagerly first), so dropping it from compiled graphs loses nothing a user
would see again; plain `warning`/`info` calls, which print every time, are left alone.

Dynamo's documented switch for this is `torch._dynamo.config.ignore_logging_functions`. torch 2.11 then fails to
JSON-dump its own config for its compile metrics (it JSON-dumps, or sorts, the set of functions) and logs that
TypeError at error level on every compile and every run of a compiled graph (a cosmetic bug fixed in later
releases); those records are filtered out while automp holds the setting.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

ONCE_METHODS = ("warning_once", "info_once")  # what transformers adds to logging.Logger
_METRICS_LOGGER = "torch._dynamo.metrics_context"


class _DropConfigDumpError(logging.Filter):
    """Drops only the metrics logger's "Unexpected exception logging ... metrics" records caused by a TypeError
    (the config dump); any other record of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, TypeError) and record.getMessage().startswith("Unexpected exception logging"))


def ignore_once_logging() -> Callable[[], None]:
    """Tell Dynamo to treat the log-once methods present now as no-ops in graphs; returns the undo. Idempotent:
    methods already ignored (by the user or an earlier call) are left as they are and not undone."""
    ignored = getattr(torch._dynamo.config, "ignore_logging_functions", None)
    if ignored is None:  # a torch without the switch: the graph breaks stay
        return lambda: None
    added = [fn for fn in (vars(logging.Logger).get(name) for name in ONCE_METHODS)
             if fn is not None and fn not in ignored]
    if not added:
        return lambda: None
    ignored.update(added)
    quiet = _DropConfigDumpError()
    logging.getLogger(_METRICS_LOGGER).addFilter(quiet)

    def undo() -> None:
        ignored.difference_update(added)
        logging.getLogger(_METRICS_LOGGER).removeFilter(quiet)

    return undo
