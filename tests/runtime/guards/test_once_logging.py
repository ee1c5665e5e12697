"""Log-once calls (transformers' `logger.warning_once`) made no-ops in compiled graphs instead of graph breaks, the
setting undone cleanly, and the metrics logger's config-dump TypeError filtered only while the setting is held."""
import logging

import pytest
import torch
import torch._dynamo
import transformers  # noqa: F401  # adds warning_once/info_once to logging.Logger
from torch._dynamo.utils import counters

from automp.runtime.guards.once_logging import ignore_once_logging

WARNING_ONCE = vars(logging.Logger)["warning_once"]
METRICS = logging.getLogger("torch._dynamo.metrics_context")
LOG = logging.getLogger("automp.test.once")  # module level, as transformers' loggers are


@pytest.fixture(autouse=True)
def pristine_setting():
    """Each test starts and ends with Dynamo's ignore set as it found it."""
    ignored = torch._dynamo.config.ignore_logging_functions
    saved = set(ignored)
    yield ignored
    ignored.clear()
    ignored.update(saved)


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def collected():
    h = Collect()
    METRICS.addHandler(h)
    yield h.records
    METRICS.removeHandler(h)


def log_exception(exc: Exception, message: str) -> None:
    try:
        raise exc
    except type(exc):
        METRICS.exception(message)


def test_adds_and_undo_removes(pristine_setting):
    """The call puts warning_once in Dynamo's ignore set; the undo takes it out again."""
    assert WARNING_ONCE not in pristine_setting
    undo = ignore_once_logging()
    assert WARNING_ONCE in pristine_setting
    undo()
    assert WARNING_ONCE not in pristine_setting


def test_user_entry_survives_undo(pristine_setting):
    """What the user ignored before is not automp's to remove."""
    pristine_setting.add(WARNING_ONCE)
    undo = ignore_once_logging()
    undo()
    assert WARNING_ONCE in pristine_setting


def test_second_call_is_noop(pristine_setting):
    """A nested call adds nothing, so its undo must not take away what the outer call still holds."""
    undo = ignore_once_logging()
    ignore_once_logging()()
    assert WARNING_ONCE in pristine_setting
    undo()
    assert WARNING_ONCE not in pristine_setting


def test_filter_drops_only_config_dump_typeerror(collected):
    """While active: the metrics logger's TypeError record is dropped; another message or a ValueError passes.
    After undo the TypeError record passes again."""
    undo = ignore_once_logging()
    log_exception(TypeError("Object of type set is not JSON serializable"),
                  "Unexpected exception logging compilation metrics")
    assert collected == []
    log_exception(TypeError("x"), "something else")
    log_exception(ValueError("x"), "Unexpected exception logging runtime metrics")
    assert [r.getMessage() for r in collected] == ["something else", "Unexpected exception logging runtime metrics"]
    undo()
    collected.clear()
    log_exception(TypeError("x"), "Unexpected exception logging runtime metrics")
    assert len(collected) == 1


class Model(torch.nn.Module):
    def forward(self, x):
        y = x.sin() * 2
        LOG.warning_once("hi")
        return y + 1


def graph_breaks(x: torch.Tensor) -> dict:
    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(Model(), backend="eager")(x)
    assert torch.allclose(out, x.sin() * 2 + 1)
    return dict(counters["graph_break"])


def test_compiled_forward_has_no_graph_break():
    """The point of it all: a forward calling warning_once compiles to one graph. Control: without the setting,
    torch 2.13 breaks the graph there. (The logger is a module global: `logging.getLogger(...)` inside forward
    breaks the graph by itself, with or without the setting.)"""
    x = torch.randn(8)
    assert graph_breaks(x), "control: warning_once no longer breaks graphs on this torch"
    undo = ignore_once_logging()
    try:
        assert graph_breaks(x) == {}
    finally:
        undo()
        torch._dynamo.reset()
