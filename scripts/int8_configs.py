"""The int8 GEMM's configs forced one by one (one tile per program, PERSISTENT=0, against persistent grids of 1 and
2 programs per SM), and the autotuned op, at a static int8 BERT-base encoder's shapes (seq 128: M = 8192 for batch 64,
128 for batch 1), with cuBLAS fp16 (F.linear) of the same shape as the anchor.

    PYTHONPATH=src python3 scripts/int8_configs.py [--quick]

Each case is checked against torch's int32 matmul first; a config that fails (wrong result, out of shared memory,
compile error) is reported and skipped. Timing: 20 calls captured in one CUDA graph, median of 10 replays / 20.
Rows also go to $OUT/int8-configs.json (OUT defaults to ./out). Without CUDA it prints the plan and exits.
A one-off script: BENCHMARKS.md, "Encoders, static int8, the GEMM tuned in CUDA graphs", has what it measured.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch
import triton

import automp.kernels as K
from automp.kernels.gemm import graph_bench

I8 = importlib.import_module("automp.kernels.int8_gemm")  # the module: the package attribute is the function

MS = (8192, 128)
KN = ((768, 768), (768, 2304), (768, 3072), (3072, 768))
GELU_REQUANT_KN = (768, 3072)  # the MLP's first GEMM: GELU + the second GEMM's static input quantization


def tile_configs() -> list[tuple]:
    """Every distinct (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) the autotuner is offered."""
    seen = []
    for c in I8.i8_configs(interpret=False):
        key = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
        if key not in seen:
            seen.append(key)
    return seen


def plan() -> list[triton.Config]:
    """Each tile config with PERSISTENT 0, and 1 and 2 where its tile is large enough (BLOCK_M >= 64)."""
    out = []
    for bm, bn, bk, w, s in tile_configs():
        for p in (0, 1, 2) if bm >= 64 else (0,):
            out.append(triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PERSISTENT=p),
                                     num_warps=w, num_stages=s))
    return out


def offered(cfg: triton.Config) -> bool:
    return any(c.kwargs == cfg.kwargs and c.num_warps == cfg.num_warps and c.num_stages == cfg.num_stages
               for c in I8.i8_configs(interpret=False))


def label(cfg: triton.Config) -> str:
    k = cfg.kwargs
    return (f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} w{cfg.num_warps} s{cfg.num_stages} P{k['PERSISTENT']}"
            + ("" if offered(cfg) else " (not offered)"))


def operands(m: int, k: int, n: int, device: str) -> dict:
    """An encoder layer's operands: static activation codes with one scale, a per-channel int8 weight [N, K] passed
    as its K-major [K, N] view, fp32 bias, and the fp16 tensors of the same layer for the anchor."""
    g = torch.Generator(device="cpu").manual_seed(m * 7 + k * 3 + n)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g).to(device)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g).to(device)
    sa = torch.tensor([2e-2 / (k ** 0.5)], device=device)
    sb = ((torch.rand(n, generator=g) + 0.5) * 2e-2).to(device)
    bias = torch.randn(n, generator=g).to(device)
    mult = ((torch.rand(n, generator=g) + 0.5) * 40).to(device)
    return dict(a=a, b=w.t(), sa=sa, sb=sb, bias=bias, mult=mult,
                x16=torch.randn(m, k, generator=g).half().to(device),
                w16=(torch.randn(n, k, generator=g) * k ** -0.5).half().to(device),
                b16=torch.randn(n, generator=g).half().to(device))


def call(ops: dict, epilogue: str, cfg: triton.Config | None):
    """One launch: cfg forced past the autotuner, or None for the autotuned op."""
    if epilogue == "fp16+bias":
        if cfg is None:
            return lambda: K.int8_gemm(ops["a"], ops["b"], ops["sa"], ops["sb"], ops["bias"], torch.float16)
        return lambda: I8.int8_gemm(ops["a"], ops["b"], ops["sa"], ops["sb"], ops["bias"], None, torch.float16,
                                    config=cfg)
    if cfg is None:
        return lambda: K.int8_gemm_requant(ops["a"], ops["b"], ops["sa"], ops["sb"], ops["bias"], ops["mult"],
                                           gelu=True)
    return lambda: I8.int8_gemm(ops["a"], ops["b"], ops["sa"], ops["sb"], ops["bias"], None, torch.float32,
                                gelu=True, requant=(ops["mult"], None), config=cfg)


def reference(ops: dict, epilogue: str) -> torch.Tensor:
    """float64 from torch's int32 product (exact); the requantized codes for the GELU + requant epilogue."""
    a, b = ops["a"], ops["b"]
    acc = torch._int_mm(a, b.contiguous()) if a.is_cuda else a.int() @ b.int()
    y = acc.double() * ops["sa"].double() * ops["sb"].double() + ops["bias"].double()
    if epilogue == "fp16+bias":
        return y
    return torch.round(torch.nn.functional.gelu(y) * ops["mult"].double()).clamp(-127, 127)


def check(out: torch.Tensor, ref: torch.Tensor, epilogue: str) -> str | None:
    """None when out matches ref, else why not."""
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)}"
    if epilogue == "fp16+bias":
        err = ((out.double() - ref).norm() / ref.norm()).item()
        return None if err < 2e-3 else f"rel err {err:.2e}"
    diff = (out.double() - ref).abs()  # near-ties may round the other way (and GELU is the tanh form)
    bad = (diff > 0).double().mean().item()
    return None if diff.max().item() <= 1 and bad < 0.01 else f"codes: max diff {diff.max().item()}, {bad:.2%} off"


def graph_us(fn) -> float:
    """Median per-launch microseconds of 20 launches in one CUDA graph over 10 replays: the autotuner's own timing
    (gemm.graph_bench), so a forced config and the tuned op are timed alike."""
    return graph_bench(fn, None, calls=20, replays=10) * 1e3


def cases(quick: bool) -> list[tuple[int, int, int, str]]:
    out = [(m, k, n, "fp16+bias") for m in MS for k, n in KN]
    out += [(m, *GELU_REQUANT_KN, "gelu+requant") for m in MS]
    return out[:1] + out[-1:] if quick else out


def run_case(m: int, k: int, n: int, epilogue: str, configs: list, device: str, time_it: bool) -> list[dict]:
    ops = operands(m, k, n, device)
    ref = reference(ops, epilogue)
    flops = 2 * m * n * k
    anchor = graph_us(lambda: torch.nn.functional.linear(ops["x16"], ops["w16"], ops["b16"])) if time_it else None
    rows = [dict(shape=f"{m}x{n}x{k}", epilogue=epilogue, config="cuBLAS fp16 F.linear", us=anchor)]
    for cfg in [None] + configs:
        name = "autotuned" if cfg is None else label(cfg)
        row = dict(shape=f"{m}x{n}x{k}", epilogue=epilogue, config=name)
        try:
            fn = call(ops, epilogue, cfg)
            why = check(fn(), ref, epilogue)
            if why is None and time_it:
                row["us"] = graph_us(fn)
        except Exception as e:  # out of shared memory, compile errors: report, go on
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        if why is not None:
            row["skipped"] = why
        rows.append(row)
    for row in rows:
        if row.get("us"):
            row["tops"] = flops / row["us"] * 1e-6
            row["vs_fp16"] = anchor / row["us"] if anchor else None
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| shape (MxNxK) | epilogue | config | us | TOPS | vs fp16 |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        us = f"{r['us']:.1f}" if r.get("us") else r.get("skipped", "-")
        tops = f"{r['tops']:.0f}" if r.get("tops") else ""
        vs = f"{r['vs_fp16']:.2f}x" if r.get("vs_fp16") else ""
        lines.append(f"| {r['shape']} | {r['epilogue']} | {r['config']} | {us} | {tops} | {vs} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="first and last case only")
    args = parser.parse_args()
    configs = plan()
    todo = cases(args.quick)
    print(f"{len(todo)} cases x {len(configs)} forced configs (+ autotuned, + cuBLAS fp16 anchor); "
          f"torch {torch.__version__}, triton {triton.__version__}", flush=True)
    if not torch.cuda.is_available():
        for c in configs:
            print("  ", label(c))
        print("no CUDA device: nothing timed")
        return 0
    rows = []
    for m, k, n, epilogue in todo:
        rows += run_case(m, k, n, epilogue, configs, "cuda", time_it=True)
        print(table([r for r in rows if r["shape"] == f"{m}x{n}x{k}" and r["epilogue"] == epilogue]), flush=True)
    out_dir = os.environ.get("OUT", "./out")
    os.makedirs(out_dir, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(os.path.join(out_dir, "int8-configs.json"), "w") as f:
        json.dump([dict(r, **meta) for r in rows], f, indent=1)
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
