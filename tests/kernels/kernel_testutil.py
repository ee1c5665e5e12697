"""Shared by the kernel tests (a plain module: conftest files are not meant to be imported)."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # fp32 accumulation; error is the output rounding
