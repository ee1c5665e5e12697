import json
import warnings

import pytest
import torch

from automp.precision.fp8 import table as fp8_table
from automp.precision.fp8.table import Fp8Table, Fp8Timing, GemmShape, bucket, extra_bytes

CPU = torch.device("cpu")
BANDWIDTH = 1000.0  # GB/s the fake bandwidth reports


class FakeMeasure:
    """Times proportional to the bucket's FLOPs (FP8 twice as fast), five agreeing samples each; counts calls."""

    def __init__(self, noisy=False):
        self.calls = []
        self.noisy = noisy

    def __call__(self, shape, recipe):
        self.calls.append((shape, recipe))
        ms = 2.0 * shape.m * shape.k * shape.n * 3 / 1e12
        fp8 = [ms / 2] * 5
        if self.noisy:  # most samples disturbed: median 3x the fastest
            fp8 = [ms / 2, ms * 1.5, ms * 1.5, ms * 1.5, ms * 1.5]
        return [ms] * 5, fp8


def fake_bandwidth():
    return [BANDWIDTH] * 5


def load(tmp_path, shapes, recipe="tensorwise", measure=None, bandwidth=fake_bandwidth):
    return fp8_table.load_or_measure(CPU, shapes, recipe, tmp_path, measure=measure, bandwidth=bandwidth)


# -- bucket --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("d, expected", [(1, 16), (16, 16), (17, 20), (33, 40), (64, 64), (65, 80), (1000, 1024),
                                         (4096, 4096), (4097, 5120), (11008, 12288)])
def test_bucket_rounds_each_dim_up_to_four_steps_per_octave(d, expected):
    assert bucket(GemmShape(d, d, d)) == GemmShape(expected, expected, expected)


def test_bucket_is_monotone_idempotent_and_never_smaller():
    previous = 0
    for d in range(1, 5000):
        b = bucket(GemmShape(d, 16, 16)).m
        assert b >= d and b >= previous
        assert bucket(GemmShape(b, 16, 16)).m == b
        assert b <= max(16, d * 1.25)  # at most one step (a quarter octave) of padding
        if d % 16 == 0:
            assert b % 16 == 0  # a shape FP8 can run gets a bucket FP8 can run
        previous = b


def test_shapes_a_few_percent_apart_share_a_bucket():
    assert bucket(GemmShape(8000, 4096, 11008)) == bucket(GemmShape(8192, 4096, 11264))


@pytest.mark.parametrize("bad", [0, -16, 16.0, True, "16"])
def test_gemm_shape_rejects_non_positive_ints(bad):
    with pytest.raises(ValueError, match="positive int"):
        GemmShape(bad, 16, 16)


def test_unsupported_names_the_dimension():
    assert fp8_table.unsupported(GemmShape(32, 48, 64)) is None
    why = fp8_table.unsupported(GemmShape(32, 50, 64))
    assert "k=50" in why and "16" in why


# -- extra_bytes and the gain ---------------------------------------------------------------------------------------
def test_extra_bytes_is_positive_grows_with_each_dim_and_rowwise_costs_more():
    base = GemmShape(256, 256, 256)
    for recipe in fp8_table.RECIPES:
        b = extra_bytes(base, recipe)
        assert b > 0
        for bigger in (GemmShape(512, 256, 256), GemmShape(256, 512, 256), GemmShape(256, 256, 512)):
            assert extra_bytes(bigger, recipe) > b
    assert extra_bytes(base, "rowwise") > extra_bytes(base, "tensorwise")
    # the model itself: x 7 B, w 5 B (beyond bf16's own weight cast), g 7 B per element for tensorwise
    assert extra_bytes(GemmShape(16, 32, 64), "tensorwise") == 16 * 32 * 7 + 64 * 32 * 5 + 16 * 64 * 7
    # rowwise: amax + cast + write twice per operand, the second cast writing the transposed layout: x and g 10 B,
    # w 2 * 9 - 6 = 12 B
    assert extra_bytes(GemmShape(16, 32, 64), "rowwise") == 16 * 32 * 10 + 64 * 32 * 12 + 16 * 64 * 10


def test_extra_bytes_rejects_an_unknown_recipe():
    with pytest.raises(ValueError, match="unknown FP8 recipe 'blockwise'"):
        extra_bytes(GemmShape(16, 16, 16), "blockwise")


def test_predicted_gain_is_bf16_over_fp8_plus_casts():
    assert Fp8Timing(bf16_ms=3.0, fp8_gemm_ms=1.0, cast_ms=0.5).predicted_gain == pytest.approx(2.0)
    assert Fp8Timing(bf16_ms=1.0, fp8_gemm_ms=0.8, cast_ms=0.4).predicted_gain < 1.0


# -- load_or_measure -----------------------------------------------------------------------------------------------
def test_measures_each_bucket_once_and_the_cache_serves_the_next_call(tmp_path):
    shapes = [GemmShape(8000, 4096, 4096), GemmShape(8192, 4096, 4096), GemmShape(512, 1024, 1024)]
    measure = FakeMeasure()
    table = load(tmp_path, shapes, measure=measure)
    assert sorted(s.m for s, _ in measure.calls) == [512, 8192]  # 8000 and 8192 share one bucket
    path = fp8_table.cache_path(CPU, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left
    timing = table.get(shapes[0], "tensorwise")
    assert timing.cast_ms == pytest.approx(extra_bytes(bucket(shapes[0]), "tensorwise") / (BANDWIDTH * 1e9) * 1e3)
    assert timing.predicted_gain == pytest.approx(timing.bf16_ms / (timing.fp8_gemm_ms + timing.cast_ms))

    again_measure = FakeMeasure()
    again = load(tmp_path, shapes, measure=again_measure, bandwidth=lambda: pytest.fail("bandwidth re-measured"))
    assert again_measure.calls == []
    assert again.entries == table.entries and again.bandwidth_gbps == BANDWIDTH

    rowwise_measure = FakeMeasure()
    rowwise = load(tmp_path, shapes, recipe="rowwise", measure=rowwise_measure)
    assert len(rowwise_measure.calls) == 2 and {r for _, r in rowwise_measure.calls} == {"rowwise"}
    assert rowwise.get(shapes[2], "tensorwise") == table.get(shapes[2], "tensorwise")  # the merged file keeps both
    assert len(json.loads(path.read_text())["entries"]) == 4


def test_a_corrupt_file_warns_naming_it_is_measured_again_and_rewritten(tmp_path):
    path = fp8_table.cache_path(CPU, tmp_path)
    path.write_bytes(b"\x00\xff garbage {")
    measure = FakeMeasure()
    with pytest.warns(RuntimeWarning, match="corrupt") as record:
        table = load(tmp_path, [GemmShape(64, 64, 64)], measure=measure)
    assert str(path) in str(record[0].message)
    assert len(measure.calls) == 1 and table.get(GemmShape(64, 64, 64), "tensorwise") is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(tmp_path, [GemmShape(64, 64, 64)], measure=lambda *a: pytest.fail("measured again"))


@pytest.mark.parametrize("edit", [{"entries": [{"recipe": "tensorwise", "m": 17, "k": 16, "n": 16, "bf16_ms": 1.0,
                                               "fp8_gemm_ms": 1.0}]},  # 17 is no bucket
                                  {"bandwidth_gbps": -1.0}, {"entries": "none"}])
def test_a_file_with_bad_contents_is_corrupt(tmp_path, edit):
    load(tmp_path, [GemmShape(64, 64, 64)], measure=FakeMeasure())
    path = fp8_table.cache_path(CPU, tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    measure = FakeMeasure()
    with pytest.warns(RuntimeWarning, match="corrupt"):
        load(tmp_path, [GemmShape(64, 64, 64)], measure=measure)
    assert len(measure.calls) == 1


@pytest.mark.parametrize("field, value", [("torch_version", "1.0.0"), ("schema", 0), ("device", "cuda: other")])
def test_a_file_of_another_torch_schema_or_device_is_ignored(tmp_path, field, value):
    load(tmp_path, [GemmShape(64, 64, 64)], measure=FakeMeasure())
    path = fp8_table.cache_path(CPU, tmp_path)
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    measure = FakeMeasure()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stale, not corrupt: no warning
        load(tmp_path, [GemmShape(64, 64, 64)], measure=measure)
    assert len(measure.calls) == 1
    assert json.loads(path.read_text())[field] != value  # replaced by this torch's, schema's and device's table


def test_a_noisy_measurement_is_used_but_not_written(tmp_path):
    quiet, noisy = GemmShape(64, 64, 64), GemmShape(128, 128, 128)
    load(tmp_path, [quiet], measure=FakeMeasure())
    path = fp8_table.cache_path(CPU, tmp_path)
    before = path.read_bytes()
    with pytest.warns(RuntimeWarning, match="not cached"):
        table = load(tmp_path, [quiet, noisy], measure=FakeMeasure(noisy=True))
    timing = table.get(noisy, "tensorwise")
    assert timing is not None and timing.fp8_gemm_ms == pytest.approx(timing.bf16_ms * 1.5)  # the median
    assert path.read_bytes() == before
    measure = FakeMeasure()
    load(tmp_path, [quiet, noisy], measure=measure)
    assert [s for s, _ in measure.calls] == [noisy]


def test_a_noisy_bandwidth_writes_nothing(tmp_path):
    with pytest.warns(RuntimeWarning, match="copy bandwidth"):
        table = load(tmp_path, [GemmShape(64, 64, 64)], measure=FakeMeasure(),
                     bandwidth=lambda: [1000.0, 300.0, 300.0, 300.0, 300.0])
    assert table.bandwidth_gbps == pytest.approx(300.0)
    assert not fp8_table.cache_path(CPU, tmp_path).exists()


def test_unsupported_shapes_are_neither_measured_nor_looked_up(tmp_path):
    measure = FakeMeasure()
    odd = GemmShape(1000, 64, 64)  # bucket 1024 could run; 1000 itself cannot
    table = load(tmp_path, [odd], measure=measure)
    assert measure.calls == [] and table.get(odd, "tensorwise") is None
    table = load(tmp_path, [GemmShape(1024, 64, 64)], measure=measure)
    assert len(measure.calls) == 1 and table.get(odd, "tensorwise") is None


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [0.0]])
def test_a_measure_that_returns_nonsense_is_an_error(tmp_path, bad):
    with pytest.raises(ValueError, match="positive finite samples"):
        load(tmp_path, [GemmShape(64, 64, 64)], measure=lambda s, r: (bad, [1.0]))


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown FP8 recipe"):
        load(tmp_path, [GemmShape(64, 64, 64)], recipe="delayed", measure=FakeMeasure())
    with pytest.raises(ValueError, match="needs a CUDA device"):
        fp8_table.load_or_measure(CPU, [GemmShape(64, 64, 64)], "tensorwise", tmp_path)
    with pytest.raises(TypeError, match="cache_dir"):
        fp8_table.load_or_measure(CPU, [], "tensorwise", None, measure=FakeMeasure(), bandwidth=fake_bandwidth)


def test_table_get_looks_up_by_bucket():
    timing = Fp8Timing(2.0, 1.0, 0.1)
    table = Fp8Table("cpu: test", torch.__version__, 100.0, {("tensorwise", GemmShape(1024, 64, 64)): timing})
    assert table.get(GemmShape(960, 64, 64), "tensorwise") is timing
    assert table.get(GemmShape(960, 64, 64), "rowwise") is None


# -- the FP8 operands the timing runs -------------------------------------------------------------------------------
def _rowwise_on_cpu():
    """Whether this torch's CPU _scaled_mm takes per-row scales (2.13 does; 2.11's takes per-tensor scales only)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def _devices():
    yield "cpu"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        yield "cuda"


@pytest.mark.parametrize("device", list(_devices()))
@pytest.mark.parametrize("recipe", fp8_table.RECIPES)
def test_fp8_operands_compute_the_three_training_gemms(recipe, device):
    """The scaled GEMMs against float64 references of x @ w.T, g @ w and g.T @ x. Tolerance 0.1 relative
    (Frobenius): e4m3 keeps 3 mantissa bits (a relative rounding error up to 1/16 per element, about 3.6% RMS for
    normal data) and e5m2 2 bits (up to 1/8, about 7% RMS); over a sum of random products the errors average, so a
    correct layout lands near 0.03-0.07, while a wrong layout or scale is off by about 1.0 or more."""
    if device == "cpu" and recipe == "rowwise" and not _rowwise_on_cpu():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes per-tensor scales only")
    shape = GemmShape(32, 48, 64)
    (x, _), (g, w), _ = fp8_table.bf16_operands(shape, device, torch.float64)
    refs = (x @ w.T, g @ w, g.T @ x)
    ops = fp8_table.fp8_operands(shape, recipe, device)
    for (a, b, sa, sb), out, ref in zip(ops, fp8_table.run_fp8(ops), refs):
        assert a.is_contiguous() and b.t().is_contiguous()  # a row-major, b column-major
        assert sa.dtype == sb.dtype == torch.float32
        if recipe == "tensorwise":
            assert sa.dim() == sb.dim() == 0
        else:
            assert a.dtype == b.dtype == torch.float8_e4m3fn
            assert sa.shape == (a.shape[0], 1) and sb.shape == (1, b.shape[1])
        assert out.shape == ref.shape
        err = (out.double() - ref).norm() / ref.norm()
        assert err < 0.1, f"{recipe}: relative error {err:.3f}"
    if recipe == "tensorwise":
        assert ops[0][0].dtype == torch.float8_e4m3fn and ops[1][0].dtype == torch.float8_e5m2  # e5m2 gradients


def test_bf16_operands_are_the_layouts_autograd_uses():
    shape = GemmShape(32, 48, 64)
    outs = fp8_table.run_bf16(fp8_table.bf16_operands(shape, CPU))
    assert [tuple(o.shape) for o in outs] == [(32, 64), (32, 48), (64, 48)]
    assert all(o.dtype == torch.bfloat16 for o in outs)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 GEMM timing needs a GPU with FP8 tensor cores")
def test_measure_cuda_and_bandwidth_cuda_return_agreeing_positive_samples(tmp_path):
    shape = GemmShape(1024, 1024, 1024)
    for recipe in fp8_table.RECIPES:
        bf16, fp8 = fp8_table.measure_cuda(shape, recipe)
        assert len(bf16) == len(fp8) == fp8_table.REPEATS and min(bf16 + fp8) > 0
    assert min(fp8_table.bandwidth_cuda()) > 100  # GB/s: any HBM GPU copies far faster
    table = fp8_table.load_or_measure(torch.device("cuda"), [shape], "tensorwise", tmp_path)
    assert table.get(shape, "tensorwise").predicted_gain > 0
