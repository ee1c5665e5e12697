"""Weight-only GEMV decodings at Llama-3-8B decode shapes (fused q/k/v and gate/up, as automp.llm runs them): the
byte path (fp32 decoding) against the word path (int32 words, f16x2 assembly), int8 and int4, the word path also
with forced K splits (the heuristic's choice against 1, 2, 4 and 8 programs along K), beside cuBLAS fp16 on the
dense weight.

    python scripts/gemv_paths.py     # a few minutes on an H100, mostly autotuning

Timings as scripts/qgemv_sweep.py: "graph" is the per-call median of a CUDA graph over enough weight copies to
overflow L2; GB/s counts the weights and scales a call reads. The step row sums 32 layers plus lm_head.
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qgemv_sweep as sweep  # noqa: E402  (exits without a GPU)
import triton  # noqa: E402

import automp.kernels as K  # noqa: E402
from automp.kernels import gemv_quant  # noqa: E402

LAYERS = 32
SHAPES = [("qkv", 6144, 4096, LAYERS), ("o", 4096, 4096, LAYERS), ("gate_up", 28672, 4096, LAYERS),
          ("down", 4096, 14336, LAYERS), ("lm_head", 128256, 4096, 1)]
FORCED = (1, 2, 4, 8)


def main() -> None:
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_gbs = sweep.copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)\n")
    print("| shape N x K | case | config | graph µs | GB/s | % copy | vs cuBLAS | rel err |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    step: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, n, k, count in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        x = torch.randn(k, dtype=torch.float16, device="cuda")
        q4, q8 = K.quantize_weight_int4(w, 128), K.quantize_weight_int8(w, 128)
        del w
        dense = K.dequantize_weight(*q4, k).half()
        refs = {id(q4): torch.nn.functional.linear(x, dense),
                id(q8): torch.nn.functional.linear(x, K.dequantize_weight(*q8, k).half())}
        cublas, _ = sweep.measure(torch.nn.functional.linear, (x, dense), dense.numel() * 2)
        cases = [("int8 bytes", q8, "bytes", None), ("int8 f16x2", q8, "f16x2", None),
                 ("int4 bytes", q4, "bytes", None), ("int4 f16x2", q4, "f16x2", None)]
        cases += [(f"int{b} f16x2 split {sk}", q, "f16x2", sk) for b, q in ((8, q8), (4, q4)) for sk in FORCED]
        shape = f"{name} {n}x{k}"
        sweep.record(step, shape, "fp16 cuBLAS", "-", cublas, dense.numel() * 2, cublas, 0.0, copy_gbs, count)
        for label, q, path, split_k in cases:
            fn = (lambda a, b, c, p=path, sk=split_k: gemv_quant.quant_gemv(a, b, c, split_k=sk, path=p))
            sweep.time_case(step, shape, label, fn, *q, x, refs[id(q)], sweep.picked_config, cublas, copy_gbs, count)
        del q4, q8, dense, refs
        torch.cuda.empty_cache()
    print(f"\nOne decode step's linears ({LAYERS} layers + lm_head):\n")
    sweep.print_step(step, copy_gbs, "fp16 cuBLAS")


if __name__ == "__main__":
    main()
