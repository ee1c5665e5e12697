"""Weight-only products for a decode batch at Llama-3-8B shapes (fused q/k/v and gate/up, as automp.llm runs them):
the rows kernel (CUDA cores), the tiled GEMM and the planes kernel (tensor cores, each code decoded once; with the
f16x2 assembly or plain Triton), beside cuBLAS fp16 on the
dense weight, at each batch size.

    python scripts/batch_paths.py --batches 8,32 [--bits 4,8] [--variants asm,plain] [--splits 1,2,4]

Timings as scripts/qgemv_sweep.py: "graph" is the per-call median of a CUDA graph over enough weight copies to
overflow L2; GB/s counts the weights and scales a call reads. The step rows sum 32 layers' four products.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qgemv_sweep as sweep  # noqa: E402  (exits without a GPU)
import triton  # noqa: E402

import automp.kernels as K  # noqa: E402
from automp.kernels import planes, quant, quant_batched  # noqa: E402

LAYERS = 32
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
VARIANTS = {"asm": dict(asm=True), "plain": dict(asm=False)}


def _config(kernel) -> str:
    c = getattr(kernel, "best_config", None)
    return f"{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']} w{c.num_warps} s{c.num_stages}" if c is not None else "?"


def cases(m: int, bits: list[int], variants: list[str], splits: list[int]) -> list[tuple[str, int, object, object]]:
    """(label, bits, fn(qw, s, a), the kernel whose config is reported); `splits`: the planes kernel (f16x2) again
    with K forced into that many programs."""
    out = []
    for b in bits:
        if m <= quant_batched.MAX_ROWS and "rows" in variants:
            out.append((f"int{b} rows", b, lambda qw, s, a: quant_batched.quant_gemv_rows(qw, s, a),
                        quant_batched._wq_rows_kernel))
        out.append((f"int{b} gemm", b, lambda qw, s, a: quant.quant_gemm(a, qw, s), quant._wq_gemm_kernel))
        for v in variants:
            out.append((f"int{b} planes {v}", b, lambda qw, s, a, kw=VARIANTS[v]: planes.quant_planes(
                qw, s, a, **kw), planes._wq_planes_kernel))
        for sk in splits:
            out.append((f"int{b} planes split {sk}", b, lambda qw, s, a, sk=sk: planes.quant_planes(
                qw, s, a, split_k=sk), planes._wq_planes_kernel))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="8,32")
    p.add_argument("--bits", default="4,8")
    p.add_argument("--variants", default="asm,plain")
    p.add_argument("--splits", default="", help="forced K splits of the planes kernel, e.g. 1,2,4")
    args = p.parse_args()
    batches = [int(v) for v in args.batches.split(",")]
    bits = [int(v) for v in args.bits.split(",")]
    variants = args.variants.split(",")
    splits = [int(v) for v in args.splits.split(",") if v]
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_gbs = sweep.copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)\n")
    for m in batches:
        print(f"\n### batch {m}\n")
        print("| shape N x K | case | config | graph µs | GB/s | % copy | vs cuBLAS | rel err |")
        print("|---|---|---|---:|---:|---:|---:|---:|")
        step: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for name, n, k in SHAPES:
            w = torch.randn(n, k, device="cuda") * 0.02
            a = torch.randn(m, k, dtype=torch.float16, device="cuda")
            q = {4: K.quantize_weight_int4(w, 128), 8: K.quantize_weight_int8(w, 128)}
            del w
            dense = K.dequantize_weight(*q[4], k).half()
            refs = {b: torch.nn.functional.linear(a.float(), K.dequantize_weight(*q[b], k)) for b in bits}
            cublas, _ = sweep.measure(torch.nn.functional.linear, (a, dense), dense.numel() * 2)
            shape = f"{name} {n}x{k}"
            sweep.record(step, shape, "fp16 cuBLAS", "-", cublas, dense.numel() * 2, cublas, 0.0, copy_gbs, LAYERS)
            for label, b, fn, kernel in cases(m, bits, variants, splits):
                sweep.time_case(step, shape, label, fn, *q[b], a, refs[b], functools.partial(_config, kernel),
                                cublas, copy_gbs, LAYERS)
            del q, dense, refs
            torch.cuda.empty_cache()
        print(f"\nOne decode step's four products at batch {m} ({LAYERS} layers):\n")
        sweep.print_step(step, copy_gbs, "fp16 cuBLAS")


if __name__ == "__main__":
    main()
