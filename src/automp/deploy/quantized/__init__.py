"""int8 / int4 inference of torch modules on the GPU (the torch counterpart of the ONNX int8 path).

    model, report = automp.deploy.quantized.quantize_module(model, "int8", calib=[batch, ...])
    y = model(*same_inputs_as_before)          # float32 in, float32 out; fp16 + int8 kernels inside

precision:
  "int8"         W8A8: int8 weights per output channel, int8 activations per tensor (static, calibrated: the
                 default with calibration data) or per row (dynamic), int32 accumulation with dequant + bias fused
                 (automp.kernels.int8_gemm); with static activations an MLP's first GEMM writes the second's int8
                 input (requant) and query / key / value share one GEMM (shared).
  "int8-weight"  W8A16: int8 weights in groups of 128/64/32 along K (else per channel), fp16 activations.
  "int4-weight"  W4A16: int4 weights in groups of 128/64/32 along K; a Linear whose K is not a multiple of 32 stays
                 fp16 (rule NO_INT4_GROUP).
Everything that is not an nn.Linear runs in fp16. With calib and a budget, the most sensitive layers go back to
fp16 until the error vs FP32 holds. On CUDA the result is torch.compile'd with CUDA graphs (fixed shapes).

The quantized Linear modules are automp.quant's (Int8Linear, WeightOnlyLinear). Modules here: convert (conversion +
fallback), boundary (float32 I/O, calibration batches), compile (CUDA graphs), report (per-layer decisions), speed (on
CUDA, the result timed against the same module in fp16/bf16: the report says which is faster, and a slower result
warns).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch.nn as nn

from automp.deploy.quantized.compile import compile_module, graph_breaks
from automp.deploy.quantized.convert import PRECISIONS, TorchQuantConfig, quantize_module
from automp.deploy.quantized import speed
from automp.quant import Int8Linear, WeightOnlyLinear
from automp.quant.ptq.report import LayerDecision, QuantReport, Rule


def optimize_torch(module: nn.Module, precision: str, calib: Iterable | None = None, budget: float | None = None,
                   config: TorchQuantConfig | None = None) -> tuple[nn.Module, dict]:
    """automp.deploy.optimize's torch-module path: (converted module, report dict). `budget` overrides config's."""
    config = config if config is not None else TorchQuantConfig()
    if budget is not None:
        config = replace(config, budget=budget)
    model, report = quantize_module(module, precision, calib, config)
    return model, report.to_dict()


__all__ = ["quantize_module", "optimize_torch", "TorchQuantConfig", "PRECISIONS", "QuantReport", "LayerDecision",
           "Rule", "Int8Linear", "WeightOnlyLinear", "compile_module", "graph_breaks", "speed"]
