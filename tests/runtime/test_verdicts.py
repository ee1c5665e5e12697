"""Verdicts on disk: a round trip, a corrupt file, and what the key depends on."""
import json

import torch.nn as nn

from automp.runtime.trial import Path, Verdict
from automp.runtime.verdicts import VerdictCache, module_key


def test_verdict_cache_round_trip_and_corrupt_file(tmp_path):
    cache = VerdictCache(tmp_path)
    v = Verdict(Path.EAGER_LOW, "measured", {"low-precision-eager": 1.0, "fp32-eager": 2.0})
    cache.put({"k": v})
    got = cache.get("k")
    assert got.path is Path.EAGER_LOW and got.cached and got.timings_ms == v.timings_ms
    assert cache.get("other") is None
    cache.path.write_text("{not json")
    assert cache.get("k") is None  # corrupt: ignored, not fatal
    cache.put({"k2": v, "k3": v})
    stored = json.loads(cache.path.read_text())
    assert stored["k2"]["path"] == stored["k3"]["path"] == "low-precision-eager"
    cache.path.write_text(json.dumps({"k": {"path": "warp-drive"}}))
    assert cache.get("k") is None


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
    cache.put({"a": Verdict(Path.COMPILED, "r", {"automp-compiled": 1.0}, confirmed=True),
               "b": Verdict(Path.COMPILED, "r", {"automp-compiled": 1.0})})
    assert cache.get("a").confirmed and not cache.get("b").confirmed
