"""Verdicts on disk: a round trip, a corrupt file, and what the key depends on."""
import json

import torch.nn as nn

from automp.runtime.decisions import AS_WRITTEN, CACHED_LEGACY, MEASURED, Route, Verdict
from automp.runtime.verdicts import VerdictCache, module_key


def test_verdict_cache_round_trip_and_corrupt_file(tmp_path):
    cache = VerdictCache(tmp_path)
    v = Verdict(Route.EAGER_LOW, "measured", {"low-precision-eager": 1.0, "fp32-eager": 2.0}, rule=MEASURED)
    cache.put({"k": v})
    got = cache.get("k")
    assert got.path is Route.EAGER_LOW and got.cached and got.timings_ms == v.timings_ms
    assert cache.get("other") is None
    cache.path.write_text("{not json")
    assert cache.get("k") is None  # corrupt: ignored, not fatal
    cache.put({"k2": v, "k3": v})
    stored = json.loads(cache.path.read_text())
    assert stored["k2"]["path"] == stored["k3"]["path"] == "low-precision-eager"
    cache.path.write_text(json.dumps({"k": {"path": "warp-drive"}}))
    assert cache.get("k") is None


def test_the_cache_keeps_each_verdicts_rule_and_loads_entries_written_before_rules(tmp_path):
    cache = VerdictCache(tmp_path)
    cache.put({"k": Verdict(Route.FP32, "within the noise", {"fp32-eager": 1.0, "low-precision-eager": 0.99},
                            rule=AS_WRITTEN)})
    assert cache.get("k").rule == AS_WRITTEN and json.loads(cache.path.read_text())["k"]["rule"] == AS_WRITTEN
    old = {k: v for k, v in json.loads(cache.path.read_text())["k"].items() if k != "rule"}  # an older automp's
    cache.path.write_text(json.dumps({"old": old}))
    got = cache.get("old")
    assert got.path is Route.FP32 and got.rule == CACHED_LEGACY and got.cached


def test_module_key_depends_on_shapes_not_values():
    a, b, c = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(4, 9)
    import torch
    x = torch.randn(2, 4)
    assert module_key(a, (x,), "bf16", "cpu") == module_key(b, (x,), "bf16", "cpu")
    assert module_key(a, (x,), "bf16", "cpu") != module_key(c, (x,), "bf16", "cpu")
    assert module_key(a, (x,), "bf16", "cpu") != module_key(a, (torch.randn(3, 4),), "bf16", "cpu")
    assert module_key(a, (x,), "bf16", "cpu") != module_key(a, (x,), "fp16", "cpu")


def test_verdict_cache_keeps_whether_a_verdict_was_confirmed(tmp_path):
    cache = VerdictCache(tmp_path)
    cache.put({"a": Verdict(Route.COMPILED, "r", {"automp-compiled": 1.0}, rule=MEASURED, confirmed=True),
               "b": Verdict(Route.COMPILED, "r", {"automp-compiled": 1.0}, rule=MEASURED)})
    assert cache.get("a").confirmed and not cache.get("b").confirmed


def _put_many(directory, prefix, n, start):
    """A writer process: n verdicts, one read-modify-write each, all writers let go at once."""
    start.wait()
    cache = VerdictCache(directory)
    for i in range(n):
        cache.put({f"{prefix}{i}": Verdict(Route.FP32, "r", {"fp32-eager": float(i)}, rule=MEASURED)})


def test_concurrent_writers_keep_every_verdict(tmp_path):
    """Writers in other processes (two scripts on one machine, DDP ranks) must not drop each other's verdicts."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    writers, n = 3, 60
    start = ctx.Barrier(writers)
    procs = [ctx.Process(target=_put_many, args=(str(tmp_path), f"w{w}-", n, start)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * writers
    stored = json.loads((tmp_path / "verdicts.json").read_text())
    assert len(stored) == writers * n
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("verdicts.json")) == []


def _net_class(activation):
    """Two classes with one name and the same layers; only what forward computes differs."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        if activation == "relu":
            def forward(self, x):
                return self.fc(x).relu()
        else:
            def forward(self, x):
                return self.fc(x).sigmoid()
    return Net


def test_module_key_depends_on_the_forward_code():
    import torch
    relu, sigmoid, relu_again = _net_class("relu"), _net_class("sigmoid"), _net_class("relu")
    x = torch.randn(2, 4)
    assert relu.__qualname__ == sigmoid.__qualname__
    assert module_key(relu(), (x,), "bf16", "cpu") != module_key(sigmoid(), (x,), "bf16", "cpu")
    assert module_key(relu(), (x,), "bf16", "cpu") == module_key(relu_again(), (x,), "bf16", "cpu")

    class Outer(nn.Module):  # a submodule's code counts too, not only the root's
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x)
    assert module_key(Outer(relu()), (x,), "bf16", "cpu") != module_key(Outer(sigmoid()), (x,), "bf16", "cpu")


KEY_SCRIPT = """
import torch, torch.nn as nn
from automp.runtime.verdicts import module_key
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
    def forward(self, x):
        if x.dtype in {torch.float32, torch.float64} and "a" in {"a", "b", "c", "d"}:
            x = x * 2
        return [self.fc(t).relu() for t in (x, x)][0]
print(module_key(Net(), (torch.zeros(2, 4),), "bf16", "cpu"))
"""


def test_module_key_is_stable_across_processes():
    """The same code keeps its key in the next run, whatever that run's string hashing (frozenset constants)."""
    import os
    import subprocess
    import sys
    keys = {subprocess.run([sys.executable, "-c", KEY_SCRIPT], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2", "3")}
    assert len(keys) == 1 and len(keys.pop()) == 32


def test_the_cache_directory_is_required(tmp_path, monkeypatch):
    """The directory is resolved in one place (automp.config), not again here from the environment."""
    import pytest
    monkeypatch.setenv("AUTOMP_CACHE_DIR", str(tmp_path))
    with pytest.raises(TypeError, match="directory"):
        VerdictCache(None)
