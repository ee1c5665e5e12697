"""Model compression: sparsity (sparse/: pruning, 2:4 semi-structured) and distillation (distill.py). Quantization
is automp.quant; int8 ONNX models are automp.deploy.qdq."""
