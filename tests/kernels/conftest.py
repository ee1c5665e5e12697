"""Kernel tests run the real Triton kernels: compiled on the GPU when CUDA is available, otherwise on the CPU through
the Triton interpreter.

TRITON_INTERPRET must be decided before the kernels are decorated (at import of automp.kernels), so it is set here,
when pytest loads this directory, before any test module imports automp.kernels. tests/conftest.py turns the
interpreter on for the whole CPU suite; on a GPU machine it is turned off again here, so the compiled kernels (the
ones users run) are what gets tested.
"""
import os

import pytest
import torch

from kernel_testutil import DEVICE

os.environ["TRITON_INTERPRET"] = "1" if DEVICE == "cpu" else "0"


@pytest.fixture(autouse=True)
def _kernel_mode():
    """Fail loudly if automp.kernels was imported before the mode above was set (it would test the wrong thing:
    the torch fallback on CPU, or the interpreter on a GPU machine)."""
    from automp.kernels import ops
    assert ops.INTERPRET == (DEVICE == "cpu"), (
        f"automp.kernels was imported with TRITON_INTERPRET={int(ops.INTERPRET)} but the kernel tests run on "
        f"{DEVICE}; run the kernel tests alone or set TRITON_INTERPRET={int(DEVICE == 'cpu')} in the environment")
    torch.manual_seed(0)


@pytest.fixture
def poison(monkeypatch):
    """Make every torch.empty come back NaN-filled (ints: a sentinel) so unwritten output elements are caught."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -77)

    monkeypatch.setattr(torch, "empty", poisoned)
