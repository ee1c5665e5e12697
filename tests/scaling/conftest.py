import pytest

from automp.scaling import autograd_hook


@pytest.fixture(autouse=True)
def _no_scaler_leaks():
    """Every test starts and ends with torch unpatched."""
    autograd_hook.uninstall()
    yield
    autograd_hook.uninstall()
