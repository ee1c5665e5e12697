"""Collaborators injected into the session that `automp.enable()` opens, through its factory
(automp.runtime.session.open_session): a test of a script that enables automp itself runs a trial of its choosing."""
import torch
import torch.nn as nn

from automp.runtime import session as sessions


def inject(monkeypatch, **collaborators) -> None:
    """enable() opens Session(config, recorder, **collaborators) for the rest of the test (candidates, clock, cache,
    trial_config)."""
    monkeypatch.setattr(sessions, "open_session",
                        lambda config, recorder: sessions.Session(config, recorder, **collaborators))


def candidates(paths, why: str = "test"):
    """A trial's candidates: `paths` on every device."""
    return lambda device, low: (list(paths), why)


def train_mlp(net: nn.Module, steps: int = 6) -> list[float]:
    """`steps` SGD steps of a 16 -> 4 regression on fresh random batches (the same ones in every call): the losses."""
    g = torch.Generator().manual_seed(5)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(net(x).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
