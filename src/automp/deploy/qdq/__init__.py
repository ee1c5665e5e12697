"""int8 quantization.

PTQ on ONNX:  quantize_onnx(model, calib, PTQConfig(), budget=None) -> (QDQ model, report)
QAT in torch: prepare_qat(model, QATConfig()) -> train -> convert_qat(model) -> export_qat_onnx(model, inputs)
Both share the range observers (observers.py) and the QDQ writer (qdq.py).
"""
from automp.compress.quant.export import export_float, export_qat_onnx
from automp.compress.quant.fallback import FallbackConfig
from automp.compress.quant.observers import ObserverConfig, make_observer
from automp.compress.quant.ptq import PTQConfig, quantize_onnx
from automp.compress.quant.qat import QATConfig, convert_qat, prepare_qat

__all__ = ["quantize_onnx", "PTQConfig", "FallbackConfig", "ObserverConfig", "make_observer", "prepare_qat",
           "convert_qat", "export_qat_onnx", "export_float", "QATConfig"]
