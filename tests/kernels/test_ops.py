"""The torch.library side: schemas/fake impls (opcheck), tracing under torch.compile, and the CPU torch fallback."""
import numpy as np
import pytest
import torch
import triton.language as tl

import automp.kernels as K
from automp.kernels import ops
from automp.kernels.gemv import k_range
from kernel_testutil import DEVICE, TOL, rel_err


def _cases():
    h, d = torch.float16, DEVICE
    qw8, s8 = K.quantize_weight_int8(torch.randn(24, 64, device=d), 32)
    qw4, s4 = K.quantize_weight_int4(torch.randn(24, 63, device=d), 32)
    a8 = torch.randint(-128, 128, (9, 40), dtype=torch.int8, device=d)
    b8 = torch.randint(-128, 128, (40, 12), dtype=torch.int8, device=d)
    return [
        (torch.ops.automp.gemv, (torch.randn(24, 40, dtype=h, device=d), torch.randn(40, 3, dtype=h, device=d))),
        (torch.ops.automp.gemm, (torch.randn(9, 40, dtype=h, device=d), torch.randn(40, 12, dtype=h, device=d))),
        (torch.ops.automp.quant_gemv, (qw8, s8, torch.randn(64, dtype=h, device=d))),
        (torch.ops.automp.quant_gemm, (torch.randn(3, 63, dtype=h, device=d), qw4, s4)),
        (torch.ops.automp.int8_gemm, (a8, b8, torch.rand(9, device=d), torch.rand(12, device=d),
                                      torch.randn(12, device=d),
                                      torch.randint(-5, 5, (9,), dtype=torch.int32, device=d), torch.float32)),
        (torch.ops.automp.int8_gemm_requant, (a8, b8, torch.rand(9, device=d), torch.rand(12, device=d),
                                              torch.randn(12, device=d), None, True, torch.rand(12, device=d),
                                              torch.tensor([-128], dtype=torch.int32, device=d))),
        (torch.ops.automp.unscale_and_check_, ([torch.randn(50, device=d), torch.randn(3, 3, device=d)],
                                               torch.tensor([0.5], device=d))),
        (torch.ops.automp.cast, (torch.randn(7, 5, device=d), torch.bfloat16)),
    ]


@pytest.mark.parametrize("op,args", _cases(), ids=lambda v: getattr(v, "__name__", ""))
def test_opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_ops_trace_under_torch_compile():
    w = torch.randn(32, 48, dtype=torch.float16, device=DEVICE)
    x = torch.randn(48, dtype=torch.float16, device=DEVICE)
    qw, s = K.quantize_weight_int8(torch.randn(16, 32, device=DEVICE), 32)

    def f(w, x):
        y = K.gemv(w, x)  # [32]
        return K.quant_gemv(qw, s, y)  # [16]

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    ref = K.dequantize_weight(qw, s, 32).double() @ (w.double() @ x.double())
    assert rel_err(compiled(w, x), ref) < 5 * TOL[torch.float16]


def test_cpu_fallback_without_interpreter(monkeypatch):
    """With TRITON_INTERPRET unset, CPU calls take the torch reference path, which must agree with float64."""
    monkeypatch.setattr(ops, "INTERPRET", False)
    assert not ops.use_triton(torch.empty(1))
    a, b = torch.randn(13, 30, dtype=torch.bfloat16), torch.randn(30, 11, dtype=torch.bfloat16)
    assert rel_err(K.gemm(a, b), a.double() @ b.double()) < TOL[torch.bfloat16]
    qw, s = K.quantize_weight_int4(torch.randn(11, 30), 32)
    assert rel_err(K.quant_gemm(a, qw, s), a.double() @ K.dequantize_weight(qw, s, 30).double().T) < 1.2e-2
    a8 = torch.randint(-128, 128, (5, 30), dtype=torch.int8)
    b8 = torch.randint(-128, 128, (30, 4), dtype=torch.int8)
    assert torch.equal(K.int8_gemm(a8, b8, torch.ones(5), torch.ones(4), out_dtype=torch.float32),
                       (a8.int() @ b8.int()).float())
    grads = [torch.tensor([1.0, float("nan")]), torch.randn(4)]
    assert K.unscale_and_check_(grads, torch.tensor([2.0])).item() == 1.0


@pytest.mark.skipif(DEVICE != "cpu", reason="compiled kernels loop with tl.range; this is the interpreter's loop")
def test_interpreted_loop_bounds_accept_one_element_scalars():
    """Triton 3.6's interpreter holds a runtime scalar (K, a program id) as a 1-element numpy array and makes a loop
    bound of it with int(array), which numpy >= 2.4 rejects; every K-loop goes through k_range instead."""
    from triton.runtime.interpreter import TensorHandle
    k = tl.tensor(TensorHandle(np.array([70], dtype=np.int32), tl.int32), tl.int32)
    assert list(k_range(0, k, 32)) == [0, 32, 64]
    assert list(k_range(k, 100, tl.constexpr(16))) == [70, 86]
