"""Loss-scaling support: one fused pass that unscales every gradient in place and flags inf/nan, and a cast kernel.

A model has hundreds of gradient tensors; one launch per tensor would cost more in launch latency than the pass
itself. Instead the host builds a chunk table (address, start, numel) once per distinct set of tensors and a single
launch walks it: each program takes one chunk of one tensor, casts the integer address to a typed pointer, scales
the chunk and, if it saw a non-finite value, writes 1.0 into `found_inf`. Tensors of one dtype share a launch.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl

from automp.kernels.gemv import INTERPRET

CHUNK = 1024 if INTERPRET else 4096
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # a jit global must be a constexpr
_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLE_CACHE = 16


@triton.jit
def _unscale_check_kernel(table_ptr, ref_ptr, inv_scale_ptr, found_ptr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    addr = tl.load(table_ptr + 3 * pid)
    start = tl.load(table_ptr + 3 * pid + 1)
    numel = tl.load(table_ptr + 3 * pid + 2)
    ptr = addr.to(ref_ptr.dtype)  # int64 address -> pointer to this launch's dtype
    offs = start + tl.arange(0, CHUNK)
    mask = offs < numel
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.load(inv_scale_ptr).to(tl.float32)
    tl.store(ptr + offs, (x * inv).to(ref_ptr.dtype.element_ty), mask=mask)
    bad = ~(tl.abs(x) <= FLT_MAX)  # true for +-inf and for nan (every comparison with nan is false)
    if tl.max(bad.to(tl.int32), axis=0) > 0:
        tl.store(found_ptr, 1.0)


def _chunk_table(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[(address, first element, numel) per CHUNK], cached by (address, numel) so a training loop builds it once."""
    key = tuple((t.data_ptr(), t.numel()) for t in tensors)
    table = _TABLES.get(key)
    if table is not None:
        _TABLES.move_to_end(key)
        return table
    # vectorised: a 124M-parameter model has ~30K chunks, a Python loop over them costs milliseconds per step
    addr, numel = torch.tensor(key, dtype=torch.int64).unbind(1)
    chunks = (numel + CHUNK - 1) // CHUNK
    first = torch.cumsum(chunks, 0) - chunks
    owner = torch.repeat_interleave(torch.arange(len(key)), chunks)
    start = (torch.arange(int(chunks.sum())) - first[owner]) * CHUNK
    table = torch.stack([addr[owner], start, numel[owner]], 1).to(tensors[0].device)
    _TABLES[key] = table
    if len(_TABLES) > _TABLE_CACHE:
        _TABLES.popitem(last=False)
    return table


def unscale_and_check_(tensors: list[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """Launch once per dtype over contiguous, non-empty `tensors` (validated by ops.py); sets found_inf to 1.0."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        table = _chunk_table(group)
        _unscale_check_kernel[(table.shape[0],)](table, group[0], inv_scale, found_inf, CHUNK=CHUNK)


@triton.jit
def _cast_kernel(x_ptr, y_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x.to(y_ptr.dtype.element_ty), mask=mask)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous x -> new tensor of `dtype`: round to nearest even on the GPU, like Tensor.to (the Triton
    interpreter truncates fp32 -> bf16, so CPU-interpreted results may differ by one bf16 ulp)."""
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    block = 1024 if INTERPRET else 4096
    if x.numel():
        _cast_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block, num_warps=4 if INTERPRET else 8)
    return y
