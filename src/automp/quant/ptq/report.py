"""What the PTQ pipeline decided per layer, and how far the result is from the FP32 model.

Every layer gets one `LayerDecision` whose `rule` says why it ended where it did; tests and tools key on the rule,
the `reason` string is for people. The report is a plain dict once `to_dict()`-ed (JSON-serialisable).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum

from automp.quant.ptq.compare import Error


class Rule(str, Enum):
    QUANTIZED = "quantized"                          # runs on the int8/int4 kernels
    ERROR_BUDGET = "error_budget"                    # kept fp16: among the most sensitive while over the budget
    NO_INT4_GROUP = "no_int4_group"                  # kept fp16: K is not a multiple of 32 (no int4 group fits)
    EXCLUDED = "excluded"                            # kept fp16: matched the config's exclude patterns
    WEIGHT_READ_BY_PARENT = "weight_read_by_parent"  # kept fp16: the parent reads .weight itself (MultiheadAttention)


@dataclass
class LayerDecision:
    name: str
    in_features: int
    out_features: int
    precision: str                   # "int8" | "int8-weight" | "int4-weight" | "fp16"/"bf16" (kept in float)
    rule: Rule
    reason: str
    group: int | None = None         # weight-only group along K (None: per output channel)
    sensitivity: float | None = None  # this layer's own relative output error, quantized, on calib activations
    shares: tuple[str, ...] = ()     # the layers (this one included) that read one input through one int8 GEMM

    def to_dict(self) -> dict:
        d = asdict(self)
        d["rule"] = self.rule.value
        return d


@dataclass
class QuantReport:
    precision: str
    activations: str | None           # int8: "dynamic" | "static"; weight-only: None
    dtype: str                         # compute dtype of everything that is not quantized
    device: str
    budget: float | None
    smooth: float | None = None        # SmoothQuant alpha the int8 layers were built with (None: off)
    smooth_search: dict[float, float] = field(default_factory=dict)  # smooth="auto": alpha -> model error measured
    layers: list[LayerDecision] = field(default_factory=list)
    error: dict[str, Error] = field(default_factory=dict)  # per model output, vs the FP32 module
    error_data: str = "no calibration data: error not measured"
    fallback_steps: list[list] = field(default_factory=list)  # [layers back in fp16, max rel error] per step
    sensitivity: str = "isolate"      # how the budget search ranked layers (the config's)
    fallback_sensitivity: dict[str, float] = field(default_factory=dict)  # model-level, for "isolate" / "drop"
    bytes: dict[str, int] = field(default_factory=dict)
    speed: dict = field(default_factory=dict)  # quantized vs float timing on the GPU: automp.deploy.quantized's
    # wall seconds of the set-up's phases, where the caller timed them: automp.deploy.quantized's "convert"
    # (calibration, smoothing search, budget fallback, quantization) and "speed_check" (its models' first calls, which
    # compile them, and its timing)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def max_rel_error(self) -> float | None:
        return max((e.rel_l2 for e in self.error.values()), default=None)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.layers:
            out[d.rule.value] = out.get(d.rule.value, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"precision": self.precision, "activations": self.activations, "dtype": self.dtype,
                "device": self.device, "budget": self.budget, "smooth": self.smooth,
                "smooth_search": {str(a): e for a, e in self.smooth_search.items()},
                "layers": [d.to_dict() for d in self.layers],
                "rules": self.counts(), "error_vs_fp32": {k: e.to_dict() for k, e in self.error.items()},
                "max_rel_error": self.max_rel_error, "error_data": self.error_data,
                "fallback_steps": self.fallback_steps, "sensitivity": self.sensitivity,
                "fallback_sensitivity": self.fallback_sensitivity, "bytes": self.bytes, "speed": self.speed,
                "seconds": self.seconds,
                "layers_quantized": [d.name for d in self.layers if d.rule is Rule.QUANTIZED]}
