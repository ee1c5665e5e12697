"""7-bit weights where onnxruntime's CPU int8 GEMM saturates (x86 AVX2 without VNNI), 8-bit elsewhere.

The int8 kernels ORT fuses the QDQ graph into must compute what the graph says: the fused session (all graph
optimizations) is compared with the same file run op by op (no optimizations: DequantizeLinear then float
MatMul/Gemm), which is the exact QDQ arithmetic in float32.
"""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import automp.deploy.qdq.export as export_mod
import automp.deploy.qdq.qdq as qdq_mod
from automp.deploy.qdq.export import export_qat_onnx
from automp.deploy.qdq.ptq import PTQConfig, quantize_onnx
from automp.quant.qat import convert_qat, prepare_qat, qat_layers
from tests.deploy.qdq.test_ptq import embedding_model
from tests.quant.helpers import rel_err

INT8_TOL = 5e-2  # the tolerance of test_ptq.py
KERNEL_TOL = 1e-4  # fused int8 kernels vs the op-by-op QDQ graph: float32 rounding only
THIS_CPU_SATURATES = qdq_mod.int8_gemm_saturates()  # before any test replaces the detection


def _run(model: onnx.ModelProto, feed: dict, fused: bool = True) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not fused:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _int8_weights(model: onnx.ModelProto) -> list[np.ndarray]:
    return [numpy_helper.to_array(i) for i in model.graph.initializer
            if i.data_type == TensorProto.INT8 and len(i.dims) == 2]


def _meta(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


@pytest.fixture
def detection(monkeypatch):
    """Force qdq.int8_gemm_saturates() to a given answer."""
    def force(saturates: bool) -> None:
        monkeypatch.setattr(qdq_mod, "int8_gemm_saturates", lambda: saturates)
    return force


def test_int8_kernels_compute_the_qdq_graph_on_this_cpu():
    """Whatever this CPU is, the automatic weight range makes ORT's fused int8 output equal the QDQ arithmetic
    (on AVX2 without VNNI, full-range weights drift by ~5% here through the saturating int16 pair sums)."""
    model, ids = embedding_model()
    qmodel, report = quantize_onnx(model, {"ids": ids}, PTQConfig())
    assert report["ort_int8_kernels"] == {"MatMulIntegerToFloat": 1}
    fused, exact = _run(qmodel, {"ids": ids}), _run(qmodel, {"ids": ids}, fused=False)
    assert rel_err(fused, exact) < KERNEL_TOL
    assert report["error"]["max_rel_error"] < INT8_TOL
    expect = "7-bit" if THIS_CPU_SATURATES else "8-bit"
    assert report["weight_range"].startswith(expect)


def test_cpu_without_vnni_gets_7bit_weights(detection):
    detection(True)
    model, ids = embedding_model()
    qmodel, report = quantize_onnx(model, {"ids": ids}, PTQConfig())
    (w,) = _int8_weights(qmodel)
    assert np.abs(w).max() == qdq_mod.REDUCED_WEIGHT_QMAX == 63
    assert report["weight_range"] == "7-bit (AVX2 CPU without VNNI: onnxruntime's u8s8 GEMM saturates)"
    assert _meta(qmodel)[qdq_mod.WEIGHT_RANGE_META_KEY] == report["weight_range"]
    assert rel_err(_run(qmodel, {"ids": ids}), _run(qmodel, {"ids": ids}, fused=False)) < KERNEL_TOL
    assert report["error"]["max_rel_error"] < INT8_TOL


def test_cpu_with_vnni_keeps_8bit_weights(detection):
    detection(False)
    model, ids = embedding_model()
    qmodel, report = quantize_onnx(model, {"ids": ids}, PTQConfig())
    (w,) = _int8_weights(qmodel)
    assert np.abs(w).max() == 127
    assert report["weight_range"] == "8-bit"
    assert qdq_mod.WEIGHT_RANGE_META_KEY not in _meta(qmodel)


def test_weight_bits_overrides_detection(detection):
    detection(True)
    model, ids = embedding_model()
    qmodel, report = quantize_onnx(model, {"ids": ids}, PTQConfig(weight_bits=8))
    assert np.abs(_int8_weights(qmodel)[0]).max() == 127 and report["weight_range"] == "8-bit"
    with pytest.raises(ValueError, match="weight_bits"):
        PTQConfig(weight_bits=6)


def test_7bit_grid_keeps_the_clipping_range(detection):
    """Same clip range as 8-bit (scale x 127/63), so a minmax weight still reaches both ends of its grid."""
    model, ids = embedding_model()
    detection(False)
    q8, _ = quantize_onnx(model, {"ids": ids}, PTQConfig(mode="weight_only"))
    detection(True)
    q7, _ = quantize_onnx(model, {"ids": ids}, PTQConfig(mode="weight_only"))
    s8, s7 = ({i.name: numpy_helper.to_array(i) for i in m.graph.initializer}["proj_quantized_scale"]
              for m in (q8, q7))
    np.testing.assert_allclose(s7 * 63, s8 * 127, rtol=1e-6)


@pytest.mark.parametrize("flags,capability,saturates", [
    ({"avx", "avx2"}, None, True),
    ({"avx2", "avx512f", "avx512bw"}, None, True),        # AVX-512BW kernels use VPMADDUBSW too
    ({"avx2", "avx512bw", "avx512_vnni"}, None, False),
    ({"avx2", "avx_vnni"}, None, False),
    ({"fp", "asimd", "asimddp"}, None, False),            # ARM
    (None, "AVX2", True),                                 # no /proc/cpuinfo: torch's capability
    (None, "AVX512", False),
])
def test_detection_reads_cpu_flags(monkeypatch, flags, capability, saturates):
    monkeypatch.setattr(qdq_mod, "_cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    qdq_mod.int8_gemm_saturates.cache_clear()
    try:
        assert qdq_mod.int8_gemm_saturates() is saturates
    finally:
        qdq_mod.int8_gemm_saturates.cache_clear()


def _qat_mlp():
    torch.manual_seed(0)
    model = prepare_qat(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).eval())
    x = torch.randn(32, 6)
    model(x)
    convert_qat(model)
    return model, x


@pytest.mark.parametrize("bits", [7, 8])
def test_qat_export_weight_bits(bits):
    """weight_bits=7 puts the learned clipping range on 63 levels a side; 8 keeps the learned grid."""
    model, x = _qat_mlp()
    proto = export_qat_onnx(model, (x[:2],), ["x"], ["y"], weight_bits=bits)
    qmax = 63 if bits == 7 else 127
    assert [int(np.abs(w).max()) for w in _int8_weights(proto)] == [qmax, qmax]
    assert (qdq_mod.WEIGHT_RANGE_META_KEY in _meta(proto)) is (bits == 7)
    first = next(iter(qat_layers(model).values())).weight_fq.effective_scale().detach().numpy()
    scales = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    np.testing.assert_allclose(scales["0.weight_quantized_scale"] * qmax, first * 127, rtol=1e-6)
    with pytest.raises(ValueError, match="7 or 8"):
        export_qat_onnx(model, (x[:2],), ["x"], ["y"], weight_bits=4)


@pytest.mark.parametrize("saturates,drift,bits", [(False, 0.5, 8), (True, 0.0, 8), (True, 0.5, 7)])
def test_qat_export_gives_up_the_learned_grid_only_where_the_kernel_departs_from_it(detection, monkeypatch,
                                                                                     saturates, drift, bits):
    detection(saturates)
    monkeypatch.setattr(export_mod, "kernel_drift", lambda model, inputs: drift)
    model, x = _qat_mlp()
    proto = export_qat_onnx(model, (x[:2],), ["x"], ["y"])
    assert int(np.abs(_int8_weights(proto)[0]).max()) == (63 if bits == 7 else 127)


def test_qat_export_runs_exactly_on_this_cpu():
    """The automatic choice: ORT's fused int8 output equals the QDQ graph and stays within 1% of the QAT model
    (on AVX2 without VNNI the learned 8-bit grid drifts by 12% here through the saturating int16 pair sums)."""
    model, x = _qat_mlp()
    proto = export_qat_onnx(model, (x[:2],), ["x"], ["y"])
    feed = {"x": x.numpy()}
    assert rel_err(_run(proto, feed), _run(proto, feed, fused=False)) < KERNEL_TOL
    with torch.no_grad():
        assert rel_err(_run(proto, feed), model(x).numpy()) < 1e-2
