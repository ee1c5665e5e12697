"""automp.runtime.starts: a new root's starting point, from the configuration, the verdict cache or its candidates."""
from types import SimpleNamespace

import torch

from automp.runtime import starts
from automp.runtime.decisions import DOUBLE_BACKWARD, FORCED, FP8_OFF, MEASURED, Route, Verdict


class Recorder:
    def __init__(self):
        self.fallbacks = []

    def add_fallback(self, label, why, rule):
        self.fallbacks.append((label, rule))


def _root(**kw):
    return SimpleNamespace(**{"label": "Net", "key": "k", "device": torch.device("cpu"), "low": torch.bfloat16,
                              "fp8_layers": [], "eager_only": False, "lockstep": False, **kw})


def _config(path="auto", cuda_graphs=True):
    return SimpleNamespace(path=path, cuda_graphs=cuda_graphs, fp8_recipe="tensorwise")


class Cache:
    def __init__(self, verdict=None):
        self.verdict = verdict

    def get(self, key):
        return self.verdict


GPU = ([Route.COMPILED_AUTOCAST, Route.EAGER_LOW, Route.GRAPHED, Route.FP32], "a GPU's candidates")


def test_a_forced_fp8_path_without_fp8_layers_runs_its_bf16_twin_and_says_so():
    rec = Recorder()
    verdict = starts.forced_verdict(_config("fp8-graphs"), _root(), rec)
    assert verdict.path is Route.GRAPHED and verdict.rule == FORCED and rec.fallbacks == [("Net", FP8_OFF)]
    assert starts.forced_verdict(_config("auto"), _root(), Recorder()) is None


def test_candidates_from_the_device_without_graphs_where_they_are_off():
    assert starts.trial_start(_config(), _root(), Cache(), lambda d, low: GPU, Recorder()) == (None, *GPU)
    cached, routes, _ = starts.trial_start(_config(cuda_graphs=False), _root(), Cache(), lambda d, low: GPU, Recorder())
    assert routes == [Route.COMPILED_AUTOCAST, Route.EAGER_LOW, Route.FP32]  # graphed -> its plain twin, once


def test_a_cached_verdict_starts_the_root_unless_it_records_a_crash():
    hit = Verdict(Route.GRAPHED, "measured", {"autocast-graphed": 1.0}, rule=MEASURED)
    assert starts.trial_start(_config(), _root(), Cache(hit), lambda d, low: GPU, Recorder()) == (hit, [], "")
    rec, root = Recorder(), _root()
    crashed = Verdict(Route.EAGER_LOW, "crashed", {}, rule=DOUBLE_BACKWARD, eager_only=True)
    cached, routes, _ = starts.trial_start(_config(), root, Cache(crashed), lambda d, low: GPU, rec)
    assert cached is None and root.eager_only and routes == [Route.EAGER_LOW, Route.FP32]
    assert rec.fallbacks == [("Net", DOUBLE_BACKWARD)]


def test_fp8_layers_time_the_fp8_step_against_its_bf16_twin():
    root = _root(fp8_layers=["fc1", "fc2"])
    _, routes, why = starts.trial_start(_config(), root, Cache(), lambda d, low: GPU, Recorder())
    assert routes == [Route.GRAPHED, Route.FP8_GRAPHED] and "2 linear layer(s)" in why
