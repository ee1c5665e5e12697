import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """The model tests run two training runs side by side on a 2-core CI machine: one thread each keeps them from
    fighting over cores (and their timings honest)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
