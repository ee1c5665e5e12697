"""Whether this process is one rank of several: the question loss scaling, the FP8 loss watch and the runtime's rank
agreement all ask before a collective. Here, below all three, so that each asks it the same way."""
from __future__ import annotations


def distributed() -> bool:
    """A torch.distributed process group is up with more than one rank."""
    import torch

    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
