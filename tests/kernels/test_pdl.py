"""automp.kernels.pdl: programmatic dependent launch, opt-in. Where it is on, each taking-part kernel must wait for
the previous grid before its first load or store (else it could read an activation not yet written, or overwrite
memory the previous kernel still reads); that order is checked in the sm_90 code, no GPU needed. Off the GPU the
context must change nothing."""
import re

import pytest
import torch

import automp.kernels as K
from automp.kernels import pdl
from kernel_testutil import DEVICE, TOL, rel_err, sm90_kernel

GEMV = ("automp.kernels.gemv_quant", "_wq_gemv_kernel", {"q_ptr": "*u8", "s_ptr": "*fp16", "x_ptr": "*fp16",
                                                          "out_ptr": "*fp32"})
PLANES = ("automp.kernels.planes", "_wq_planes_kernel", {"q_ptr": "*u8", "s_ptr": "*fp16", "a_ptr": "*fp16",
                                                          "out_ptr": "*fp32"})
SUM = ("automp.kernels.quant", "_split_sum_kernel", {"part_ptr": "*fp32", "y_ptr": "*fp16"})
BUILDS = [(GEMV, dict(GROUP=128, BITS=4, SPLIT=True, WORDS=True, ASM=True, BLOCK_N=8, BLOCK_K=1024, EVEN_K=True,
                      stride_xk=1, stride_qw=1024), 4),
          (PLANES, dict(GROUP=128, BITS=4, SPLIT=True, M_P2=16, A_FP16=True, ASM=True, BLOCK_N=64, BLOCK_K=128,
                        PREFETCH_S=False, EVEN_K=True, stride_ak=1), 2),
          (SUM, dict(SPLIT_K=4, SPLIT_P2=4, BLOCK=256), 4),
          (("automp.kernels.quant_batched", "_wq_rows_kernel", {"q_ptr": "*u8", "s_ptr": "*fp16", "a_ptr": "*fp16",
                                                               "out_ptr": "*fp32"}),
           dict(GROUP=128, BITS=4, SPLIT=True, M_P2=4, BLOCK_N=32, BLOCK_K=256, EVEN_K=True, stride_ak=1), 4),
          (("automp.kernels.decode_attention", "_decode_attention_split",
            {"q_ptr": "*fp16", "k_ptr": "*fp16", "v_ptr": "*fp16", "valid_ptr": "*u8", "m_ptr": "*fp32",
             "l_ptr": "*fp32", "acc_ptr": "*fp32", "qk_scale": "fp32"}),
           dict(G=4, D=128, HEAD_BLOCKS=1, BLOCK_G=16, BLOCK_D=128, BLOCK_L=64, stride_qd=1, stride_kd=1, stride_vd=1),
           4),
          (("automp.kernels.decode_attention", "_decode_attention_combine",
            {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*fp16"}),
           dict(D=128, BLOCK_S=16, CHUNK_S=16, BLOCK_D=128), 4)]


@pytest.mark.parametrize("build", BUILDS, ids=["gemv", "planes", "split-sum", "rows", "attention", "combine"])
def test_a_dependent_kernel_waits_before_its_first_load_and_store_in_the_sm90_code(build):
    (module, kernel, pointers), constexprs, warps = build
    on = sm90_kernel(module, kernel, pointers, {**constexprs, "PDL": True}, warps)
    opcodes = [re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for ins in on]  # predicated or not
    memory = [i for i, op in enumerate(opcodes) if op in ("LDG", "STG", "LDGSTS", "RED")]
    waits = [i for i, ins in enumerate(on) if ins.startswith("ACQBULK")]  # griddepcontrol.wait
    assert memory and len(waits) == 1 and waits[0] < memory[0], (waits, memory[:3])
    assert any(ins.startswith("PREEXIT") for ins in on)  # griddepcontrol.launch_dependents: the next may launch
    off = sm90_kernel(module, kernel, pointers, {**constexprs, "PDL": False}, warps)
    assert not any(ins.startswith(("ACQBULK", "PREEXIT")) for ins in off)


def test_the_context_is_scoped_and_changes_nothing_off_sm90():
    cpu = torch.device("cpu")
    assert not pdl.active(cpu)
    with pdl.dependent_launches():
        assert pdl._ON.get() and not pdl.active(cpu)
        with pdl.dependent_launches(False):
            assert not pdl._ON.get()
        assert pdl._ON.get()
    assert not pdl._ON.get()
    assert pdl.launch_options(False) == {} and pdl.launch_options(True) == {"launch_pdl": True}


@pytest.mark.parametrize("m", [1, 8])
def test_products_inside_the_context_match_float64(poison, m):
    """On a GPU of sm_90 or later the launches really are dependent ones; elsewhere the same kernels run."""
    qw, s = K.quantize_weight_int4(torch.randn(72, 2048, device=DEVICE), 128)
    a = torch.randn(m, 2048, dtype=torch.float16, device=DEVICE)
    ref = a.double() @ K.dequantize_weight(qw, s, 2048).double().T
    with pdl.dependent_launches():
        y = K.quant_gemv(qw, s, a[0]) if m == 1 else K.quant_planes(qw, s, a)
    assert rel_err(y.reshape(ref.shape), ref) < TOL[torch.float16]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a GPU of sm_90 or later")
def test_a_chain_captured_with_dependent_launches_replays_in_order():
    """Each product reads the one before it (the middle one split, so its split sum runs too): a kernel that read its
    input before the previous grid was done would see the last replay's values, not this one's."""
    torch.manual_seed(0)
    layers = [K.quantize_weight_int4(torch.randn(n, k, device="cuda") / k ** 0.5, 128) for n, k in
              [(8192, 512), (1024, 8192), (512, 1024)]]
    x = torch.randn(512, dtype=torch.float16, device="cuda")

    def chain():
        y = x
        for qw, s in layers:
            y = K.quant_gemv(qw, s, y)
        return y
    with pdl.dependent_launches():
        chain()  # autotuned and compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for _ in range(3):
        x.copy_(torch.randn(512, dtype=torch.float16, device="cuda"))
        graph.replay()
        ref = x.double()
        for qw, s in layers:
            ref = (K.dequantize_weight(qw, s, ref.shape[0]).double() @ ref).half().double()
        assert rel_err(out, ref) < 2 * TOL[torch.float16]
