"""Hand attention its low-precision inputs before AOTAutograd traces it.

AOTAutograd picks the fused attention kernel from the dtypes it sees while tracing: FP32 q/k/v get the
memory-efficient kernel, which on Hopper is much slower than FlashAttention and cannot be swapped afterwards
(forward and backward ops, their saved statistics and RNG state differ). Casting q/k/v at the torch level, where
the user wrote `scaled_dot_product_attention`, lets the trace choose the flash kernel, exactly as under autocast.
The output is cast back to the input dtype so the rest of the graph sees what it saw before; the precision pass
then removes that cast pair when the consumer is low precision too.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def _example(n) -> torch.Tensor | None:
    v = n.meta.get("example_value") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def lower_attention_inputs(gm: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
    """A Dynamo-level graph pass (GraphModule -> GraphModule): q, k, v (and a float mask) of every FP32 attention call
    go to `dtype`; its output returns to FP32. Calls whose inputs are not FP32 are left alone."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _SDPA or len(n.args) < 3:
            continue
        q = _example(n.args[0])
        if q is None or q.dtype != torch.float32:
            continue
        with gm.graph.inserting_before(n):
            new_args = [gm.graph.call_method("to", (a, dtype)) if i < 3 else a for i, a in enumerate(n.args)]
            mask = n.kwargs.get("attn_mask")
            kwargs = dict(n.kwargs)
            if isinstance(mask, fx.Node) and _example(mask) is not None and _example(mask).is_floating_point():
                kwargs["attn_mask"] = gm.graph.call_method("to", (mask, dtype))
        n.args, n.kwargs = tuple(new_args), kwargs
        with gm.graph.inserting_after(n):
            back = gm.graph.call_method("to", (n, torch.float32))
        n.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
