"""`automp::unscale_marker`: an identity op that tells the precision pass "gradients are unscaled from here on".

Code that runs after unscaling — clipping, optimizer updates compiled into a graph — must stay FP32: an Adam update
of 1e-8 relative size vanishes in bf16. The paint pass treats everything downstream of this op as FP32.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("automp::unscale_marker", mutates_args=())
def unscale_marker(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@unscale_marker.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return grad


unscale_marker.register_autograd(_backward)
