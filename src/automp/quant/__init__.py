"""automp.quant: every quantization scheme behind one verb, and the pieces the schemes share.

    from automp.quant import quantize, WeightOnlyConfig, W8A8Config, QATConfig
    quantize(model, WeightOnlyConfig(bits=4, group_size=128))   # in place; see automp.quant.api
    quantize(llm, WeightOnlyConfig(bits=4, awq=True, calib=ids))  # a causal LM whole: automp.quant.causal_lm
    int8 = quantize(model, W8A8Config(calib=batches, budget=0.02))  # PTQ, a new model: automp.quant.ptq

Pieces: observers (ranges -> int8 parameters, shared by calibration and QAT), fallback (keep the most sensitive
layers in float until an error budget holds), qat (fake-quant training), weight_only (WeightOnlyLinear and
QuantEmbedding: int8/int4 weights, Triton kernels on CUDA, torch on the CPU), int8 (Int8Linear, W8A8, and
Int8Slice, one layer's columns of a GEMM shared by layers that read one input), causal_lm (WeightOnlyConfig on a
causal LM of archs, with AWQ scales from awq), ptq (post-training quantization of any other module: calibration,
SmoothQuant, the error budget, a per-layer report), names (the one table of scheme and dtype names).
Users: automp.deploy (ONNX QDQ int8 in deploy.qdq; torch modules compiled and timed in deploy.quantized) and
automp.llm.
Importing this package does not import Triton (the kernels load on first use).
"""
from automp.quant.api import (W8A8Config, WeightOnlyConfig, quantize, quantize_layer, register_handler,
                              register_model_handler)
from automp.quant.causal_lm import QuantConfig  # also registers WeightOnlyConfig's causal-LM handler
from automp.quant import ptq  # registers the PTQ handler of W8A8Config and WeightOnlyConfig with calib
from automp.quant.fallback import FallbackConfig, fit_budget
from automp.quant.int8 import Int8Linear, Int8Slice
from automp.quant.observers import ObserverConfig, make_observer
from automp.quant.qat import QATConfig, convert_qat, prepare_qat
from automp.quant.weight_only import QuantEmbedding, WeightOnlyLinear

__all__ = ["quantize", "quantize_layer", "register_handler", "register_model_handler", "WeightOnlyConfig",
           "W8A8Config", "QATConfig", "QuantConfig",
           "FallbackConfig", "fit_budget", "ObserverConfig", "make_observer", "prepare_qat", "convert_qat",
           "WeightOnlyLinear", "QuantEmbedding", "Int8Linear", "Int8Slice", "ptq"]
