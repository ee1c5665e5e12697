"""Roofline cost of running a node in FP32 or in low precision, casts included.

A conversion is only worth it when the time saved in the op (half the bytes, Tensor Core flops) exceeds the time of
the casts it forces. Time per node is max(bytes / bandwidth, flops / rate): crude, but it gets the decisions that
matter right — big matmuls convert, a lookup into a huge embedding table does not (casting the table moves far more
bytes than the lookup saves), tiny ops are not worth a cast.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    bandwidth_gbps: float  # DRAM bytes/s (read + write), in GB/s
    fp32_tflops: float  # plain FP32 (no TF32), the rate of the FP32 baseline
    fp16_tflops: float
    bf16_tflops: float
    launch_us: float = 3.0  # fixed cost of one more kernel (an unfused cast)

    def rate(self, dtype: torch.dtype) -> float:
        tf = {torch.float16: self.fp16_tflops, torch.bfloat16: self.bf16_tflops}.get(dtype, self.fp32_tflops)
        return tf * 1e12


# A server CPU with AVX512-BF16/AMX: bf16 roughly doubles the FP32 rate, fp16 is mostly emulated.
CPU = DeviceSpec("CPU", bandwidth_gbps=100, fp32_tflops=1.5, fp16_tflops=1.0, bf16_tflops=3.0, launch_us=1.0)

# The devices a plan can be made for, by the name AutoMPConfig.spec takes: the GPUs' datasheet peaks (vendor figures,
# not measurements; automp.precision.calibrate measures what the cost model's decisions need measured).
SPECS = {
    "h100": DeviceSpec("H100-SXM", bandwidth_gbps=3350, fp32_tflops=67, fp16_tflops=990, bf16_tflops=990),
    "h200": DeviceSpec("H200", bandwidth_gbps=4800, fp32_tflops=67, fp16_tflops=990, bf16_tflops=990),
    "a100": DeviceSpec("A100", bandwidth_gbps=2039, fp32_tflops=19.5, fp16_tflops=312, bf16_tflops=312),
    "cpu": CPU,
}
DEFAULT_GPU = SPECS["h100"]  # a GPU SPECS does not name plans with this one's figures


def spec_named(name: str) -> DeviceSpec:
    """A key of SPECS: plan for that device, e.g. to preview on a laptop what a data-centre GPU would get."""
    try:
        return SPECS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device spec {name!r}: expected one of {sorted(SPECS)}") from None


def spec_for(device: torch.device | str | None = None) -> DeviceSpec:
    """The DeviceSpec of a device, by name; an unknown GPU gets DEFAULT_GPU's figures (the ratios, not the absolutes,
    matter)."""
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        return CPU
    gpu = torch.cuda.get_device_name(dev)
    for key in ("h200", "a100"):
        if key.upper() in gpu:
            return SPECS[key]
    return DEFAULT_GPU


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def val(node: fx.Node):
    """The FakeTensor (or tuple of them) recorded for a node, or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def concrete(x) -> int:
    """A size as a plain int: symbolic sizes (dynamic shapes) by their hint, without adding guards."""
    if isinstance(x, int):
        return x
    hint = getattr(getattr(x, "node", None), "hint", None)
    return int(hint) if hint is not None else 4096  # unbacked: any typical size will do for an estimate


def numel(node: fx.Node) -> int:
    v = val(node)
    return concrete(v.numel()) if isinstance(v, torch.Tensor) else 0


def cast_seconds(n: int, src: torch.dtype, dst: torch.dtype, spec: DeviceSpec) -> float:
    """A standalone cast reads n elements and writes n; Inductor often fuses it, so no launch cost here."""
    return n * (itemsize(src) + itemsize(dst)) / (spec.bandwidth_gbps * 1e9)


def input_cast_seconds(n: float, low: torch.dtype, spec: DeviceSpec, fused: bool) -> float:
    """What casting an FP32 operand of n elements to `low` adds. Inductor emits the cast of a pointwise or reduction
    result inside the kernel that computes it (`fused`): the value is already in registers, so the cast costs one
    more low-precision write at most. A graph input or a library kernel's output (matmul) is read back for it."""
    if fused:
        return n * itemsize(low) / (spec.bandwidth_gbps * 1e9)
    return cast_seconds(int(n), torch.float32, low, spec)


def op_seconds(bytes_moved: float, flops: float, dtype: torch.dtype, spec: DeviceSpec) -> float:
    return max(bytes_moved / (spec.bandwidth_gbps * 1e9), flops / spec.rate(dtype))


def matmul_flops(node: fx.Node) -> float:
    """2·M·N·K for (batched) matmuls, 2·out·(Cin/groups)·kernel for convolutions, 4·B·H·L·S·D for attention."""
    out = val(node)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, torch.Tensor):
        return 0.0
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
    args = [val(a) if isinstance(a, fx.Node) else a for a in node.args]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name in ("mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm"):
        k = concrete(tensors[-2].shape[-1]) if len(tensors) >= 2 else 1
        return 2.0 * concrete(out.numel()) * k
    if name.startswith("convolution") and len(tensors) >= 2:
        # weight is [Cout, Cin/groups, *kernel]: each output element costs prod(weight.shape[1:]) MACs;
        # the backward computes both the input and the weight gradient from grad_output (same shape as out).
        w = tensors[2] if name == "convolution_backward" else tensors[1]
        ref = tensors[0] if name == "convolution_backward" else out
        macs = concrete(ref.numel()) * concrete(math.prod(w.shape[1:]))
        return 2.0 * macs * (2 if name == "convolution_backward" else 1)
    if "attention" in name and len(tensors) >= 3:
        q, k = tensors[0], tensors[1]
        return 4.0 * concrete(q.numel()) * concrete(k.shape[-2]) * (2.5 if name.endswith("backward") else 1)
    return 2.0 * concrete(out.numel()) * (concrete(tensors[0].shape[-1]) if tensors else 1)


@dataclass
class Verdict:
    low: bool
    reason: str


def matmul_verdict(node: fx.Node, low: torch.dtype, casts: float, spec: DeviceSpec) -> Verdict:
    """Convert a Tensor Core op if flops + bytes in low precision plus `casts` (seconds spent casting its FP32
    inputs, input_cast_seconds) beat FP32."""
    flops = matmul_flops(node)
    ins = [numel(a) for a in node.args if isinstance(a, fx.Node)]
    out = val(node)
    outs = sum(concrete(o.numel()) for o in (out if isinstance(out, (tuple, list)) else [out])
               if isinstance(o, torch.Tensor))
    elems = sum(ins) + outs
    t32 = op_seconds(elems * 4, flops, torch.float32, spec)
    tlow = op_seconds(elems * itemsize(low), flops, low, spec) + casts
    speed = t32 / tlow if tlow > 0 else float("inf")
    if tlow < t32:
        return Verdict(True, f"tensor-core op: {flops / 1e6:.3g} MFLOP, est. {speed:.1f}x faster incl. casts")
    return Verdict(False, f"too small to pay for its casts (est. {speed:.2f}x): kept FP32")


def gather_verdict(table: int, out: int, low: torch.dtype, spec: DeviceSpec) -> Verdict:
    """Embedding lookup: FP32 reads/writes `out` rows then casts them once for low-precision consumers; low precision
    casts the whole table first. Converting pays only when table·6 B < out·(FP32 lookup saving)."""
    ls = itemsize(low)
    t32 = op_seconds(out * 8, 0, torch.float32, spec) + cast_seconds(out, torch.float32, low, spec)
    tlow = cast_seconds(table, torch.float32, low, spec) + op_seconds(out * 2 * ls, 0, low, spec)
    if tlow < t32:
        return Verdict(True, f"small table ({table} elems) for {out} looked-up elems: casting it pays")
    return Verdict(False, f"table of {table} elems vs {out} looked up: casting the table costs "
                          f"{tlow / max(t32, 1e-12):.1f}x the FP32 lookup, kept FP32")
