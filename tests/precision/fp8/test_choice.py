"""The per-layer FP8 decision from an injected timing table and injected errors: which layers, and by which rule."""
import pytest
import torch
import torch.nn as nn

from automp.precision.fp8 import choice as fc
from automp.precision.fp8.table import Fp8Timing, GemmShape
from tests.precision.fp8.test_layers import cpu_scaled_mm


def table(gains: dict[tuple[int, int], float]):
    """A made-up device table: gain by (k, n); shapes not listed are unmeasured."""
    def timing(shape: GemmShape) -> Fp8Timing | None:
        gain = gains.get((shape.k, shape.n))
        return None if gain is None else Fp8Timing(bf16_ms=gain, fp8_gemm_ms=0.8, cast_ms=0.2)
    return timing


def test_each_rule_from_injected_times_and_errors() -> None:
    probe = fc.Probe(
        shapes={"big": GemmShape(4096, 2048, 8192), "small": GemmShape(4096, 64, 64),
                "noisy": GemmShape(4096, 2048, 2048), "odd": GemmShape(4096, 2048, 50257),
                "unmeasured": GemmShape(4096, 1024, 1024)},
        errors={"big": 0.04, "small": 0.04, "noisy": 0.25, "odd": 0.05, "unmeasured": 0.04})
    layers = ["big", "small", "noisy", "odd", "unmeasured", "head_never_called"]
    choices = fc.choose(probe, layers, table({(2048, 8192): 1.6, (64, 64): 0.7, (2048, 2048): 1.4}),
                        output_fp8=True)
    assert {n: c.rule for n, c in choices.items()} == {
        "big": fc.FP8, "small": fc.NO_GAIN, "noisy": fc.ACCURACY, "odd": fc.SHAPE, "unmeasured": fc.NOT_MEASURED,
        "head_never_called": fc.NOT_CALLED}
    assert [n for n, c in choices.items() if c.dtype == "fp8"] == ["big"]
    assert choices["big"].predicted_gain == 1.6 and choices["big"].shape == (4096, 2048, 8192)
    assert choices["noisy"].measured_error == 0.25
    assert fc.summary(choices)[fc.FP8] == 1
    assert choices["big"].as_dict()["rule"] == fc.FP8


def test_layers_named_by_fp8_keep_stay_bf16_with_their_measurements_reported() -> None:
    probe = fc.Probe(shapes={n: GemmShape(4096, 2048, 8192) for n in
                             ("module.lm_head", "module.layers.0.mlp.up", "module.layers.0.attn.q")},
                     errors={"module.lm_head": 0.04, "module.layers.0.mlp.up": 0.04, "module.layers.0.attn.q": 0.04})
    layers = list(probe.shapes) + ["lm_head_unused"]
    choices = fc.choose(probe, layers, table({(2048, 8192): 1.6}), keep=("lm_head", "*.attn.*", "lm_head_unused"))
    assert {n: c.rule for n, c in choices.items()} == {
        "module.lm_head": fc.KEPT, "module.layers.0.mlp.up": fc.FP8, "module.layers.0.attn.q": fc.KEPT,
        "lm_head_unused": fc.KEPT}
    kept = choices["module.lm_head"]  # "lm_head" matches below DDP's "module." prefix; measurements still shown
    assert kept.dtype == "bf16" and kept.predicted_gain == 1.6 and kept.measured_error == 0.04
    assert not fc.kept("module.lm_head_norm", ("lm_head",))  # a whole name, not a prefix


def test_the_last_layer_called_stays_bf16_unless_asked_for() -> None:
    """The output layer is the last one the forward called, whatever its name or its place among the modules."""
    shapes = {"blocks.0.up": GemmShape(4096, 2048, 8192), "proj_out": GemmShape(4096, 2048, 8192),
              "blocks.1.up": GemmShape(4096, 2048, 8192)}  # call order: blocks.1.up ran last
    probe = fc.Probe(shapes, {n: 0.04 for n in shapes})
    layers = ["proj_out", "blocks.0.up", "blocks.1.up"]  # module order differs from call order
    assert fc.output_layer(probe) == "blocks.1.up"
    choices = fc.choose(probe, layers, table({(2048, 8192): 1.6}))
    assert {n: c.rule for n, c in choices.items()} == {
        "proj_out": fc.FP8, "blocks.0.up": fc.FP8, "blocks.1.up": fc.OUTPUT}
    out = choices["blocks.1.up"]
    assert out.dtype == "bf16" and out.predicted_gain == 1.6 and out.measured_error == 0.04  # still reported
    opted = fc.choose(probe, layers, table({(2048, 8192): 1.6}), output_fp8=True)
    assert all(c.rule == fc.FP8 for c in opted.values())
    assert fc.output_layer(fc.Probe({}, {})) is None and fc.choose(fc.Probe({}, {}), ["x"], table({}))["x"].rule \
        == fc.NOT_CALLED


def test_thresholds_are_the_stated_ones() -> None:
    probe = fc.Probe({"a": GemmShape(64, 64, 64)}, {"a": fc.MAX_ERROR * 0.99})
    at = fc.choose(probe, ["a"], table({(64, 64): fc.MIN_GAIN}), output_fp8=True)
    below = fc.choose(probe, ["a"], table({(64, 64): fc.MIN_GAIN * 0.98}), output_fp8=True)
    assert at["a"].rule == fc.FP8 and below["a"].rule == fc.NO_GAIN
    worse = fc.choose(fc.Probe({"a": GemmShape(64, 64, 64)}, {"a": fc.MAX_ERROR * 1.01}), ["a"],
                      table({(64, 64): 2.0}), output_fp8=True)
    assert worse["a"].rule == fc.ACCURACY


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.bn, self.drop, self.down = nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Dropout(0.5), nn.Linear(64, 16)
        self.unused = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(self.bn(self.up(x))))


def test_probe_measures_real_inputs_and_leaves_no_trace() -> None:
    """Shapes and errors from the real batch; an outlier channel in a layer's input raises its error; BatchNorm's
    statistics, the RNG and the training flags are as before."""
    net = Net().train()
    x = torch.randn(48, 32)
    stats = net.bn.running_mean.clone()
    rng = torch.get_rng_state()
    probe = fc.probe(net, lambda: net(x), "tensorwise")
    assert probe.shapes == {"up": GemmShape(48, 32, 64), "down": GemmShape(48, 64, 16)}
    assert set(probe.errors) == {"up", "down"} and all(0 < e < 0.1 for e in probe.errors.values())
    assert torch.equal(net.bn.running_mean, stats) and torch.equal(torch.get_rng_state(), rng)
    assert all(m.training for m in net.modules())
    # one huge input channel that its weights ignore (the "massive activations" of LLMs): scaled to it, the other
    # channels fall into FP8's few subnormal steps, and the output, made of those channels, errs far beyond bf16
    outlier = x.clone()
    outlier[:, 3] = 1e5
    with torch.no_grad():
        net.up.weight[:, 3] = 0
    assert fc.probe(net, lambda: net(outlier), "tensorwise").errors["up"] > fc.MAX_ERROR


def test_probe_reads_transformers_conv1d_with_its_transposed_weight() -> None:
    """GPT-2's linear layers (transformers' Conv1D, weight stored (in, out)) are probed before any FP8 install."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    net = nn.Sequential(conv1d(48, 32), nn.GELU(), conv1d(16, 48))  # Conv1D(nf=out, nx=in)
    probe = fc.probe(net, lambda: net(torch.randn(2, 16, 32)), "tensorwise")
    assert probe.shapes == {"0": GemmShape(32, 32, 48), "2": GemmShape(32, 48, 16)}
    assert all(0 < e < fc.MAX_ERROR for e in probe.errors.values())


def test_auto_recipe_picks_per_layer_the_accurate_recipe_that_gains_most() -> None:
    """Per layer: tensorwise where it gains most and is accurate; rowwise where tensorwise errs (an outlier channel)
    or rowwise gains more; bf16 (the first recipe's rule) where neither goes FP8. Each choice names its recipe."""
    shapes = {"plain": GemmShape(4096, 2048, 8192), "outlier": GemmShape(4096, 2048, 8192),
              "wide": GemmShape(4096, 4096, 14336), "small": GemmShape(4096, 64, 64)}
    probes = {"tensorwise": fc.Probe(shapes, {"plain": 0.04, "outlier": 0.5, "wide": 0.04, "small": 0.04}),
              "rowwise": fc.Probe(shapes, {"plain": 0.03, "outlier": 0.05, "wide": 0.03, "small": 0.03})}
    gains = {"tensorwise": {(2048, 8192): 1.6, (4096, 14336): 1.3, (64, 64): 0.7},
             "rowwise": {(2048, 8192): 1.4, (4096, 14336): 1.5, (64, 64): 0.6}}
    by_recipe = {r: fc.choose(probes[r], list(shapes), table(gains[r]), output_fp8=True, recipe=r) for r in probes}
    merged = fc.merge(by_recipe)
    assert {n: (c.dtype, c.recipe, c.rule) for n, c in merged.items()} == {
        "plain": ("fp8", "tensorwise", fc.FP8), "outlier": ("fp8", "rowwise", fc.FP8),
        "wide": ("fp8", "rowwise", fc.FP8), "small": ("bf16", "tensorwise", fc.NO_GAIN)}
    assert merged["outlier"].predicted_gain == 1.4 and merged["outlier"].measured_error == 0.05
    assert merged["wide"].as_dict()["recipe"] == "rowwise"
    assert fc.choose(fc.Probe({}, {}), ["x"], table({}), recipe="rowwise")["x"].recipe is None  # nothing measured


def test_the_probe_finds_siblings_on_one_input_only() -> None:
    """Layers called one after another on the same tensor are siblings; the same values in another tensor are not."""
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
            self.gate, self.up, self.down = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.q(x) + torch.cat([self.k(x), self.v(x)], -1)
            y = h.clone()  # equal values, another tensor
            return self.down(torch.relu(self.gate(h)) * self.up(y))

    net = Block()
    probe = fc.probe(net, lambda: net(torch.randn(48, 32)), "tensorwise")
    assert probe.siblings == [("q", "k", "v")]
    assert list(probe.group_errors) == [("q", "k", "v")] and 0 < probe.group_errors[("q", "k", "v")] < fc.MAX_ERROR
    with torch.no_grad():
        net.v.weight.mul_(1e-6)  # one scale for the joined weight: v's values fall into FP8's subnormal steps
    blurred = fc.probe(net, lambda: net(torch.randn(48, 32)), "tensorwise")
    assert blurred.errors["v"] < fc.MAX_ERROR < blurred.group_errors[("q", "k", "v")]


def test_siblings_that_gain_as_one_gemm_go_fp8_together() -> None:
    """q gains alone, k and v lose alone, the joined q-k-v GEMM gains: all three FP8 under the group rule, at the
    group's gain. A group with a member held bf16 for accuracy or as the output layer keeps its own choices."""
    shapes = {"q": GemmShape(4096, 2048, 2048), "k": GemmShape(4096, 2048, 512), "v": GemmShape(4096, 2048, 512),
              "a": GemmShape(4096, 2048, 2048), "b": GemmShape(4096, 2048, 2048), "head": GemmShape(4096, 2048, 2048)}
    groups = [("q", "k", "v"), ("a", "b"), ("b", "head")]
    gains = {(2048, 2048): 1.4, (2048, 512): 0.8, (2048, 3072): 1.5, (2048, 4096): 1.6}
    errors = {n: 0.04 for n in shapes} | {"b": 0.3}
    probe = fc.Probe(shapes, errors, groups, {g: 0.05 for g in groups})
    choices = fc.choose(probe, list(shapes), table(gains), siblings=True, recipe="tensorwise")
    assert {n: (c.dtype, c.rule) for n, c in choices.items()} == {
        "q": ("fp8", fc.FP8_GROUP), "k": ("fp8", fc.FP8_GROUP), "v": ("fp8", fc.FP8_GROUP), "a": ("fp8", fc.FP8),
        "b": ("bf16", fc.ACCURACY), "head": ("bf16", fc.OUTPUT)}
    assert choices["k"].predicted_gain == 1.5 and choices["k"].recipe == "tensorwise"
    assert choices["k"].measured_error == 0.05  # the error it runs with: under the group's one weight scale
    alone = fc.choose(probe, list(shapes), table(gains))  # without the joined GEMM: each layer on its own
    assert [n for n, c in alone.items() if c.dtype == "fp8"] == ["q", "a"]
    # accurate alone, not joined (one member's weights far smaller than the others'): each keeps its own choice
    blurred = fc.Probe(shapes, errors, groups, {g: 0.3 for g in groups})
    assert [n for n, c in fc.choose(blurred, list(shapes), table(gains), siblings=True).items()
            if c.dtype == "fp8"] == ["q", "a"]


def test_auto_recipe_keeps_a_group_on_one_recipe() -> None:
    """Tensorwise chose the group as one; rowwise did not (its joined GEMM gains too little), though q alone gains
    most there. Per layer q would go rowwise and k, v tensorwise, three GEMMs; the group keeps tensorwise, one GEMM."""
    shapes = {"q": GemmShape(4096, 2048, 2048), "k": GemmShape(4096, 2048, 512), "v": GemmShape(4096, 2048, 512)}
    probe = fc.Probe(shapes, {n: 0.04 for n in shapes}, [("q", "k", "v")], {("q", "k", "v"): 0.05})
    by_recipe = {"tensorwise": fc.choose(probe, list(shapes), table({(2048, 2048): 1.4, (2048, 512): 0.8,
                                                                     (2048, 3072): 1.5}),
                                         output_fp8=True, siblings=True, recipe="tensorwise"),
                 "rowwise": fc.choose(probe, list(shapes), table({(2048, 2048): 1.9, (2048, 512): 0.7,
                                                                  (2048, 3072): 1.05}),
                                      output_fp8=True, siblings=True, recipe="rowwise")}
    assert by_recipe["rowwise"]["q"].rule == fc.FP8 and fc.merge(by_recipe)["q"].recipe == "rowwise"
    merged = fc.merge(by_recipe, [("q", "k", "v")])
    assert {n: (c.recipe, c.rule) for n, c in merged.items()} == {n: ("tensorwise", fc.FP8_GROUP) for n in shapes}


@pytest.mark.skipif(not cpu_scaled_mm("rowwise"), reason="no rowwise torch._scaled_mm on this CPU build")
def test_probes_measure_every_recipe_in_one_forward() -> None:
    net = Net().train()
    x = torch.randn(48, 32)
    forwards = []
    by_recipe = fc.probes(net, lambda: forwards.append(net(x)), ("tensorwise", "rowwise"))
    assert len(forwards) == 1
    alone = fc.probe(net, lambda: net(x), "tensorwise")
    assert by_recipe["tensorwise"].errors == alone.errors and by_recipe["tensorwise"].shapes == alone.shapes
    assert set(by_recipe["rowwise"].errors) == set(alone.errors)


def test_each_fp8_layer_carries_the_milliseconds_it_is_predicted_to_save() -> None:
    """bf16 time less FP8 time and casts, scaled from the measured bucket to the layer's own FLOPs; a sibling group's
    saving is shared among its members, and the conversion adds up the installed layers' (the trial's forecast)."""
    from automp.precision.fp8 import Conversion
    shapes = {"q": GemmShape(4096, 2048, 2048), "k": GemmShape(4096, 2048, 512), "v": GemmShape(4096, 2048, 512),
              "up": GemmShape(4096, 2048, 2304), "head": GemmShape(4096, 2048, 2048)}
    gains = {(2048, 2048): 1.4, (2048, 512): 0.8, (2048, 3072): 1.5, (2048, 2304): 1.6}  # bf16 ms; FP8 + cast: 1.0
    probe = fc.Probe(shapes, {n: 0.04 for n in shapes}, [("q", "k", "v")], {("q", "k", "v"): 0.05})
    choices = fc.choose(probe, list(shapes), table(gains), siblings=True)
    assert [choices[n].saving_ms for n in ("q", "k", "v")] == [pytest.approx(0.5 / 3, abs=1e-4)] * 3
    # 2304 outputs are measured at their bucket, 2560: 2304 / 2560 of the bucket's 0.6 ms
    assert choices["up"].saving_ms == pytest.approx(0.6 * 2304 / 2560, abs=1e-4)
    assert choices["head"].dtype == "bf16" and choices["head"].as_dict()["predicted_saving_ms"] == pytest.approx(0.4)
    conversion = Conversion("tensorwise", choices, installed={n: nn.Identity() for n in ("q", "k", "v", "up")})
    assert conversion.saving_ms == pytest.approx(0.5 + 0.6 * 0.9, abs=1e-3)
    assert Conversion("tensorwise", choices).saving_ms is None  # nothing installed: nothing to forecast
