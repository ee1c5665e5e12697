"""Tiny convergence runs on CPU: fp16 with automp's loss scaling reaches the FP32 result on every family, and the
small-loss case stalls without scaling and recovers with it. Everything runs through automp.enable() (graph pass,
planned with a GPU's cost table, spec="h100", since a CPU's own costs keep these tiny shapes in FP32, and the
autograd loss-scaling hook); one test also checks the autocast backend. Tolerances are each family's `tolerance`, in
its metric's units (accuracy points, perplexity, moment error)."""
import json

import pytest

from automp.bench.suites import convergence as suite
from automp.models.convergence import CASES, FAMILIES, make_task
from automp.scaling import current

STEPS = {"gan": 200}  # the GAN's default is long; parity already shows at 200 steps


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp16_dynamic_scaling_matches_fp32(family):
    ref = suite.run_case(family, "fp32", STEPS.get(family))
    fp16 = suite.run_case(family, "fp16-dynamic", STEPS.get(family))
    assert sum(ref.losses[-5:]) < 0.8 * sum(ref.losses[:5])  # the reference does learn something
    assert fp16.matches(ref), f"{family}: {fp16.metric_name} {fp16.metric:.4f} vs FP32 {ref.metric:.4f}"
    assert fp16.info["loss_scale"]["steps"] >= len(fp16.losses)  # the hook did scale every backward
    assert current() is None  # and was removed afterwards


def test_small_loss_stalls_without_scaling_and_recovers_with_it():
    runs = {m: suite.run_case("cnn-small-loss", m) for m in ("fp32", "fp16-noscale", "fp16-constant",
                                                              "fp16-dynamic")}
    ref = runs["fp32"]
    assert ref.metric > 0.5  # 4 classes: chance is 0.25
    assert not runs["fp16-noscale"].matches(ref) and runs["fp16-noscale"].metric < 0.35
    assert runs["fp16-constant"].matches(ref) and runs["fp16-dynamic"].matches(ref)


def test_bf16_matches_fp32_without_scaling():
    ref, bf16 = suite.run_case("widedeep", "fp32"), suite.run_case("widedeep", "bf16")
    assert bf16.matches(ref) and "loss_scale" not in bf16.info
    assert bf16.info["low_precision_nodes"] > 0.1  # the pass really did put part of the model in bf16


def test_autocast_backend_with_the_hook_matches_fp32():
    ref = suite.run_case("cnn", "fp32")
    run = suite.run_case("cnn", "fp16-dynamic", backend="autocast")
    assert run.matches(ref) and run.info["loss_scale"]["steps"] >= len(run.losses)


def test_automp_enable_backend_installs_scaling():
    run = suite.run_case("widedeep", "fp16-dynamic", steps=8, backend="automp")
    assert run.info["loss_scale"]["steps"] == 8 and all(map(suite._finite, run.losses))
    assert current() is None


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="convergence case"):
        make_task("resnet")
    with pytest.raises(ValueError, match="precision mode"):
        suite.run_case("cnn", "fp8")
    assert set(FAMILIES) <= set(CASES)


def test_suite_writes_table_json_and_plots(tmp_path):
    rc = suite.main(["--cases", "widedeep,cnn-small-loss", "--modes", "fp32,fp16-noscale,fp16-dynamic",
                     "--steps", "30", "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "convergence.json").read_text())["results"]}
    assert set(rows) == {f"{c}/{m}" for c in ("widedeep", "cnn-small-loss")
                         for m in ("fp32", "fp16-noscale", "fp16-dynamic")}
    assert rows["cnn-small-loss/fp16-noscale"]["extra"]["gap_vs_fp32"] > 0.1
    assert "cnn-small-loss/fp16-dynamic" in (tmp_path / "convergence.md").read_text()
    for case in ("widedeep", "cnn-small-loss"):
        _assert_loss_plot(tmp_path / f"convergence-{case}.png", modes=3)


def _assert_loss_plot(path, modes):
    """A PNG of about the plot's 6 x 4 inches at 100 dpi (the tight bounding box trims or widens it a little), with
    axes and text drawn, and a line in each of the first `modes` colours of matplotlib's cycle (the legend's, at
    least): one curve per mode, not a blank or truncated image."""
    import matplotlib.image as mpimg
    import numpy as np
    from matplotlib.colors import to_rgb
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4), img.shape
    height, width = img.shape[:2]
    assert 300 <= height <= 500 and 450 <= width <= 750, img.shape
    rgb = img[..., :3]
    assert (rgb.min(axis=-1) < 0.5).mean() > 0.01  # axes, ticks, labels: not a blank canvas
    for k in range(modes):
        near = np.abs(rgb - np.array(to_rgb(f"C{k}"))).max(axis=-1) < 0.05
        assert near.sum() >= 10, f"{path.name}: no line in colour C{k}"
