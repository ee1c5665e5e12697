"""automp.runtime.compile_log: a stock path's compile seconds (the backend's, and the backward's that AOTAutograd
compiles lazily at its first call) and its cache hits, per root and path, as the report carries them."""
import torch
import torch.nn as nn
from torch._inductor.compile_fx import compile_fx

from automp.runtime.compile_log import FIELDS, CompileLog
from automp.runtime.report import compile_in_words


class Root:  # what CompileLog reads of automp.runtime.paths.Root (held weakly, as the session's roots are)
    def __init__(self):
        self.compile_log = {}


def _compiled(log: CompileLog, net: nn.Module):
    torch._dynamo.reset()
    return torch.compile(net, backend=log.backend(lambda gm, ex: compile_fx(gm, ex, inner_compile=log.inner)))


def test_the_backward_compiled_at_its_first_call_is_timed_apart_and_a_second_compile_counts_its_cache_hits(
        monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    net, x = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)), torch.randn(8, 16)
    root = Root()
    first = CompileLog(root, "autocast-compiled")
    out = _compiled(first, net)(x)
    entry = root.compile_log["autocast-compiled"]
    assert set(entry) == set(FIELDS) and entry["graphs"] == 1 and entry["backend_s"] > 0
    assert entry["backward_s"] == 0  # no backward has run: AOTAutograd has not compiled it
    out.square().sum().backward()
    assert entry["backward_s"] > 0 and entry["aot_cache_hits"] == 0
    second = CompileLog(root, "autocast-graphed")  # the same graph again: loaded from AOTAutograd's cache
    _compiled(second, net)(x).square().sum().backward()
    again = root.compile_log["autocast-graphed"]
    assert again["graphs"] == 1 and again["aot_cache_hits"] == 1 and again["fx_cache_hits"] >= 1
    assert again["backward_s"] == 0  # loaded with its forward, nothing left to compile
    words = compile_in_words("autocast-graphed", again)
    assert words.startswith("autocast-graphed ") and "1 AOTAutograd cache hit(s)" in words


def test_a_root_gone_takes_its_log_with_it():
    root = Root()
    log = CompileLog(root, "autocast-compiled")
    del root
    assert log.entry() is None
    assert log.backend(lambda gm, ex: "compiled")(None, None) == "compiled"  # nothing to write to, no error
