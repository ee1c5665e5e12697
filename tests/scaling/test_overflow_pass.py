"""The fused check + unscale pass: right values, right flag, every path (torch fused op, foreach fallback, the
automp kernel's op)."""
import pytest
import torch

from automp.scaling import overflow


def _grads(seed: int, bad: str | None = None):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(37, generator=g) * 512, torch.randn(5, 3, generator=g).half() * 512,
          torch.randn(64, generator=g).bfloat16() * 512]
    if bad is not None:
        ts[1][2, 1] = float(bad)
    return ts


@pytest.mark.parametrize("bad", [None, "inf", "-inf", "nan"])
@pytest.mark.parametrize("path", ["torch", "foreach"])
def test_unscale_and_check(bad, path, monkeypatch):
    if path == "foreach":
        monkeypatch.delattr(torch, "_amp_foreach_non_finite_check_and_unscale_")
    ts = _grads(0, bad)
    ref = [t.double() / 512 for t in ts]
    found = overflow.unscale_and_check_(ts, 1 / 512)
    assert found.dtype == torch.float32 and found.shape == (1,)
    assert bool(found.item()) == (bad is not None)
    for t, r in zip(ts, ref):
        finite = torch.isfinite(r)
        assert torch.equal(t.double()[finite], r[finite])  # power-of-two unscale: exact


def test_empty_list_has_no_flag():
    assert overflow.unscale_and_check_([], 0.5) is None


def test_out_of_place_variant_is_differentiable():
    w = torch.randn(6, requires_grad=True)
    (out,), found = overflow.unscaled_copies([w * 8], 0.125)
    assert found.item() == 0 and torch.allclose(out, w)
    out.sum().backward()
    assert torch.allclose(w.grad, torch.ones(6))


def test_automp_kernel_op_has_the_signature_the_hook_calls():
    kernel = overflow._cuda_kernel()
    if kernel is None:
        pytest.skip("automp.kernels not importable here")
    ts = _grads(1, "inf")
    ref = [t.double() * 0.25 for t in ts]
    found = kernel(ts, torch.full((1,), 0.25))
    assert found.item() == 1.0
    assert torch.equal(ts[0].double(), ref[0])


def test_all_reduce_is_a_no_op_without_a_process_group():
    f = torch.ones(1)
    assert overflow.all_reduce_found(f) is f and overflow.all_reduce_found(None) is None
