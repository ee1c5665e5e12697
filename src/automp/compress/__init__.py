"""Model compression for deployment: int8 quantization (quant/: observers, PTQ on ONNX, QAT in torch)."""
