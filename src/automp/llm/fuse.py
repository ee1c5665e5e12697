"""One kernel call for the quantized linears that read one activation: q/k/v, and the MLP's gate/up.

At batch 1 a weight-only GEMV of a Llama layer's size takes about as long whatever its N: it is bound by launch and
reduction latency, not by its bytes. A Llama layer makes seven (q, k, v, o, gate, up, down); q/k/v read the same
normed activation, and so do gate/up, so one GEMV over the concatenated rows (N = q+k+v, N = gate+up) does their work
in one call: 4 calls per layer instead of 7, the same bytes read.

`fuse_projections(model)` concatenates each such group's packed codes, scales (and biases) row-wise (rows are output
features in automp.kernels.quant's layouts) into one tensor each, and makes every member's `qw` / `scales` / `bias`
buffer a row-slice view of it: no extra memory, and the state_dict (names, shapes, values) is what it was, so
automp.llm.store saves and loads the same files. The members share a `FusedGroup`, a plain Python object (not a
module: it is in no state_dict, named_modules or parameters) holding the fused tensors, each member's row range and a
one-entry cache: the first member called on an input runs the fused kernel and keeps (input, output); the others,
called on the same tensor object, take their slice of that output; once every member has taken its slice the cache
is emptied, so no tensor outlives one forward and nothing is carried from one compiled / CUDA-graph call to the next.
Any call order works, and a member called on another input (or alone, or twice) computes that input afresh.

Under torch.compile (dynamic=False, as automp.llm.generate's decode step runs it) Dynamo inlines the cache logic: the
identity test `cached is x` is decided at trace time, the fused kernel appears once per group in the graph, and the
cache's attribute writes are replayed after the graph as side effects; the last member leaves the cache empty, so
the state every call starts from (and the guards on it) is the same and nothing recompiles.

Results: the members' rows are computed by the same kernels on the same rows, so on the CPU (the torch reference, or
the Triton interpreter's one tile configuration) fused and unfused outputs are bitwise equal. On a GPU the GEMV
autotuner keys on N and may pick another K tile (or K split) for the fused N, which changes the fp32 summation order:
decode (GEMV) outputs can then differ from the unfused ones in their last fp16 bits, a rounding difference and not a
different computation. Decoding gets faster for the reason above: fewer kernel calls per layer, the same bytes read.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from automp.quant.archs import arch_of
from automp.quant.causal_lm import QuantConfig
from automp.quant.weight_only import WeightOnlyLinear, project


class FusedGroup:
    """The fused tensors of one group of WeightOnlyLinears and the one-entry cache of its output (see the module doc).

    Not an nn.Module on purpose: the members' own buffers are what is saved and loaded."""

    def __init__(self, qw: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 bounds: tuple[tuple[int, int], ...]):
        self.qw, self.scales, self.bias, self.dtype = qw, scales, bias, dtype
        self.bounds = bounds                         # member i's output rows [start, end)
        self.full = (1 << len(bounds)) - 1           # bit i: member i has taken its slice of the cached output
        self.active = True
        self.x = self.y = self.version = None
        self.taken = 0

    def __call__(self, slot: int, x: torch.Tensor) -> torch.Tensor:
        compiling = torch.compiler.is_compiling()
        # In eager mode also the version counter: an in-place write to x between two members' calls means a new
        # input. (Under Dynamo reading it breaks the graph; inference tensors have none.)
        version = None if compiling or x.is_inference() else x._version
        if self.x is not x or self.version != version:
            self.x, self.y, self.version = x, project(x, self.qw, self.scales, self.bias, None, self.dtype), version
            self.taken = 0
        y = self.y
        self.taken |= 1 << slot
        if self.taken == self.full:  # every member has its slice: hold nothing past this forward
            self.x = self.y = self.version = None
            self.taken = 0
        start, end = self.bounds[slot]
        return y[..., start:end]

    def dissolve(self) -> None:
        """Stop serving the members (one of them got new tensors) and let go of the fused tensors: the members'
        views keep what they still use."""
        self.active = False
        self.qw = self.scales = self.bias = self.x = self.y = self.version = None
        self.taken = 0


def _fusable(members: list[nn.Module]) -> bool:
    """WeightOnlyLinears that one kernel call can serve: same kernel arguments but N, and no input scale (AWQ folds the
    scale of these groups into the norm before them, so it is None there)."""
    if not all(isinstance(m, WeightOnlyLinear) for m in members):
        return False
    first = members[0]
    same = ("bits", "group_size", "in_features", "dtype")
    for m in members:
        if any(getattr(m, a) != getattr(first, a) for a in same) or m.input_scale is not None:
            return False
        if m.qw.is_meta or m.qw.device != first.qw.device or m.qw.dtype != first.qw.dtype \
                or m.scales.dtype != first.scales.dtype or m.scales.shape[1] != first.scales.shape[1] \
                or m.qw.shape[1] != first.qw.shape[1] or m.scales.device != first.qw.device:
            return False
        if (m.bias is None) != (first.bias is None):
            return False
        if m.bias is not None and (m.bias.dtype != first.bias.dtype or m.bias.device != first.qw.device):
            return False
    return True


def _is_fused(members: list[nn.Module]) -> bool:
    group = getattr(members[0], "_fused", None)
    return group is not None and group.active and len(group.bounds) == len(members) and \
        all(getattr(m, "_fused", None) is group and m._fused_slot == i for i, m in enumerate(members))


def _fuse(members: list[WeightOnlyLinear]) -> None:
    with torch.no_grad():
        qw = torch.cat([m.qw for m in members])
        scales = torch.cat([m.scales for m in members])
        bias = torch.cat([m.bias for m in members]) if members[0].bias is not None else None
    bounds, start = [], 0
    for m in members:
        bounds.append((start, start + m.qw.shape[0]))
        start += m.qw.shape[0]
    group = FusedGroup(qw, scales, bias, members[0].dtype, tuple(bounds))
    for i, (m, (s, e)) in enumerate(zip(members, bounds)):
        m._unfuse()  # an earlier group of this member, if any, stops serving the others too
        m._buffers["qw"], m._buffers["scales"] = qw[s:e], scales[s:e]  # not setattr: that would unfuse
        if bias is not None:
            m._buffers["bias"] = bias[s:e]
        m.__dict__["_fused"], m.__dict__["_fused_slot"] = group, i


def fuse_projections(model: nn.Module) -> int:
    """Fuse every group of >= 2 quantized linears of `model` that read one activation; returns how many groups were
    fused now (0 when all already are: idempotent). Does nothing on a model not quantized by automp.llm.quantize or
    quantized with fuse=False. A group whose members differ in anything the kernel call shares (bits, group size,
    K, dtype, device, bias or not) or that has an AWQ input scale stays as it is."""
    config = getattr(model, "automp_quant", None)
    if not isinstance(config, QuantConfig) or not config.fuse:
        return 0
    arch = arch_of(model)
    fused = 0
    for block in model.get_submodule(arch.blocks):
        for g in arch.groups:
            if len(g.linears) < 2:
                continue
            members = [block.get_submodule(p) for p in g.linears]
            if _fusable(members) and not _is_fused(members):
                _fuse(members)
                fused += 1
    return fused


def fused_groups(model: nn.Module) -> list[FusedGroup]:
    """The active groups of `model`, each once (for tests and reports)."""
    seen: dict[int, FusedGroup] = {}
    for m in model.modules():
        group = getattr(m, "_fused", None) if isinstance(m, WeightOnlyLinear) else None
        if group is not None and group.active:
            seen.setdefault(id(group), group)
    return list(seen.values())
