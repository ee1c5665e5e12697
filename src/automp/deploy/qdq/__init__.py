"""int8 ONNX models in QDQ format (runs in onnxruntime CPU), built on automp.quant's observers and fallback.

PTQ:        quantize_onnx(model, calib, PTQConfig(), budget=None) -> (QDQ model, report)
QAT export: automp.quant.prepare_qat(model) -> train -> convert_qat(model) -> export_qat_onnx(model, inputs)
Both write their graph with the one QDQ writer (qdq.py), so the two paths emit identical graphs. This lives in
deploy (not quant) because it reads and writes ONNX through automp.deploy's onnxruntime helpers.
"""
from automp.deploy.qdq.export import export_float, export_qat_onnx
from automp.deploy.qdq.ptq import PTQConfig, quantize_onnx

__all__ = ["quantize_onnx", "PTQConfig", "export_qat_onnx", "export_float"]
