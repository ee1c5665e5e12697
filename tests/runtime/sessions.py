"""Collaborators injected into the session that `automp.enable()` opens, through its factory
(automp.runtime.session.open_session): a test of a script that enables automp itself runs a trial of its choosing."""
from automp.runtime import session as sessions


def inject(monkeypatch, **collaborators) -> None:
    """enable() opens Session(config, recorder, **collaborators) for the rest of the test (candidates, clock, cache,
    trial_config)."""
    monkeypatch.setattr(sessions, "open_session",
                        lambda config, recorder: sessions.Session(config, recorder, **collaborators))


def candidates(paths, why: str = "test"):
    """A trial's candidates: `paths` on every device."""
    return lambda device, low: (list(paths), why)
