"""Kernel tests run the real Triton kernels on the CPU through the Triton interpreter.

TRITON_INTERPRET must be set before the kernels are decorated (at import of automp.kernels), so it is set here,
when pytest loads this directory, before any test module imports automp.kernels.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreted():
    """Fail loudly (rather than silently testing the torch fallback) if automp.kernels was imported too early."""
    from automp.kernels import ops
    assert ops.INTERPRET, ("automp.kernels was imported before TRITON_INTERPRET=1 was set; run the kernel tests "
                           "alone or set TRITON_INTERPRET=1 in the environment")
    torch.manual_seed(0)


@pytest.fixture
def poison(monkeypatch):
    """Make every torch.empty come back NaN-filled (ints: a sentinel) so unwritten output elements are caught."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -77)

    monkeypatch.setattr(torch, "empty", poisoned)
