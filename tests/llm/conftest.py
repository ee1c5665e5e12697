import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a busy 2-core machine: a second intra-op thread makes each op wait for a scheduler slice."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
