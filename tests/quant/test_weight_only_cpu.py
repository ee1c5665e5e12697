"""WeightOnlyLinear on a CPU computes with torch (dequantize, then a float32 matmul), not through the Triton
interpreter that tests/conftest.py turns on for CPU runs: a decode step must take milliseconds, not seconds.

Reference: the float64 product with the layer's own dequantized weight (`dequantized()`), so the only error left is
float32 accumulation (relative ~1e-6 for K = 96; bound 1e-5) and, for half inputs, the output's rounding to fp16
(2^-11 relative per element; bound 2e-3 norm-wise).
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from automp.quant import WeightOnlyConfig, quantize
from automp.quant.weight_only import WeightOnlyLinear

FP32_BOUND, FP16_BOUND = 1e-5, 2e-3


class AutompOps(TorchDispatchMode):
    """Records every automp custom op called (the kernels are custom ops; the torch reference calls none)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.startswith("automp::"):
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("bits,group", [(4, 32), (4, None), (8, 32), (8, None)])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, FP32_BOUND), (torch.float16, FP16_BOUND)])
@pytest.mark.parametrize("rows", [1, 5])  # one token (the kernels' GEMV case) and a prefill
def test_cpu_layer_matches_float64_reference_of_its_dequantized_weight(bits, group, dtype, bound, rows):
    gen = torch.Generator().manual_seed(bits + rows)
    w, b = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    layer = WeightOnlyLinear.from_weight(w, b, bits, group)
    x = torch.randn(2, rows, 96, generator=gen).to(dtype)
    with AutompOps() as seen:
        y = layer(x)
    ref = x.double() @ layer.dequantized().double().T + layer.bias.double()
    assert seen.ops == []  # no kernel (and no interpreter) on the CPU
    assert y.shape == (2, rows, 40) and y.dtype == dtype
    assert rel(y, ref) < bound


def test_quantize_verb_runs_an_int4_model_on_cpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(3, 64)
    ref = model(x)
    quantize(model, WeightOnlyConfig(bits=4, group_size=32))
    assert all(isinstance(model[i], WeightOnlyLinear) for i in (0, 2))
    with torch.no_grad():
        y = model(x)
    assert y.dtype == torch.float32 and 0 < rel(y, ref) < 0.25  # int4 g32 on Gaussian weights: ~0.1
