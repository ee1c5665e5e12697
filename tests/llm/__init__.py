import copy

import torch

from automp.llm.quantize import ARCHS, QuantLinear

# Where the quantized models run: on CUDA (the Triton kernels) when it exists, else on the CPU (the layers' torch
# reference; test_fuse.py sends them through the kernel ops, interpreted, to count and compare kernel calls).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Shared by test_quantize.py and test_awq.py (bounds explained in test_quantize.py's docstring).
BOUND = {"int8": 1.5e-2, "int4": 0.25}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def ids(n: int = 16, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def dequantized_reference(fp_model, q_model):
    """fp_model (float32) with each quantized layer's dequantized weight: what q_model computes, in float32."""
    ref = copy.deepcopy(fp_model)
    conv1d = ARCHS[type(fp_model).__name__].conv1d
    for name, m in q_model.named_modules():
        if isinstance(m, QuantLinear):
            w = m.dequantized()
            target = ref.get_submodule(name)
            target.weight.data = w.t().contiguous() if conv1d and name != "lm_head" else w
    for name, p in q_model.named_parameters():  # norms (AWQ may have folded scales into them)
        ref.get_parameter(name).data = p.data.float()
    return ref
