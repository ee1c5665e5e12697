import pytest
import torch

from automp.runtime.tuning import allocator
from automp.runtime.tuning.allocator import ExpandableSegments, why_not
from automp.config import AutoMPConfig
from automp.runtime.session import Session

needs_getter = pytest.mark.skipif(not hasattr(torch._C, "_accelerator_getAllocatorSettings"),
                                  reason="this torch cannot read the allocator's settings back")


@pytest.fixture
def allocator_default():
    """The allocator's settings as a fresh process has them, before and after the test (they are process-wide)."""
    allocator._setter()(allocator.OFF)
    yield
    allocator._setter()(allocator.OFF)


def test_left_alone_when_the_environment_configures_it(allocator_default):
    why = why_not({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert "PYTORCH_CUDA_ALLOC_CONF" in why and "max_split_size_mb:128" in why
    assert "PYTORCH_ALLOC_CONF" in why_not({"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert why_not({"PYTORCH_CUDA_ALLOC_CONF": ""}) is None  # set but empty configures nothing
    assert why_not({}) is None


@needs_getter
def test_turned_on_reported_and_restored(allocator_default):
    reports = []
    seg = ExpandableSegments()
    seg.turn_on(reports.append, environ={}, cuda=True)
    assert seg.applied and allocator._current() == allocator.ON
    assert reports == [{"setting": allocator.SETTING, "value": "expandable segments", "reason": reports[0]["reason"]}]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in reports[0]["reason"]  # how to opt out
    seg.restore()
    assert not seg.applied and allocator._current() == allocator.OFF


@needs_getter
def test_a_configured_environment_is_neither_changed_nor_restored(allocator_default):
    reports = []
    seg = ExpandableSegments()
    seg.turn_on(reports.append, environ={"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}, cuda=True)
    assert not seg.applied and allocator._current() == allocator.OFF
    assert reports[0]["value"] == "as configured" and "garbage_collection_threshold" in reports[0]["reason"]
    allocator._setter()("expandable_segments:True")  # what the script's environment might hold instead
    seg.restore()
    assert allocator._current() == "expandable_segments:True"  # not automp's to set back


@needs_getter
def test_a_script_that_set_it_itself_is_left_alone(allocator_default):
    allocator._setter()("expandable_segments:True")
    assert why_not({}) == "left as the script set it"


def test_nothing_to_report_on_a_cpu_run(allocator_default):
    reports = []
    seg = ExpandableSegments()
    seg.turn_on(reports.append, environ={}, cuda=False)
    assert reports == [] and not seg.applied


class _AsIfCuda(ExpandableSegments):
    def turn_on(self, report, environ=None, cuda=None):
        super().turn_on(report, {}, True)


@needs_getter
def test_a_session_sets_it_for_its_lifetime_only(allocator_default, fresh_session):
    session = Session(AutoMPConfig(), allocator=_AsIfCuda())
    session.install()
    try:
        assert allocator._current() == allocator.ON
    finally:
        report = session.uninstall()
    assert allocator._current() == allocator.OFF
    assert [s["value"] for s in report["settings"] if s["setting"] == allocator.SETTING] == ["expandable segments"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_new_segments_are_expandable_while_automp_is_enabled(allocator_default, fresh_session, monkeypatch):
    import automp
    for name in allocator.ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)

    def segment_of(t):
        ptr = t.data_ptr()
        return next(s for s in torch.cuda.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"])

    def new_segment_size() -> int:
        """Elements of float32 that no segment cached so far can hold: an earlier test in this worker may keep a
        live tensor in a large segment, whose free space a smaller request would reuse (an H100 run of the suite
        failed so: the block came from an old, non-expandable segment)."""
        torch.cuda.empty_cache()
        free = max((s["total_size"] - s["allocated_size"] for s in torch.cuda.memory_snapshot()), default=0)
        return (max(free, 200 * 2**20) + 64 * 2**20) // 4

    automp.enable()
    x = torch.randn(new_segment_size(), device="cuda")
    seg = segment_of(x)
    if "is_expandable" not in seg:
        pytest.skip("this torch's snapshot does not say whether a segment is expandable")
    settings = [s["value"] for s in automp.report()["settings"] if s["setting"] == allocator.SETTING]
    assert seg["is_expandable"], settings
    del x
    automp.disable()
    y = torch.randn(new_segment_size(), device="cuda")
    assert not segment_of(y)["is_expandable"]


def test_a_process_sharing_failure_gets_a_hint_only_when_automp_made_the_setting(allocator_default):
    failure = RuntimeError("pidfd_getfd: Operation not permitted")
    seg = ExpandableSegments()
    assert seg.hint(failure) is None  # not set by automp: not automp's to explain
    seg.turn_on(lambda entry: None, environ={}, cuda=True)
    try:
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in seg.hint(failure)
        assert seg.hint(RuntimeError("CUDA error: invalid argument in cudaIpcGetMemHandle")) is not None
        assert seg.hint(ValueError("the script's own bug")) is None
        assert seg.hint(RuntimeError('sum_to_size: size "[3]" is not expandable to size "[2]"')) is None
    finally:
        seg.restore()
    assert seg.hint(failure) is None


def test_the_session_passes_the_hint_on(allocator_default, fresh_session):
    session = Session(AutoMPConfig(), allocator=_AsIfCuda())
    session.install()
    try:
        hint = session.script_failed(RuntimeError("pidfd_getfd: Operation not permitted"))
        assert hint is not None and "expandable_segments:False" in hint
        assert session.script_failed(KeyError("x")) is None
    finally:
        session.uninstall()
