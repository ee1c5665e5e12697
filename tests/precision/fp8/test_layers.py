"""FP8 linear numerics against a float64 reference, and the layer swap's exact undo.

torch._scaled_mm runs on the CPU (torch 2.13 here); where a build lacks it the numerics tests are skipped, and the
emulation check below still pins what the FP8 path must compute: the float64 product of the FP8-rounded operands."""
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.precision.fp8 import layers as fp8


def cpu_scaled_mm(recipe: str = "tensorwise") -> bool:
    """Whether this torch runs the recipe's torch._scaled_mm on the CPU (torch 2.11's CPU kernel takes per-tensor
    scales only)."""
    a = torch.ones(16, 16).to(fp8.E4M3)
    scales = (torch.tensor(1.0), torch.tensor(1.0)) if recipe == "tensorwise" else (torch.ones(16, 1), torch.ones(1, 16))
    try:
        torch._scaled_mm(a, a.t(), scale_a=scales[0], scale_b=scales[1], out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


needs_scaled_mm = pytest.mark.skipif(not cpu_scaled_mm(), reason="this torch build has no CPU torch._scaled_mm")
RECIPES = [pytest.param(r, marks=pytest.mark.skipif(not cpu_scaled_mm(r), reason=f"no {r} torch._scaled_mm on "
                                                                                   f"this CPU build"))
           for r in fp8.RECIPES]


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


# e4m3 keeps 3 mantissa bits: each operand rounds by up to 1/16 relative, ~0.03 RMS on Gaussian data, and a product of
# two rounded operands errs by ~0.04 (measured 0.034-0.038 here). e5m2 gradients (2 mantissa bits) double that.
FWD_TOL, GRAD_TOL = 0.06, 0.10


@needs_scaled_mm
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_gradients_match_float64(recipe: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    m, k, n = 3 * 16, 80, 48  # odd multiples of 16, batch dims folded
    x = torch.randn(3, m // 3, k, generator=gen).to(dtype).requires_grad_()
    layer = nn.Linear(k, n)
    ref = nn.Linear(k, n).double()
    ref.load_state_dict(layer.state_dict())
    fp8.install(layer, recipe)
    g = torch.randn(3, m // 3, n, generator=gen)
    with fp8.active():
        y = layer(x)
    assert y.dtype == dtype and y.shape == (3, m // 3, n)
    y.backward(g.to(dtype))
    xr = x.detach().double().requires_grad_()
    yr = ref(xr)
    yr.backward(g.double())
    assert rel(y, yr) < FWD_TOL
    assert rel(x.grad, xr.grad) < GRAD_TOL
    assert rel(layer.weight.grad, ref.weight.grad) < GRAD_TOL
    assert layer.weight.grad.dtype == torch.float32  # master weights keep their dtype
    # the bias is added outside the FP8 GEMM: its gradient is a plain sum of g, exact up to g's own dtype
    assert rel(layer.bias.grad, ref.bias.grad) < (1e-5 if dtype == torch.float32 else 1e-2)


@needs_scaled_mm
def test_tensorwise_is_the_product_of_rounded_operands() -> None:
    """Not merely close to the float64 product: equal (to fp32 accumulation) to the product of the operands rounded
    to e4m3 by the documented scales, so a wrong scale or layout cannot hide inside the tolerance."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(32, 64, generator=gen), torch.randn(48, 64, generator=gen)
    x8, sx = fp8.cast(x, fp8.E4M3)
    w8, sw = fp8.cast(w, fp8.E4M3)
    emulated = (x8.double() * sx.double()) @ (w8.double() * sw.double()).t()
    out = torch.full((32, 48), float("nan"))
    out.copy_(fp8.fp8_linear(x, w, None, "tensorwise"))
    assert rel(out, emulated) < 1e-5


@needs_scaled_mm
def test_off_switch_and_unfit_shapes_run_the_original_layer() -> None:
    layer = nn.Linear(40, 24)  # 40 and 24 are not multiples of 16
    x = torch.randn(16, 40)
    want = F.linear(x, layer.weight, layer.bias)
    fp8.install(nn.Linear(8, 8), "tensorwise")  # another layer's install does not touch this one
    fp8.install(layer, "tensorwise")
    with fp8.active():
        assert torch.equal(layer(x), want)
    square = nn.Linear(32, 32)
    fp8.install(square, "tensorwise")
    x = torch.randn(16, 32)
    assert torch.equal(square(x), F.linear(x, square.weight, square.bias))  # outside active(): bf16/FP32 as written
    with fp8.active():
        assert not torch.equal(square(x), F.linear(x, square.weight, square.bias))


def test_install_keeps_parameters_state_dict_and_isinstance_and_undoes_exactly() -> None:
    layer = nn.Linear(32, 16)
    weight, keys = layer.weight, sorted(layer.state_dict())
    fp8.install(layer, "rowwise")
    assert isinstance(layer, nn.Linear) and type(layer) is not nn.Linear
    assert layer.weight is weight and sorted(layer.state_dict()) == keys
    pickle.loads(pickle.dumps(layer))  # a checkpoint of the whole module still pickles
    fp8.uninstall(layer)
    assert type(layer) is nn.Linear and not hasattr(layer, "_automp_fp8_recipe")


def test_bad_layer_and_recipe_are_named() -> None:
    with pytest.raises(TypeError, match="Conv2d"):
        fp8.install(nn.Conv2d(3, 3, 1), "tensorwise")
    with pytest.raises(ValueError, match="recipe 'blockwise'"):
        fp8.install(nn.Linear(16, 16), "blockwise")


def test_unavailable_names_the_device() -> None:
    why = fp8.unavailable(torch.device("cpu"))
    assert "8.9" in why and ("on cpu" in why or "no CUDA GPU" in why)


@needs_scaled_mm
def test_transformers_conv1d_runs_fp8_with_its_transposed_weight() -> None:
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    layer = conv1d(48, 32)  # nf=48 outputs, nx=32 inputs: weight (32, 48)
    nn.init.normal_(layer.bias)
    x = torch.randn(2, 16, 32)
    want = layer(x).double()
    fp8.install(layer, "tensorwise")
    with fp8.active():
        y = layer(x)
    assert y.shape == want.shape and rel(y, want) < FWD_TOL
    assert fp8.relative_error(layer, x, "tensorwise") < FWD_TOL


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and fp8.unavailable(torch.device("cuda")) is None else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("autocast_outside", [True, False])
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_compiled_gradients_match_float64(recipe: str, autocast_outside: bool, device: str) -> None:
    """The FP8 layer compiled by Inductor, forward and backward, against float64, with autocast entered around the
    compiled call (as automp's paths and a user's loop do) or inside it. Under torch 2.11 a Function output that
    aliased its own intermediate (a `.to()` to the dtype it had) got all-zero gradients in the compiled backward, on
    the CPU and on an H100, while eager was right: run this file under every torch the project supports. What the
    CPU's torch._scaled_mm cannot take is skipped on the CPU only: the GPU runs every recipe."""
    if device == "cpu" and not cpu_scaled_mm(recipe):
        pytest.skip(f"torch {torch.__version__}'s CPU torch._scaled_mm does not take {recipe} scales")
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)
    layer = nn.Linear(64, 48, bias=False).to(device)
    fp8.install(layer, recipe)
    x = torch.randn(32, 64, generator=gen).to(device).requires_grad_()
    g = (torch.randn(32, 48, generator=gen) * 1e-3).to(device)

    def f(t: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not autocast_outside):
            return layer(t)

    with fp8.active(), torch.autocast(device, dtype=torch.bfloat16, enabled=autocast_outside):
        y = torch.compile(f)(x)
    y.backward(g.to(y.dtype))
    w = layer.weight.detach().double()
    assert rel(y, x.detach().double() @ w.t()) < FWD_TOL + 0.02  # bf16 output rounding on top of FP8's
    assert rel(x.grad, g.double() @ w) < GRAD_TOL
    assert rel(layer.weight.grad, g.double().t() @ x.detach().double()) < GRAD_TOL


def test_fp8_weight_is_cast_as_is_and_reads_dequantized_elsewhere() -> None:
    """An FP8-gathered weight (what FSDP2 gives a layer under the FP8 all-gather): `cast` returns its FP8 values and
    scale untouched, which are the values `cast` gives the weight it came from; any other op sees it dequantized;
    an in-place op fails in one line instead of updating a copy that the next all-gather overwrites."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(48, 80, generator=gen).to(torch.bfloat16)
    w8, inv = fp8.cast(w, fp8.E4M3)
    fw = fp8.Fp8Weight(w8, inv, torch.bfloat16)
    assert fw.dtype == torch.bfloat16 and fw.shape == w.shape
    got8, got_inv = fp8.cast(fw, fp8.E4M3)
    assert got8 is w8 and got_inv is inv
    deq = (w8.double() * inv.double())
    assert rel(fw.dequantized(), deq) < 1e-2  # bf16 rounding of the dequantized value only
    assert rel(fw.dequantized(), w.double()) < FWD_TOL  # FP8's rounding of the weight
    x = torch.randn(5, 80, generator=gen).to(torch.bfloat16)
    y = F.linear(x, fw)
    assert type(y) is torch.Tensor and torch.equal(y, F.linear(x, fw.dequantized()))
    view = fw.detach()
    assert isinstance(view, fp8.Fp8Weight) and view.data8 is not w8 and torch.equal(view.data8.view(torch.uint8),
                                                                                     w8.view(torch.uint8))
    with pytest.raises(RuntimeError, match="all-gathers in FP8"):
        fw.add_(1)


@needs_scaled_mm
def test_only_the_forward_gemm_accumulates_fast(monkeypatch) -> None:
    """torchao's and Transformer Engine's split: the forward GEMM in the tensor cores' fast accumulation, the two
    backward GEMMs in full precision; and the device table times the GEMMs as the layers run them (a table timed
    otherwise predicts another gain than the step gets). Recorded at torch._scaled_mm: on the CPU both modes give
    the same numbers, so only the flags can tell."""
    from automp.precision.fp8 import table as fp8_table
    seen: list[bool] = []
    real = torch._scaled_mm

    def recording(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(48, 64, requires_grad=True)
    fp8.fp8_linear(x, w, None, "tensorwise").backward(torch.randn(32, 48))
    assert seen == [True, False, False]  # forward, then grad_input and grad_weight
    seen.clear()
    shape = fp8_table.GemmShape(32, 48, 64)
    fp8_table.run_fp8(fp8_table.fp8_operands(shape, "tensorwise", "cpu"))
    assert seen == [True, False, False]
