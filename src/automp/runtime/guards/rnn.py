"""nn.LSTM/GRU/RNN stay one fused cuDNN op in low precision inside a compiled root, not thousands of unrolled ops.

The function keeps the name `_rnn_call`: Dynamo's graph-break reason names it, and graph_breaks.py reports that break
as automp's own by it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from automp.runtime import call_state
from automp.runtime.decisions import Route
from automp.runtime.compiled_paths import ORIG_CALL
from automp.runtime.outputs import restore_float32


@torch._dynamo.disable
def _rnn_call(module: nn.RNNBase, *args: Any, **kwargs: Any) -> Any:
    """nn.LSTM/GRU/RNN calls while a session is open. Traced inside a compiled root, the RNN would be unrolled into
    thousands of small ops and casts (or, by Dynamo's default, break the graph inside our call wrapper, which
    leaves the rest of the forward uncompiled). As a Dynamo-disabled function called straight from the user's
    forward, it makes a clean graph break at the call: the code before and after is compiled through the pass,
    and the RNN runs here as ONE fused cuDNN op in low precision, returning FP32 as the graph expects."""
    state = call_state.local
    if getattr(state, "depth", 0) > 0 and getattr(state, "path", None) is Route.COMPILED:
        device = next(module.parameters()).device
        if (device.type, state.low) not in NO_LOW_PRECISION_RNN:
            try:
                with torch.autocast(device.type, dtype=state.low):
                    out = ORIG_CALL(module, *args, **kwargs)
                return restore_float32(out)
            except RuntimeError as e:
                if device.type != "cpu" or "primitive" not in str(e):
                    raise
                NO_LOW_PRECISION_RNN.add((device.type, state.low))
        return ORIG_CALL(module, *args, **kwargs)  # FP32, as written: the graph around it expects FP32 anyway
    return nn.Module.__call__(module, *args, **kwargs)  # a root RNN, or another path: the session decides


# (device type, dtype) pairs whose fused RNN kernels this machine lacks: oneDNN builds no bf16 LSTM on a CPU without
# AVX-512 ("could not create a primitive descriptor"). A property of the hardware, so known process-wide: the RNN runs
# FP32 there, as the script wrote it, and the rest of the model keeps its low precision.
NO_LOW_PRECISION_RNN: set[tuple[str, torch.dtype]] = set()
