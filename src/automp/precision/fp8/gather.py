"""FP8 all-gather of FSDP2 weights: a layer that runs FP8 under FSDP2 has its weight all-gathered in float8 (one
byte per value, half of bf16's, a quarter of FP32's), as torchao's float8 training does with
`enable_fsdp_float8_all_gather`.

Each rank casts its own shard before the all-gather, with the scale of the whole weight (its amax, all-reduced over
the shard group), and the gathered FP8 values reach the layer as `fp8.Fp8Weight`, which `fp8.cast` takes as they are.
These are the very values the layer's FP8 GEMM would cast the bf16-gathered weight to: the same formula
(`fp8.cast_scaled`) on the same numbers, in the parameter dtype FSDP2's mixed-precision policy gathers in. So the
arithmetic of a step is unchanged; only the bytes on the wire shrink. Tensorwise scaling only: rowwise casts the
weight along one axis in forward and the other in backward, so there is no one FP8 copy to gather.

torchao converts the weights before `fully_shard`; automp chooses its FP8 layers at the model's first call, long after
the script sharded it. So it rewraps FSDP2's parameters in place: each chosen weight's local shard becomes an
`_Fp8Shard` (FSDP2's all-gather extension: fsdp_pre_all_gather / fsdp_post_all_gather), and FSDP2's per-parameter
all-gather state is reset so that its buffers are made again for FP8. That reaches into FSDP2's parameter objects
(`FSDPParam`), whose layout torch 2.11 to 2.13 share; a torch where they differ gets `unsupported` (bf16 all-gather,
reported), never a wrong gather. Off again when the model leaves its FP8 path (`Fp8Gather` says when a switch
takes effect).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_map_only

from automp.precision.fp8 import layers as fp8

# rules, per FP8 layer (report data)
FP8_GATHER = "fp8-all-gather"
ROWWISE = "bf16-all-gather-rowwise"  # no single FP8 copy of the weight serves both directions
UNSUPPORTED = "bf16-all-gather-unsupported"  # tied weight, CPU offload, tensor parallelism, dim-1 sharding, ...
OFF = "bf16-all-gather-configured"  # fp8_all_gather=False


class _Fp8Shard(torch.Tensor):
    """A rank's shard of a weight that FSDP2 all-gathers in FP8. It reads and updates as the shard it wraps (the
    optimizer's in-place steps, state_dict and DTensor's collectives see plain tensors) and gives FSDP2's all-gather
    the shard cast to FP8 with the whole weight's scale.

    gather_dtype: the dtype FSDP2 gathers in (its MixedPrecisionPolicy's param_dtype, else the shard's own); group: the
    shard group. amax: the whole weight's amax, all-reduced after the optimizer's step for every FP8 shard at once
    (`precompute`), or None: then the all-gather all-reduces this weight's own. Any in-place op on the shard (the
    next step, load_state_dict) clears it."""

    tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, dtype: torch.dtype, group: Any) -> "_Fp8Shard":
        return torch.Tensor._make_wrapper_subclass(cls, tensor.shape, strides=tensor.stride(), dtype=tensor.dtype,
                                                   storage_offset=tensor.storage_offset(), device=tensor.device)

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype, group: Any) -> None:
        self.tensor, self.gather_dtype, self.group = tensor, dtype, group
        self.amax: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"_Fp8Shard({self.tensor!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        mutable = func._schema.is_mutable

        def unwrap(shard: _Fp8Shard) -> torch.Tensor:
            if mutable:  # conservative: any shard an in-place op touches may have changed
                shard.amax = None
            return shard.tensor

        args, kwargs = tree_map_only(_Fp8Shard, unwrap, (args, kwargs or {}))
        return func(*args, **kwargs)

    def local_amax(self) -> torch.Tensor:
        """max |shard| in the gather dtype, as fp32 (rounding to nearest is monotonic: the amax of the rounded shard
        is the rounded amax, without a rounded copy)."""
        if not self.tensor.numel():
            return torch.zeros((), device=self.tensor.device)
        return self.tensor.abs().amax().to(self.gather_dtype).float()

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: Any, module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        amax = self.amax
        if amax is None:
            amax = self.local_amax()
            torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=self.group)
            self.amax = amax
        t = self.tensor.to(self.gather_dtype)  # the numbers FSDP2 would gather, and the layer's FP8 cast start from
        t8, inv_scale = fp8.cast_scaled(t, fp8.E4M3, amax)
        data = t8.contiguous().view(torch.uint8)  # bytes: every backend gathers them, FP8 dtypes or not
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 gathers equal shards; the last ranks' are padded
        if data.shape[0] < rows:
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data,), inv_scale

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], inv_scale: torch.Tensor,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None) -> Any:
        (data,) = outputs
        if out is not None:  # later gathers refill the same buffer, which `out` views: only the scale is new
            out.inv_scale = inv_scale
            return None
        return fp8.Fp8Weight(data.view(fp8.E4M3), inv_scale, param_dtype), ()


def precompute(shards: list[_Fp8Shard]) -> None:
    """Every FP8 shard's whole-weight amax in one all-reduce per shard group (torchao's
    precompute_float8_dynamic_scale_for_fsdp): after the optimizer's step, instead of one all-reduce per weight in
    each all-gather. Every rank calls it at the same point (the step) with the same shards."""
    groups: dict[int, list[_Fp8Shard]] = {}
    for shard in shards:
        groups.setdefault(id(shard.group), []).append(shard)
    for members in groups.values():
        amax = torch.stack([s.local_amax() for s in members])
        torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX, group=members[0].group)
        for shard, value in zip(members, amax.unbind()):
            shard.amax = value


def _fsdp_params(root: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(owning FSDP2 module, FSDPParam) of every parameter FSDP2 manages under `root`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    found = []
    for owner in root.modules():
        if isinstance(owner, FSDPModule):
            group = owner._get_fsdp_state()._fsdp_param_group
            found += [(owner, p) for p in (group.fsdp_params if group is not None else ())]
    return found


def _why_not(layer: nn.Module, param: Any) -> str | None:
    """Why FSDP2's FSDPParam `param` (a layer's weight) cannot gather in FP8 here, or None."""
    needed = ("sharded_param", "sharded_state", "all_gather_outputs", "_init_extensions", "mesh_info",
              "fsdp_placement", "mp_policy")
    if not all(hasattr(param, a) for a in needed):
        return "this torch's FSDP2 keeps its parameters differently"
    if not isinstance(layer, nn.Linear):  # transformers' Conv1D: its weight is (in, out), sharded along in
        return f"{type(layer).__name__} stores its weight transposed"
    if param._module_info.shared_modules:
        return "the weight is shared with another module (tied)"
    if getattr(param, "offload_to_cpu", False) or getattr(param, "is_dtensor", False):
        return "CPU offload or tensor parallelism"
    if param.post_forward_mesh_info not in (None, param.mesh_info):
        return "resharded to another mesh after forward"
    if param.mesh_info.mesh.ndim > 2:
        return "a mesh of more than two dimensions"
    if param.fsdp_placement.dim != 0:
        return "sharded along dim 1"
    return None


class Fp8Gather:
    """The FP8 all-gather of one root's FP8 layers under FSDP2, off until asked for. `rules`: per layer name, the
    rule that decided its all-gather (FP8_GATHER, ROWWISE or UNSUPPORTED), for the report.

    A switch replaces FSDP2's all-gather buffers of those weights, and a forward whose backward is still to run has
    saved views of the old ones: so a switch waits for a point where no backward is pending. `want` takes effect at
    once where the caller knows it is such a point (the root's first call), else after the next optimizer step,
    where a training iteration ends; `set` switches at once (tests, and the end of the run)."""

    def __init__(self, root: nn.Module, layers: dict[str, nn.Module], recipe: str | dict[str, str],
                 enabled: bool = True) -> None:
        by_layer = {id(p._module_info.module): (owner, p) for owner, p in _fsdp_params(root)
                    if p._module_info.param_name == "weight"}
        self.rules: dict[str, str] = {}
        self.why: dict[str, str] = {}
        self._params: list[tuple[nn.Module, Any]] = []
        for name, layer in layers.items():
            if id(layer) not in by_layer:
                continue  # not sharded by FSDP2 (DDP, or a layer outside every fully_shard)
            owner, param = by_layer[id(layer)]
            if not enabled:
                self.rules[name] = OFF
                continue
            rowwise = (recipe if isinstance(recipe, str) else recipe[name]) != "tensorwise"  # or a layer's own
            why = "rowwise scaling casts the weight per row and per column" if rowwise else _why_not(layer, param)
            self.rules[name] = FP8_GATHER if why is None else ROWWISE if rowwise else UNSUPPORTED
            if why is None:
                self._params.append((owner, param))
            else:
                self.why[name] = why
        self.on = self.wanted = False
        self._hooks: list[Any] = []
        self._updates: dict[tuple[int, int], bool] = {}  # (optimizer, its groups): whether it updates these weights
        self._step_hook = register_optimizer_step_post_hook(self._after_step) if self._params else None

    def want(self, on: bool, now: bool = False) -> None:
        """On every rank alike: gather the FP8 layers' weights in FP8 (on) or in FSDP2's parameter dtype (off), from
        now (`now`: no backward is pending) or from the next optimizer step."""
        self.wanted = on
        if now:
            self.set(on)

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """After the step of an optimizer that updates these weights (a step of another one, which some ranks may
        run alone, must not start a collective)."""
        key = (id(optimizer), len(optimizer.param_groups))
        if key not in self._updates:
            mine = {id(p.sharded_param) for _, p in self._params}
            self._updates[key] = any(id(q) in mine for group in optimizer.param_groups for q in group["params"])
        if not self._updates[key]:
            return
        if self.wanted != self.on:
            self.set(self.wanted)
        if self.on:
            precompute(self.shards())

    def set(self, on: bool) -> None:
        """Switch now, on every rank alike, with no backward pending. Parameters held unsharded (the root's, after a
        forward without backward) are resharded first, through FSDP2's public `reshard`."""
        self.wanted = on
        if on == self.on or not self._params:  # nothing to gather in FP8: stays off
            return
        for owner in {id(o): o for o, p in self._params if not _sharded(p)}.values():
            owner.reshard()
        for _, param in self._params:
            _wrap(param, on)
        if on:  # load_state_dict: FSDP2 re-pads the plain shard, then the shard is wrapped again
            self._hooks = [hook for _, p in self._params for hook in (
                p._module_info.module.register_load_state_dict_pre_hook(_unwrapper(p)),
                p._module_info.module.register_load_state_dict_post_hook(_rewrapper(p)))]
        else:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
        self.on = on

    def close(self) -> None:
        """FSDP2's own gather again, for good (automp.disable)."""
        self.set(False)
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def shards(self) -> list[_Fp8Shard]:
        return [p.sharded_param._local_tensor for _, p in self._params
                if isinstance(p.sharded_param._local_tensor, _Fp8Shard)]

    def summary(self) -> dict[str, int]:
        """How many FP8 layers each rule decided (the report's view)."""
        return dict(Counter(self.rules.values()))


def _sharded(param: Any) -> bool:
    return param.sharded_state.name == "SHARDED"


def _shard(param: Any, local: torch.Tensor) -> _Fp8Shard:
    return _Fp8Shard(local, param.mp_policy.param_dtype or local.dtype, param.mesh_info.shard_process_group)


def _wrap(param: Any, on: bool) -> None:
    local = param.sharded_param._local_tensor
    if isinstance(local, _Fp8Shard) == on:
        return
    param.sharded_param._local_tensor = _shard(param, local) if on else local.tensor
    param._init_extensions()
    param.all_gather_outputs = []  # made again at the next all-gather, in the new dtype and size
    if hasattr(param, "_unsharded_param"):
        del param._unsharded_param


def _unwrapper(param: Any) -> Any:
    def hook(*_: Any, **__: Any) -> None:
        local = param.sharded_param._local_tensor
        if isinstance(local, _Fp8Shard):
            param.sharded_param._local_tensor = local.tensor
    return hook


def _rewrapper(param: Any) -> Any:
    def hook(*_: Any) -> None:
        local = param.sharded_param._local_tensor
        if not isinstance(local, _Fp8Shard):
            param.sharded_param._local_tensor = _shard(param, local)
    return hook
