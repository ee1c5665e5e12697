"""dtype="fp8" through automp.enable() on the CPU, with the device's FP8 check and GEMM table injected (the CPU runs
torch._scaled_mm, so the FP8 layers really compute in FP8 here): the layers chosen and reported, the path compiled
with them, the clear error where FP8 is missing, and the loss guard taking the run back to bf16 without a bad update."""
import pytest
import torch
import torch.nn as nn

import automp
from automp.precision.fp8 import choice as fp8_choice
from automp.precision.fp8 import layers as fp8
from automp.precision.fp8.table import Fp8Table, Fp8Timing, bucket
from automp.runtime import session as sessions
from automp.precision.fp8.guard import NONFINITE
from automp.runtime.fp8_layers import Fp8Layers
from automp.runtime.decisions import FP8_LEFT, FP8_SKIPPED, Route
from tests.precision.fp8.test_layers import cpu_scaled_mm, needs_scaled_mm


GAIN, LOSS = Fp8Timing(2.0, 0.8, 0.2), Fp8Timing(1.0, 1.0, 0.5)  # FP8 2x bf16's time; slower than bf16


def table_of(timing):
    """A device-table loader whose time for each shape is timing(shape, recipe)."""
    return lambda device, shapes, recipe, cache_dir: Fp8Table(
        "fake", torch.__version__, 1000.0, {(recipe, bucket(s)): timing(s, recipe) for s in shapes})


fake_table = table_of(lambda s, recipe: GAIN if s.k >= 64 else LOSS)  # layers with 64+ inputs gain, narrower lose


@pytest.fixture
def fp8_device(monkeypatch):
    monkeypatch.setattr(sessions, "open_session", lambda config, recorder: sessions.Session(
        config, recorder, fp8=Fp8Layers(config, recorder, check=lambda device: None, table=fake_table)))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16))


def test_fp8_without_an_fp8_gpu_is_one_clear_error(tmp_path, monkeypatch) -> None:
    # the check's answer on a machine without FP8 (the real one for a CPU), injected: this host may have FP8
    monkeypatch.setattr(sessions, "open_session", lambda config, recorder: sessions.Session(
        config, recorder, fp8=Fp8Layers(config, recorder, check=lambda device: fp8.unavailable(torch.device("cpu")),
                                        table=fake_table)))
    with pytest.raises(RuntimeError, match="dtype fp8 is not available: .*compute capability 8.9"):
        automp.enable(dtype="fp8", cache_dir=str(tmp_path))
    model = net()
    assert all(type(m) in (nn.Linear, nn.GELU, nn.Sequential) for m in model.modules())  # nothing was installed
    automp.enable(dtype="bf16", cache_dir=str(tmp_path), path="eager")  # and nothing is left half-enabled
    automp.disable()


@needs_scaled_mm
def test_forced_fp8_path_runs_the_chosen_layers_in_fp8_and_reports_each(fp8_device, tmp_path) -> None:
    model, x = net(), torch.randn(48, 32)
    keys = sorted(model.state_dict())
    with torch.no_grad():
        bf16 = nn.Sequential(*model)(x)  # the same layers, as written (FP32)
    automp.enable(dtype="fp8", path="fp8-compile", cache_dir=str(tmp_path), fp8_output=True)
    try:
        out = model(x)
        assert [type(m).__name__ for m in model] == ["Linear", "GELU", "Fp8Linear", "GELU", "Fp8Linear"]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), fp8.active():
            eager_fp8 = nn.Sequential.forward(model, x)  # the same FP8 layers, run eagerly
    finally:
        report = automp.disable()
    assert torch.allclose(out.float(), eager_fp8.float(), rtol=0.05, atol=0.02)  # compiled FP8 == eager FP8
    assert (out - bf16).norm() / bf16.norm() > 1e-3  # and not FP32: the FP8 layers did run
    layers = report["fp8"]["Sequential"]["layers"]
    assert {n: c["rule"] for n, c in layers.items()} == {"0": fp8_choice.NO_GAIN, "2": fp8_choice.FP8,
                                                         "4": fp8_choice.FP8}
    assert layers["2"]["shape"] == [48, 64, 128] and 0 < layers["2"]["measured_error"] < fp8_choice.MAX_ERROR
    entry = report["fp8"]["Sequential"]  # the lines each layer was judged against, for `automp report --plot`
    assert (entry["min_gain"], entry["max_error"]) == (fp8_choice.MIN_GAIN, fp8_choice.MAX_ERROR)
    assert report["choices"][0]["path"] == Route.FP8_COMPILED.value
    assert [type(m).__name__ for m in model] == ["Linear", "GELU", "Linear", "GELU", "Linear"]
    assert sorted(model.state_dict()) == keys


@needs_scaled_mm
def test_a_trial_times_the_fp8_step_against_its_bf16_twin(fp8_device, tmp_path) -> None:
    model, x = net(), torch.randn(48, 32)
    automp.enable(dtype="fp8", cache_dir=str(tmp_path), cuda_graphs=False, fp8_output=True)
    try:
        model(x).sum().backward()
        trial = next(iter(automp._session.roots.values())).trial
        assert trial.candidates == [Route.COMPILED_AUTOCAST, Route.FP8_COMPILED]
        assert "2 linear layer(s) predicted faster in FP8" in trial.note
    finally:
        automp.disable()


@needs_scaled_mm
def test_a_nan_loss_is_skipped_and_the_run_goes_back_to_bf16(fp8_device, tmp_path) -> None:
    model, x, y = net(), torch.randn(48, 32), torch.randn(48, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    automp.enable(dtype="fp8", path="fp8-compile", cache_dir=str(tmp_path))
    try:
        for step in range(3):
            loss = ((model(x) - y) ** 2).mean()
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            (loss * float("nan") if step == 1 else loss).backward()
            opt.step()
            changed = [not torch.equal(b, p) for b, p in zip(before, model.parameters())]
            assert all(changed) if step != 1 else not any(changed)  # the NaN step left the weights as they were
        root = next(iter(automp._session.roots.values()))
        assert root.path is Route.COMPILED_AUTOCAST  # the bf16 twin from the step after the NaN
    finally:
        report = automp.disable()
    assert report["fp8_fallback"]["rule"] == NONFINITE and report["fp8_fallback"]["step"] == 1
    assert {FP8_LEFT, FP8_SKIPPED} <= {f.get("rule") for f in report["fallbacks"]}
    assert report["choices"][0]["rule"] == FP8_LEFT


@needs_scaled_mm
def test_a_model_under_the_scripts_own_autocast_is_not_probed_for_fp8(fp8_device, tmp_path) -> None:
    """automp steps aside for a model the script runs under its own autocast: no FP8 probe runs it first (the probe
    would run the script's own, maybe compiled, model an extra time), no layer is swapped, no FP8 entry reported."""
    model, x = net(), torch.randn(48, 32)
    calls = []
    model.register_forward_hook(lambda m, a, out: calls.append(1))
    automp.enable(dtype="fp8", cache_dir=str(tmp_path))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()
    finally:
        report = automp.disable()
    assert len(calls) == 1  # the script's call alone
    assert all(type(m) in (nn.Linear, nn.GELU, nn.Sequential) for m in model.modules())
    assert not report.get("fp8") and report["choices"][0]["path"] == "as-written"


@needs_scaled_mm
def test_the_output_layer_stays_bf16_by_default(fp8_device, tmp_path) -> None:
    model, x = net(), torch.randn(48, 32)
    automp.enable(dtype="fp8", path="fp8-compile", cache_dir=str(tmp_path))
    try:
        model(x).sum().backward()
        assert [type(m).__name__ for m in model] == ["Linear", "GELU", "Fp8Linear", "GELU", "Linear"]
    finally:
        report = automp.disable()
    layers = report["fp8"]["Sequential"]["layers"]
    assert {n: c["rule"] for n, c in layers.items()} == {"0": fp8_choice.NO_GAIN, "2": fp8_choice.FP8,
                                                         "4": fp8_choice.OUTPUT}
    assert layers["4"]["predicted_gain"] == 2.0  # its measurements still reported


@needs_scaled_mm
def test_layers_named_by_fp8_keep_stay_bf16(fp8_device, tmp_path) -> None:
    model, x = net(), torch.randn(48, 32)
    automp.enable(dtype="fp8", path="fp8-compile", cache_dir=str(tmp_path), fp8_keep="4")
    try:
        model(x).sum().backward()
        assert [type(m).__name__ for m in model] == ["Linear", "GELU", "Fp8Linear", "GELU", "Linear"]
    finally:
        report = automp.disable()
    rules = {n: c["rule"] for n, c in report["fp8"]["Sequential"]["layers"].items()}
    assert rules == {"0": fp8_choice.NO_GAIN, "2": fp8_choice.FP8, "4": fp8_choice.KEPT}


# tensorwise gains 2x on layers with 64+ inputs; rowwise gains 2.5x on the 128-wide input only
recipe_table = table_of(lambda s, recipe: (Fp8Timing(2.5, 0.8, 0.2) if s.k >= 128 else LOSS) if recipe == "rowwise"
                        else GAIN if s.k >= 64 else LOSS)


@pytest.mark.skipif(not cpu_scaled_mm("rowwise"), reason="no rowwise torch._scaled_mm on this CPU build")
def test_auto_recipe_installs_each_layer_with_its_own_recipe(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(sessions, "open_session", lambda config, recorder: sessions.Session(
        config, recorder, fp8=Fp8Layers(config, recorder, check=lambda device: None, table=recipe_table)))
    model, x = net(), torch.randn(48, 32)
    automp.enable(dtype="fp8", path="fp8-compile", cache_dir=str(tmp_path), fp8_output=True, fp8_recipe="auto")
    try:
        model(x)
        assert [getattr(m, "_automp_fp8_recipe", None) for m in model] == [None, None, "tensorwise", None, "rowwise"]
    finally:
        report = automp.disable()
    entry = report["fp8"]["Sequential"]
    assert entry["recipe"] == "auto" and entry["fp8_layers"] == 2
    assert {n: c["recipe"] for n, c in entry["layers"].items()} == {"0": "tensorwise", "2": "tensorwise",
                                                                    "4": "rowwise"}


@needs_scaled_mm
def test_fp8_sibling_layers_run_as_one_fp8_gemm_on_the_compiled_path(fp8_device, tmp_path) -> None:
    """With fuse_siblings, FP8 layers that read one input compile to one FP8 GEMM (reported as a rewrite), and
    train as the layers apart do, within FP8's rounding."""
    from automp.precision.siblings import FUSED_SIBLINGS
    from tests.precision.test_siblings import Qkv

    def run(fuse: bool):
        torch.manual_seed(0)
        model, x = Qkv(), torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(3))
        automp.enable(dtype="fp8", path="fp8-compile", cache_dir=str(tmp_path / str(fuse)), fp8_output=True,
                      fuse_siblings=fuse)
        try:
            out = model(x)
            out.square().mean().backward()
        finally:
            report = automp.disable()
        return out.detach(), [p.grad for p in model.parameters()], report

    ref, ref_grads, _ = run(False)
    out, grads, report = run(True)
    fused = [r for r in report["rewrites"] if r["rule"] == FUSED_SIBLINGS]
    assert [r["widths"] for r in fused] == [[64, 32, 32]]
    assert (out - ref).norm() / ref.norm() < 0.1
    for g, r in zip(grads, ref_grads):
        assert (g - r).norm() / r.norm() < 0.15


wide_table = table_of(lambda s, recipe: GAIN if s.n >= 64 else LOSS)  # GEMMs 64+ outputs wide gain, narrower lose


@needs_scaled_mm
def test_siblings_that_gain_only_joined_go_fp8_as_one_gemm(monkeypatch, tmp_path) -> None:
    """Key and value (32 wide) lose alone and gain as a third of the joined query-key-value GEMM: with fuse_siblings
    all three run FP8, chosen as a group, and compile to one FP8 GEMM; without it only the query does."""
    from automp.precision.siblings import FUSED_SIBLINGS
    from tests.precision.test_siblings import Qkv
    monkeypatch.setattr(sessions, "open_session", lambda config, recorder: sessions.Session(
        config, recorder, fp8=Fp8Layers(config, recorder, check=lambda device: None, table=wide_table)))
    x = torch.randn(2, 24, 64, generator=torch.Generator().manual_seed(3))
    rules = {}
    for fuse in (False, True):
        torch.manual_seed(0)
        model = Qkv()
        automp.enable(dtype="fp8", path="fp8-compile", cache_dir=str(tmp_path / str(fuse)), fp8_output=True,
                      fuse_siblings=fuse)
        try:
            model(x).square().mean().backward()
        finally:
            report = automp.disable()
        rules[fuse] = {n: c["rule"] for n, c in report["fp8"]["Qkv"]["layers"].items()}
        fused = [r["widths"] for r in report["rewrites"] if r["rule"] == FUSED_SIBLINGS]
        assert fused == ([[64, 32, 32]] if fuse else [])
    assert rules[False] == {"q": fp8_choice.FP8, "k": fp8_choice.NO_GAIN, "v": fp8_choice.NO_GAIN}
    assert rules[True] == {n: fp8_choice.FP8_GROUP for n in ("q", "k", "v")}


@needs_scaled_mm
def test_the_trial_forecasts_the_bf16_twin_from_the_fp8_layers_predicted_saving(fp8_device, tmp_path) -> None:
    """The saving the device table predicts for the installed layers reaches the trial, which judges the twin on the
    FP8 step's last warm-up iteration; a twin ruled out is never compiled (its time here depends on the host, so
    either outcome may come: both are checked for what they must hold)."""
    from automp.runtime.decisions import TWIN_FORECAST
    model, x = net(), torch.randn(48, 32)
    automp.enable(dtype="fp8", cache_dir=str(tmp_path), cuda_graphs=False, fp8_output=True)
    try:
        for _ in range(4):
            model(x).sum().backward()
        root = next(iter(automp._session.roots.values()))
        bound = (root.trial or root.verdict).bounds[Route.COMPILED_AUTOCAST.value]  # the trial's, or its verdict's
    finally:
        report = automp.disable()
    layers = report["fp8"]["Sequential"]["layers"]
    # GAIN: bf16 2.0 ms against FP8 0.8 + cast 0.2, at shapes that are their own buckets
    assert [layers[n]["predicted_saving_ms"] for n in ("2", "4")] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert root.fp8_saving_ms == pytest.approx(2.0) and bound["saving_ms"] == pytest.approx(2.0)
    assert bound["forecast_ms"] == pytest.approx(bound["fp8_ms"] + 2.0, abs=1e-3) and bound["fp8_ms"] > 0
    if bound["rule"] == TWIN_FORECAST:
        assert root.stock is None and root.verdict.path is Route.FP8_COMPILED
