"""The Liger-Kernel anchor (automp.bench.liger) with a stand-in for liger_kernel: its fused linear cross-entropy goes
on the model instance (RoPE, RMSNorm and SwiGLU left out), its function runs outside torch.compile, transformers'
Llama module gets its classes back, and both suites' bf16-liger modes are the strongest loop with it."""
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.llama import modeling_llama  # noqa: E402

from automp.bench import fp8_workloads, zoo_models, zoo_modes  # noqa: E402
from automp.bench.liger import with_liger  # noqa: E402


@pytest.fixture
def liger(monkeypatch):
    """liger_kernel as a stand-in: what apply_liger_kernel_to_llama was called with, and its functional module."""
    calls = []

    def apply(rope, rms_norm, swiglu, fused_linear_cross_entropy, model):
        calls.append((rope, rms_norm, swiglu, fused_linear_cross_entropy))
        modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP = object, object  # what Liger does to the module
        model.liger = True

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = apply
    functional = types.ModuleType("liger_kernel.transformers.functional")
    functional.liger_fused_linear_cross_entropy = lambda *args: "loss"
    fake.functional = functional
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", functional)
    return calls, functional


def test_liger_goes_on_the_model_only_and_its_loss_runs_eagerly(liger):
    calls, functional = liger
    before = modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP
    model = fp8_workloads.llama_d2048(True, "cpu", 0, depth=1).model
    with_liger(model)
    assert calls == [(False, False, False, True)] and model.liger
    assert (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP) == before
    patched = functional.liger_fused_linear_cross_entropy
    assert patched._torchdynamo_disable and patched() == "loss"  # Dynamo leaves it to run eagerly
    with_liger(fp8_workloads.llama_d2048(True, "cpu", 0, depth=1).model)
    assert functional.liger_fused_linear_cross_entropy is patched  # wrapped once
    with pytest.raises(RuntimeError, match="do not apply to GPT2LMHeadModel"):
        with_liger(fp8_workloads.gpt2(True, "cpu", 0).model)


def test_both_suites_liger_modes_are_the_strongest_loop_with_liger(liger, monkeypatch):
    calls, _ = liger
    monkeypatch.setattr(fp8_workloads, "compiled_loop", lambda work, device: "the compiled loop")
    work = fp8_workloads.llama_d2048(True, "cpu", 0, depth=1)
    assert fp8_workloads.liger_loop(work, "cpu") == "the compiled loop" and work.model.liger
    zoo_work = zoo_models.llama(True, "cpu")
    loop = zoo_modes.ModeLoop(zoo_work, zoo_modes.LIGER, "cpu")
    (model,) = zoo_work.modules.values()
    assert model.liger and len(calls) == 2 and loop.dtype == torch.bfloat16
    assert all(isinstance(net, torch._dynamo.eval_frame.OptimizedModule) for net in loop.nets.values())
    with pytest.raises(RuntimeError, match="do not apply to GPT2LMHeadModel"):
        zoo_modes.ModeLoop(zoo_models.gpt2(True, "cpu"), zoo_modes.LIGER, "cpu")
