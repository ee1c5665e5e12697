"""FP8 all-gather under FSDP2 (gloo, 3 CPU processes: one weight sharded unevenly, 80 rows over 3 ranks): FSDP2 hands
the FP8 layers Fp8Weight while it is on; a training run with it gives bitwise the losses of the same FP8 run gathering
bf16 (the same FP8 values, cast on each shard with the whole weight's scale, all-reduced once per optimizer step);
state_dict stays plain tensors;
load_state_dict's new weights are what the next step gathers; switching it off restores FSDP2's own gather. The same
bitwise agreement with FP32 parameters, unsharded-after-forward blocks, a checkpointed block and gradient
accumulation."""
import os

import pytest
import torch
import torch.nn as nn

from automp.precision.fp8 import gather as fp8_gather
from automp.precision.fp8 import layers as fp8
from tests import gloo
from tests.precision.fp8.test_layers import needs_scaled_mm

RANKS = 3


def _model(recipe: str) -> tuple[nn.Module, dict[str, nn.Module]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(32, 80), nn.GELU()), nn.Sequential(nn.Linear(80, 48), nn.GELU()),
                          nn.Linear(48, 16))
    layers = {"0.0": model[0][0], "1.0": model[1][0], "2": model[2]}
    for layer in layers.values():
        fp8.install(layer, recipe)
    return model, layers


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _fsdp(model: nn.Module, mesh, bf16: bool = True, **block_options) -> None:
    """fully_shard on the two blocks (with `block_options`), then on the root; under a bf16 MixedPrecisionPolicy
    unless bf16=False (FP32 parameters gathered as FP32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if bf16 else {}
    for block in model[:2]:
        fully_shard(block, mesh=mesh, **policy, **block_options)
    fully_shard(model, mesh=mesh, **policy)


def _worker(rank: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    gloo.join(rank, port, world_size=RANKS)
    mesh = init_device_mesh("cpu", (RANKS,))

    def run(gather: bool) -> dict:
        model, layers = _model("tensorwise")
        _fsdp(model, mesh)
        switch = fp8_gather.Fp8Gather(model, layers, "tensorwise")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        other = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
        gen = torch.Generator().manual_seed(10 + rank)
        seen: list[str] = []
        model[0][0].register_forward_pre_hook(lambda m, a: seen.append(type(m.weight).__name__))

        all_reduce, reduces = torch.distributed.all_reduce, []

        def counted(*args, **kwargs):
            reduces[-1] += 1
            return all_reduce(*args, **kwargs)

        def step(x: torch.Tensor) -> torch.Tensor:
            reduces.append(0)  # all-reduces in this forward (its all-gathers)
            torch.distributed.all_reduce = counted
            try:
                with fp8.active(), torch.autocast("cpu", torch.bfloat16):
                    return model(x).float()
            finally:
                torch.distributed.all_reduce = all_reduce

        losses = []
        for i in range(4):
            if i == 1:  # takes effect after this iteration's optimizer step
                switch.want(gather)
            x, y = torch.randn(48, 32, generator=gen), torch.randn(48, 16, generator=gen)
            loss = ((step(x) - y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if rank == 0:  # another optimizer's step on one rank: no collective may start there
                other.step()
            losses.append(loss.item())
        state = model.state_dict()
        local_types = sorted({type(v._local_tensor).__name__ for v in state.values()})
        model.load_state_dict({k: v * 2 for k, v in state.items()})
        reloaded = step(x)
        switch.set(False)
        after_off = step(x)
        return {"losses": losses, "seen": seen, "reduces": reduces, "rules": switch.rules, "local_types": local_types,
                "reloaded": reloaded, "after_off": after_off}

    def variant(gather: bool) -> list[float]:
        """FP32 parameters (no mixed-precision policy: the gather dtype is FP32), blocks kept unsharded after forward,
        the middle block checkpointed (recomputed in backward), two micro-batches per optimizer step."""
        model, layers = _model("tensorwise")
        model[1] = _Checkpointed(model[1])
        _fsdp(model, mesh, bf16=False, reshard_after_forward=False)
        switch = fp8_gather.Fp8Gather(model, layers, "tensorwise")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(20 + rank)
        losses, seen = [], []
        layers["1.0"].register_forward_pre_hook(lambda m, a: seen.append(type(m.weight).__name__))
        for i in range(4):
            if i == 1:
                switch.want(gather, now=True)  # no backward pending here
            for micro in range(2):
                x, y = torch.randn(48, 32, generator=gen), torch.randn(48, 16, generator=gen)
                with fp8.active():  # the checkpointed block recomputes in backward: FP8 there too
                    with torch.autocast("cpu", torch.bfloat16):
                        loss = ((model(x).float() - y) ** 2).mean()
                    if i == 2 and micro == 0:  # a backward is pending: off only after the step
                        switch.want(False)
                    (loss / 2).backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        return losses, seen

    def rules(recipe) -> dict[str, str]:  # one recipe for all, or each layer's own (fp8_recipe="auto")
        model, layers = _model("rowwise" if recipe == "rowwise" else "tensorwise")
        fully_shard(model, mesh=mesh)
        return fp8_gather.Fp8Gather(model, layers, recipe).rules

    try:
        torch.save({"off": run(False), "on": run(True), "variant": (variant(False), variant(True)),
                    "rowwise": rules("rowwise"),
                    "mixed": rules({"0.0": "tensorwise", "1.0": "rowwise", "2": "tensorwise"})},
                   os.path.join(out, f"{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.ranks
@needs_scaled_mm
def test_fp8_all_gather_gives_the_same_steps_as_bf16_gather(tmp_path):
    for r in gloo.spawn(_worker, tmp_path, nprocs=RANKS):
        on, off = r["on"], r["off"]
        assert on["rules"] == {n: fp8_gather.FP8_GATHER for n in ("0.0", "1.0", "2")}
        assert off["seen"] == ["Parameter"] * 6
        # asked for in the second iteration, on from the third (after its optimizer step); off for the last call
        assert on["seen"] == ["Parameter"] * 2 + ["Fp8Weight"] * 3 + ["Parameter"]
        # after an optimizer step no all-reduce in the all-gathers: the step's hook all-reduced every weight's amax
        # at once; after load_state_dict one per FP8 weight
        assert off["reduces"] == [0] * 6 and on["reduces"] == [0, 0, 0, 0, 3, 0]
        assert on["losses"] == off["losses"]  # bitwise: the same FP8 values and scales reach the same GEMMs
        assert on["local_types"] == ["Tensor"]  # checkpoints hold plain tensors, loadable without automp
        assert torch.equal(on["reloaded"], off["reloaded"])  # the loaded (doubled) weights, gathered in FP8
        assert torch.equal(on["after_off"], off["after_off"])
        (off_losses, off_seen), (on_losses, on_seen) = r["variant"]
        # per iteration two forwards and their two recomputations; on from the second, off after the third's step
        assert off_seen == ["Parameter"] * 16 and on_seen == ["Parameter"] * 4 + ["Fp8Weight"] * 8 + ["Parameter"] * 4
        assert on_losses == off_losses
        assert r["rowwise"] == {n: fp8_gather.ROWWISE for n in ("0.0", "1.0", "2")}
        assert r["mixed"] == {"0.0": fp8_gather.FP8_GATHER, "1.0": fp8_gather.ROWWISE, "2": fp8_gather.FP8_GATHER}


def test_layers_fsdp2_does_not_shard_are_left_alone():
    """Without fully_shard (one process, or DDP) there is nothing to gather: no rule, and switching on is a no-op."""
    model, layers = _model("tensorwise")
    switch = fp8_gather.Fp8Gather(model, layers, "tensorwise")
    assert switch.rules == {} and switch.summary() == {}
    switch.set(True)  # nothing to switch: a no-op, not an error
    assert all(type(layer.weight) is nn.Parameter for layer in layers.values())



def _hsdp_worker(rank: int, port: int, out: str) -> None:
    """HSDP: 4 ranks as 2 replicas x 2 shards; each shard group all-reduces its own weights' amax."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    gloo.join(rank, port, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def run(gather: bool) -> tuple[list[float], list[str], dict[str, str]]:
        model, layers = _model("tensorwise")
        _fsdp(model, mesh)
        switch = fp8_gather.Fp8Gather(model, layers, "tensorwise")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(30 + rank)
        losses, seen = [], []
        model[1][0].register_forward_pre_hook(lambda m, a: seen.append(type(m.weight).__name__))
        for i in range(3):
            switch.want(gather and i > 0, now=True)
            x, y = torch.randn(48, 32, generator=gen), torch.randn(48, 16, generator=gen)
            with fp8.active(), torch.autocast("cpu", torch.bfloat16):
                loss = ((model(x).float() - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        switch.close()
        return losses, seen, switch.rules

    def configured_off() -> dict[str, str]:  # fp8_all_gather=False: reported, and asking for it switches nothing
        model, layers = _model("tensorwise")
        fully_shard(model, mesh=mesh)
        switch = fp8_gather.Fp8Gather(model, layers, "tensorwise", enabled=False)
        switch.set(True)
        assert not switch.shards() and not switch.on
        return switch.rules

    try:
        torch.save({"off": run(False), "on": run(True), "configured_off": configured_off()},
                   os.path.join(out, f"{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.ranks
@needs_scaled_mm
def test_fp8_all_gather_under_hsdp(tmp_path):
    for r in gloo.spawn(_hsdp_worker, tmp_path, nprocs=4):
        (off, off_seen, _), (on, on_seen, rules) = r["off"], r["on"]
        assert rules == {n: fp8_gather.FP8_GATHER for n in ("0.0", "1.0", "2")}
        assert off_seen == ["Parameter"] * 3 and on_seen == ["Parameter"] + ["Fp8Weight"] * 2
        assert on == off
        assert r["configured_off"] == {n: fp8_gather.OFF for n in ("0.0", "1.0", "2")}
