import os
import sys

import pytest
import torch

# Triton kernels run in the interpreter on a CPU-only machine, compiled on a GPU one. Decided here, before anything
# imports triton: triton.language's own helpers are decorated at import in the mode of that moment, and a compiled
# kernel that meets interpreter-mode helpers fails inside Triton (gluon's _import_from_triton assertion).
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
# Tests run from a checkout too (the package need not be installed).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "src"))
_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _triton_probe_not_poisoned():
    """torch caches whether Triton can run (torch.utils._triton.has_triton) on first use: a test that hides CUDA
    (tests/gloo.py cpu_host) and compiles would leave "no Triton" cached for the rest of its worker, and a later
    CUDA compile would fail with TritonMissing. Forget such a cached answer after each test on a GPU host."""
    yield
    if _CUDA:
        from torch.utils._triton import has_triton
        if has_triton.cache_info().currsize and not has_triton():
            has_triton.cache_clear()


@pytest.fixture(autouse=True)
def _one_process_group_at_a_time(request, tmp_path_factory):
    """Tests marked `ranks` start a multi-process gloo job: they take turns across pytest-xdist's workers. A ranks
    test aborted at teardown (SIGABRT) only while another job ran beside it (the teardown itself is handled in
    tests/gloo.py and the scripts), and no rank of one job can then reach a port the kernel has handed on to
    another job's gloo listener, which gloo may abort on. The lock file lies in the run's shared base directory."""
    if request.node.get_closest_marker("ranks") is None:
        yield
        return
    import fcntl
    root = tmp_path_factory.getbasetemp()
    lock = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "automp-ranks.lock"
    with open(lock, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture
def fresh_session(tmp_path, monkeypatch):
    """An automp session test's isolation: its own verdict cache, no compiled graphs from earlier tests, and automp
    disabled afterwards whatever the test did."""
    import automp

    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path / "cache"))
    torch._dynamo.reset()
    yield
    automp.disable()


@pytest.fixture
def eager_inductor(monkeypatch):
    """Inductor's compile_fx replaced by the traced graph itself: a compiled path's logic (Dynamo, AOTAutograd, the
    session) runs in seconds on a CPU, without Inductor's code generation (nor, on CUDA, its CUDA graphs)."""
    import torch._inductor.compile_fx as compile_fx
    monkeypatch.setattr(compile_fx, "compile_fx", lambda gm, example_inputs, **kwargs: gm.forward)
