"""Shared by the kernel tests (a plain module: conftest files are not meant to be imported)."""
import torch

# Compiled Triton on the GPU when there is one, the Triton interpreter on the CPU otherwise (see conftest.py).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # fp32 accumulation; error is the output rounding
