"""A training loop under an automp Session whose clock the test advances: each iteration costs what `cost()` says for
the settings then in force (automp.runtime.tuning.conv_tuning, automp.runtime.tuning.conv_layout), as it would on a
GPU."""
from typing import Any, Callable

import torch
import torch.nn as nn

from automp.config import AutoMPConfig
from automp.runtime.session import Session


def train(config: AutoMPConfig, net: nn.Module, x: torch.Tensor, iterations: int, now: list[float],
          cost: Callable[[Session], float]) -> tuple[dict[str, Any], list[bool]]:
    """The session's report, and settled() after each iteration. torch.cuda.synchronize must be stubbed by the caller."""
    session = Session(config, clock=lambda: now[0])
    session.install()
    settled = []
    try:
        for _ in range(iterations):
            net(x).sum().backward()
            now[0] += cost(session)
            settled.append(session.settled())
    finally:
        report = session.uninstall()
    return report, settled
