"""The helpers every suite shares: one timer (automp.timing.time_fn), one `free`, and the CPU refusal of the suites
whose full-size models need a GPU."""
import time
from types import SimpleNamespace

import pytest
import torch

from automp import timing
from automp.bench import harness
from automp.timing import time_fn


def test_time_fn_times_a_cpu_call_on_the_host_clock_even_where_cuda_exists(monkeypatch):
    """CUDA events would see none of a CPU call's work: a CPU device is timed with perf_counter."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", lambda **k: pytest.fail("CUDA events for a CPU call"))
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.002)

    ms = time_fn(work, warmup=2, iters=5, device=torch.device("cpu"))
    assert len(calls) == 7 and 1.5 < ms < 500


def test_time_fn_is_the_median_of_its_iterations(monkeypatch):
    clock = iter([0.0, 0.001, 1.0, 1.010, 2.0, 2.003])  # 1, 10 and 3 ms: the median is 3
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    assert time_fn(lambda: None, warmup=0, iters=3, device="cpu") == pytest.approx(3.0)


@pytest.mark.parametrize("dynamo", [False, True])
def test_free_resets_dynamo_only_when_asked(monkeypatch, dynamo):
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    harness.free(dynamo=dynamo)
    assert resets == ([1] if dynamo else [])


def test_cpu_refusal_names_the_suite_and_the_way_out():
    assert harness.cpu_refusal("zoo", "cuda", quick=False) is None
    assert harness.cpu_refusal("zoo", "cpu", quick=True) is None
    line = harness.cpu_refusal("fp8", "cpu", quick=False)
    assert line.startswith("automp bench fp8: needs a CUDA GPU") and "--quick" in line and "\n" not in line


def test_commit_is_read_from_the_checkouts_git_without_a_git_binary(tmp_path):
    from automp.bench.harness import commit, provenance
    git = tmp_path / ".git"
    (git / "refs" / "heads").mkdir(parents=True)
    (git / "HEAD").write_text("ref: refs/heads/main\n")
    (git / "refs" / "heads" / "main").write_text("0123456789abcdef0123456789abcdef01234567\n")
    assert commit(tmp_path) == "0123456789ab"
    (git / "refs" / "heads" / "main").unlink()
    (git / "packed-refs").write_text("# pack-refs\nfedcba9876543210fedcba9876543210fedcba98 refs/heads/main\n")
    assert commit(tmp_path) == "fedcba987654"
    assert commit(tmp_path / "elsewhere") == "unknown"
    assert set(provenance("cpu")) == {"device", "torch", "date", "commit", "source"}
    assert provenance("cpu")["device"] == "cpu"


def test_the_source_digest_names_the_package_files_whatever_the_git_says(tmp_path):
    """Two copies of the same files agree; a changed byte, a renamed file or a new one changes it; other files and
    compiled caches do not."""
    from automp.bench.harness import source_digest
    trees = [tmp_path / "a", tmp_path / "b"]
    for tree in trees:
        (tree / "sub").mkdir(parents=True)
        (tree / "x.py").write_text("x = 1\n")
        (tree / "sub" / "y.py").write_text("y = 2\n")
    first = source_digest(trees[0])
    assert len(first) == 12 and source_digest(trees[1]) == first
    (trees[1] / "notes.txt").write_text("not code")
    (trees[1] / "sub" / "__pycache__").mkdir()
    (trees[1] / "sub" / "__pycache__" / "y.cpython-311.pyc").write_bytes(b"\x00")
    assert source_digest(trees[1]) == first
    (trees[1] / "x.py").write_text("x = 2\n")
    changed = source_digest(trees[1])
    (trees[1] / "x.py").rename(trees[1] / "z.py")
    renamed = source_digest(trees[1])
    (trees[1] / "w.py").write_text("")
    assert len({first, changed, renamed, source_digest(trees[1])}) == 4


def test_block_schedule_alternates():
    assert harness.block_order(["A", "B", "C"], 4) == [["A", "B", "C"], ["C", "B", "A"], ["A", "B", "C"], ["C", "B", "A"]]
    assert harness.block_order(["A"], 3) == [["A"]] * 3


def test_block_ms_is_the_mean_of_its_calls_on_the_host_clock(monkeypatch):
    now = iter([10.0, 10.0 + 0.006])  # two reads of the clock: the block's ends, not one per call
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(now))
    calls = []
    assert harness.block_ms(lambda: calls.append(1), 3, "cpu") == pytest.approx(2.0)
    assert len(calls) == 3


def test_a_mode_compiles_on_an_empty_cache_of_its_own_with_the_caches_on(tmp_path, monkeypatch):
    """Within cold_compiles a compile misses (nothing of an earlier mode, on disk or in memory, serves it) and is
    written to the mode's own directory; a second compile of the same graph inside it is a hit, as in a user's run;
    the directory before it is put back after."""
    from torch._dynamo.utils import counters
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    triton_before = harness.os.environ.get("TRITON_CACHE_DIR")
    net, x = torch.nn.Linear(8, 4), torch.randn(3, 8)

    def compile_once():
        torch._dynamo.reset()
        torch.compile(net)(x).sum().backward()

    compile_once()  # an earlier mode's compile of the same graph
    for mode in ("a", "b"):
        counters.clear()
        with harness.cold_compiles(str(tmp_path / mode)):
            assert harness.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / mode)
            assert harness.os.environ["TRITON_CACHE_DIR"] == str(tmp_path / mode / "triton")
            compile_once()
            assert counters["inductor"]["fxgraph_cache_hit"] == 0 and counters["inductor"]["fxgraph_cache_miss"] > 0
            compile_once()
            assert counters["inductor"]["fxgraph_cache_hit"] > 0
        assert any((tmp_path / mode).iterdir())
        assert harness.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "before")
        assert harness.os.environ.get("TRITON_CACHE_DIR") == triton_before
    torch._dynamo.reset()


def test_cold_compiles_without_a_directory_uses_a_temporary_one_and_removes_it():
    with harness.cold_compiles():
        made = harness.os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert harness.os.path.isdir(made) and harness.os.environ["TRITON_CACHE_DIR"].startswith(made)
    assert not harness.os.path.exists(made)
