"""Weight-only GEMV sweep on the decode shapes of Llama-1B (TinyLlama: hidden 2048, 4 KV heads, MLP 5632, 22 layers):
automp's int4/int8 `quant_gemv` (the heuristic's K split and forced ones) against cuBLAS fp16 on the dense weight.

    python scripts/qgemv_sweep.py     # a few minutes at most on an H100, mostly first-use autotuning (cached after)

Two timings per entry. "graph": one CUDA graph calling the op over enough weight copies to overflow L2 (as a decode
step does: every weight is read once per token), per-call median over replays; this is what a CUDA-graph decode
sees, launch gaps included. "bench": triton.testing.do_bench (L2 flushed before each call, median GPU time between
events). GB/s counts the bytes a call must read (weights + scales); "% copy" relates it to a 1 GiB device-to-device
copy measured here (read + write bytes over time). rel err is against the dense fp16 product of the same dequantized
weight, so it shows kernel error, not quantization error. "config" is the autotuner's pick (BLOCK_N x BLOCK_K, warps).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
from collections import defaultdict
from typing import Callable

import torch

if not torch.cuda.is_available():
    sys.exit("qgemv_sweep: needs a CUDA GPU and none is visible (it times kernels; the CPU interpreter cannot)")
if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("qgemv_sweep: TRITON_INTERPRET=1 would time the Triton interpreter; unset it")

import triton  # noqa: E402

import automp.kernels as K  # noqa: E402
from automp.kernels import gemv_quant as quant  # noqa: E402

LAYERS = 22
# (name, N, K, calls per decode step)
SHAPES = [("q,o", 2048, 2048, 2 * LAYERS), ("k,v", 256, 2048, 2 * LAYERS), ("gate,up", 5632, 2048, 2 * LAYERS),
          ("down", 2048, 5632, LAYERS), ("lm_head", 32000, 2048, 1)]
GROUP = 128
FORCED = (1, 2, 4, 8)
L2_SPAN = 256 << 20  # bytes of weight copies one graph cycles through: several times the H100's 50 MB L2
REPLAYS = 10


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy, counting the bytes read and written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * (1 << 30) / ms / 1e6


def graph_us(fn: Callable, args_list: list[tuple]) -> float:
    """Median per-call µs of one CUDA graph calling fn once per argument tuple."""
    fn(*args_list[0])  # first use outside the capture: autotuning must not run inside it
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for a in args_list:
            fn(*a)
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(args_list))
    return statistics.median(times)


def measure(fn: Callable, operands: tuple, nbytes: int) -> tuple[float, float]:
    """(graph µs, bench µs) of fn(*operands), where the operands' weights are `nbytes`; x is shared, as in decode."""
    copies = max(2, min(128, math.ceil(L2_SPAN / nbytes)))
    args_list = [operands] + [tuple(t.clone() if t.numel() * t.element_size() > 1 << 16 else t for t in operands)
                              for _ in range(copies - 1)]
    g = graph_us(fn, args_list)
    b = triton.testing.do_bench(lambda: fn(*operands), warmup=10, rep=50, return_mode="median") * 1e3
    del args_list
    torch.cuda.empty_cache()
    return g, b


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def picked_config() -> str:
    c = getattr(quant._wq_gemv_kernel, "best_config", None)
    return f"{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']} w{c.num_warps}" if c is not None else "?"


def forced(split_k: int) -> Callable:
    return lambda qw, s, x: quant.quant_gemv(qw, s, x, split_k=split_k)


def main() -> None:
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)\n")
    print("| shape N x K | weights | mode | splits | config | graph µs | bench µs | GB/s (graph) | % copy "
          "| vs cuBLAS | rel err |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    step: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # per decode step: [µs, bytes]
    for name, n, k, count in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        x = torch.randn(k, dtype=torch.float16, device="cuda")
        quantized = {bits: q(w, GROUP) for bits, q in ((4, K.quantize_weight_int4), (8, K.quantize_weight_int8))}
        del w
        dense = K.dequantize_weight(*quantized[4], k).half()
        cublas, cublas_bench = measure(torch.nn.functional.linear, (x, dense), dense.numel() * 2)

        def row(label: str, mode: str, splits: int, config: str, g: float, b: float, nbytes: int, err: float) -> None:
            gbs = nbytes / g / 1e3
            print(f"| {name} {n}x{k} | {label} | {mode} | {splits} | {config} | {g:.2f} | {b:.2f} | {gbs:.0f} | "
                  f"{100 * gbs / copy_gbs:.0f} | {cublas / g:.2f}x | {err:.1e} |", flush=True)

        row("fp16 dense", "cuBLAS", 1, "-", cublas, cublas_bench, dense.numel() * 2, 0.0)
        step["cuBLAS fp16"][0] += count * cublas
        step["cuBLAS fp16"][1] += count * dense.numel() * 2
        for bits, (qw, s) in quantized.items():
            ref = torch.nn.functional.linear(x, K.dequantize_weight(qw, s, k).half())
            nbytes = qw.numel() * qw.element_size() + s.numel() * s.element_size()
            group = quant.kernel_group(k, s.shape[1])
            best = math.inf
            for mode, split_k in [("auto", None)] + [(f"split {sk}", sk) for sk in FORCED]:
                fn = K.quant_gemv if split_k is None else forced(split_k)
                err = rel_err(fn(qw, s, x), ref)  # the first call autotunes
                config = picked_config()
                g, b = measure(fn, (qw, s, x), nbytes)
                splits = quant._gemv_split(n, k, group, props.multi_processor_count, split_k)[0]
                row(f"int{bits} g{GROUP}", mode, splits, config, g, b, nbytes, err)
                if split_k is None:
                    step[f"int{bits} auto"][0] += count * g
                    step[f"int{bits} auto"][1] += count * nbytes
                best = min(best, g)
            step[f"int{bits} best of the splits"][0] += count * best
            step[f"int{bits} best of the splits"][1] += count * nbytes
        del quantized, dense
        torch.cuda.empty_cache()
    print(f"\nOne decode step's linears ({LAYERS} layers of q, k, v, o, gate, up, down, plus lm_head), from the graph "
          "timings:\n")
    print_step(step, copy_gbs, "cuBLAS fp16")


def record(step: dict[str, list[float]], shape: str, label: str, config: str, us: float, nbytes: int,
           cublas_us: float, err: float, copy_gbs: float, count: int) -> None:
    """One row of the per-shape table of scripts/gemv_paths.py and batch_paths.py, also added `count` times (calls
    per decode step) to step[label]: [µs, bytes]."""
    gbs = nbytes / us / 1e3
    print(f"| {shape} | {label} | {config} | {us:.2f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f} | "
          f"{cublas_us / us:.2f}x | {err:.1e} |", flush=True)
    step[label][0] += count * us
    step[label][1] += count * nbytes


def time_case(step: dict[str, list[float]], shape: str, label: str, fn: Callable, qw: torch.Tensor, s: torch.Tensor,
              act: torch.Tensor, ref: torch.Tensor, config: Callable[[], str], cublas_us: float, copy_gbs: float,
              count: int) -> None:
    """fn(qw, s, act) checked against ref (its first call autotunes), timed as `measure` does, and recorded; a path
    that raises (does not compile) is a row saying so, not a crash."""
    try:
        err = rel_err(fn(qw, s, act), ref)
    except Exception as e:  # noqa: BLE001
        print(f"| {shape} | {label} | failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
        return
    nbytes = qw.numel() * qw.element_size() + s.numel() * s.element_size()
    us, _ = measure(fn, (qw, s, act), nbytes)
    record(step, shape, label, config(), us, nbytes, cublas_us, err, copy_gbs, count)


def print_step(step: dict[str, list[float]], copy_gbs: float, anchor: str) -> None:
    """The per-step table: for each case its summed [µs, bytes] over a decode step's calls, against `anchor`'s."""
    print("| weights | ms per step | MB read | GB/s | % copy | vs cuBLAS |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, (us, nbytes) in step.items():
        gbs = nbytes / us / 1e3
        print(f"| {key} | {us / 1e3:.3f} | {nbytes / 1e6:.0f} | {gbs:.0f} | {100 * gbs / copy_gbs:.0f} | "
              f"{step[anchor][0] / us:.2f}x |")


if __name__ == "__main__":
    main()
