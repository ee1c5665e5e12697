"""Post-training quantization of torch modules: what automp.quant.quantize runs for a W8A8Config or a
WeightOnlyConfig with calibration data, on any module but a causal LM.

    model = quantize(module, W8A8Config(calib=[batch, ...], budget=0.02))
    model(*same_inputs_as_before)        # float32 in, float32 out; fp16 + int8 kernels inside
    model.quant_report                   # per layer: precision, the rule that put it there, its sensitivity

Modules: pipeline (calibration, SmoothQuant search, static activation ranges, per-layer sensitivity, the error-budget
fallback), boundary (the float32 I/O of the result, calibration batches as model calls), shared (one int8 GEMM for
the layers that read one input), report (what was decided per layer, and why), compare (the error measure, relative L2
and cosine per output, that budgets and reports are in).
"""
from automp.quant.ptq.boundary import QuantizedModel
from automp.quant.ptq.pipeline import SMOOTH_GRID, convert, precision_of, takes
from automp.quant.ptq.report import LayerDecision, QuantReport, Rule

__all__ = ["convert", "takes", "precision_of", "SMOOTH_GRID", "QuantizedModel", "QuantReport", "LayerDecision", "Rule"]
