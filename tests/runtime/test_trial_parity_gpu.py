"""Loss parity of a GPU trial: the candidates take turns over the first steps, and every step must train as the plain
loop's would. Measured on a transformers Llama at Llama-3.2-1B widths (2 layers), whose 8-batch pool makes the loss
of step 8 (batch 0 seen again) show how much step 0 taught, and so on: a step that computed a wrong loss or gradient
moves it by tenths (the plain loop's paths agree within 0.01 there).

GPU only (skipped on CPU, where the trial has no compiled candidates); run by the GPU test run."""
import tempfile

import pytest
import torch

import automp
from automp.runtime.decisions import Route
from tests.runtime.sessions import inject

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU trial"),
              pytest.mark.usefixtures("fresh_session")]
STEPS = 17  # from step 8 each batch comes again: the CUDA graphs' steps (recorded after the first round) included
TOLERANCE = 0.05  # on losses of 7-10; the failure this guards against was 0.44


def _losses(path: str = "auto") -> tuple[list[float], dict]:
    """The losses of STEPS steps and the report (its graphs say whether a path recompiled between its turns)."""
    pytest.importorskip("transformers")
    from automp.bench.fp8_workloads import fp32_loop, llama_d2048
    torch.manual_seed(0)
    work = llama_d2048(False, "cuda", 0, depth=2)
    with tempfile.TemporaryDirectory(prefix="automp-parity-") as cache:
        automp.enable(dtype="bf16", path=path, cache_dir=cache)
        step = fp32_loop(work, "cuda")
        losses = [float(step()) for _ in range(STEPS)]
        return losses, automp.disable()


def test_the_default_gpu_trial_trains_as_low_precision_eager_does():
    (ref, _), (got, report) = _losses("eager"), _losses()
    assert max(abs(a - b) for a, b in zip(got[8:], ref[8:])) < TOLERANCE, (got, ref, report["choices"])


@pytest.mark.xfail(strict=True, reason="automp's graph pass interleaved with eager steps in a trial computed a wrong "
                                       "loss on an H100 (9.74 against 9.31); it is out of the default candidates "
                                       "until this passes")
def test_automps_own_pass_interleaved_in_a_trial_trains_as_eager_does(monkeypatch):
    ref, _ = _losses("eager")
    inject(monkeypatch, candidates=lambda device, low: ([Route.EAGER_LOW, Route.COMPILED], "test"),
           fp32_rate=lambda device: None)
    got, report = _losses()
    graphs = [g.get("name") for g in report.get("graphs", [])]  # two forwards: it recompiled between its turns
    assert max(abs(a - b) for a, b in zip(got[8:], ref[8:])) < TOLERANCE, (got, ref, graphs)
