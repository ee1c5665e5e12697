"""`automp bench kernels`: every automp kernel against its cuBLAS / torch counterpart, measured in the same run.

Timing: each case is captured in a CUDA graph that runs the call over several copies of its inputs (enough to
overflow L2, so memory-bound kernels stream from DRAM as they would in a model) and the graph's replay time is
divided by the number of calls. That removes Python/launch overhead from both sides equally — the regime of CUDA-graph
LLM decoding — and keeps a 32 MB weight from being served out of a 50 MB L2.
Before timing, a correctness pass runs each kernel on odd shapes on the GPU against a float64 reference.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
from typing import Callable

import torch

from automp.bench.harness import Result, copy_bandwidth_gbps, device_name, markdown_table, time_fn, write_results

SUITE = "kernels"
L2_BYTES = 50 * 2**20


def graph_ms(make_call: Callable[[], Callable[[], object]], bytes_per_call: int, min_calls: int = 24) -> float:
    """Median ms per call of make_call()'s closure, replayed from a CUDA graph over L2-defeating input copies."""
    copies = max(1, min(16, math.ceil(3 * L2_BYTES / max(bytes_per_call, 1))))
    calls = [make_call() for _ in range(copies)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and autotuning) outside the capture
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    rounds = max(1, math.ceil(min_calls / copies))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for c in calls:
                c()
    ms = time_fn(graph.replay, warmup=3, iters=15)
    del graph
    return ms / (rounds * copies)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


class Bench:
    """Collects Results; every row carries our and the anchor's GB/s and TF/s so the table and plot need no re-math."""

    def __init__(self, copy_gbps: float, peak_tflops: float):
        self.copy_gbps, self.peak_tflops = copy_gbps, peak_tflops
        self.results: list[Result] = []
        self.failed: list[str] = []

    def add(self, name: str, ours: Callable[[], Callable], anchor_name: str, anchor: Callable[[], Callable],
            nbytes: int, flops: float, check: float | None = None) -> Result | None:
        try:
            ms = graph_ms(ours, nbytes)
            ams = graph_ms(anchor, nbytes)
        except Exception as e:  # one broken case must not hide the others' numbers
            print(f"  {name} raised {type(e).__name__}: ...{str(e)[-600:]}", flush=True)
            self.failed.append(name)
            return None
        extra = {"GB/s": nbytes / ms / 1e6, "TF/s": flops / ms / 1e9, "anchor GB/s": nbytes / ams / 1e6,
                 "anchor TF/s": flops / ams / 1e9, "%copy BW": 100 * nbytes / ms / 1e6 / self.copy_gbps,
                 "AI flop/B": flops / nbytes}
        if check is not None:
            extra["rel_err"] = check
        r = Result(SUITE, name, ms, anchor_name, ams, extra)
        self.results.append(r)
        print(f"  {name:<34} {ms:9.4f} ms  vs {anchor_name} {ams:9.4f} ms  ({ams / ms:5.2f}x)  "
              f"{extra['GB/s']:7.0f} GB/s {extra['TF/s']:7.1f} TF/s", flush=True)
        return r


def _rand(*shape: int, dtype=torch.float16) -> torch.Tensor:
    return torch.randn(*shape, device="cuda").to(dtype)


def bench_gemv(b: Bench, K, quick: bool) -> None:
    shapes = [(4096, 4096, 1), (8192, 8192, 1), (28672, 8192, 1), (1024, 8192, 1), (8192, 8192, 4)]
    for n, k, bsz in shapes[:2] if quick else shapes:
        w, x = _rand(n, k), _rand(k) if bsz == 1 else _rand(k, bsz)
        err = rel_err(K.gemv(w, x), w.double() @ x.double())

        def ours(n=n, k=k, bsz=bsz):
            wi, xi = _rand(n, k), _rand(k) if bsz == 1 else _rand(k, bsz)
            return lambda: K.gemv(wi, xi)

        def cublas(n=n, k=k, bsz=bsz):
            wi, xi = _rand(n, k), _rand(k) if bsz == 1 else _rand(k, bsz)
            return (lambda: torch.mv(wi, xi)) if bsz == 1 else (lambda: torch.mm(wi, xi))
        b.add(f"gemv fp16 {n}x{k} B={bsz}", ours, "cuBLAS", cublas, 2 * n * k, 2.0 * n * k * bsz, err)
    G = importlib.import_module("automp.kernels.gemv")
    for n, k, split in [] if quick else [(4096, 4096, 2), (4096, 4096, 4), (8192, 8192, 2), (1024, 8192, 1),
                                         (1024, 8192, 2)]:
        def forced(n=n, k=k, split=split):  # the split-K heuristic's alternatives, for the record
            wi, xi = _rand(n, k), _rand(k)
            return lambda: G.gemv(wi, xi, split_k=split)

        def cublas(n=n, k=k):
            wi, xi = _rand(n, k), _rand(k)
            return lambda: torch.mv(wi, xi)
        b.add(f"gemv fp16 {n}x{k} forced split_k={split}", forced, "cuBLAS", cublas, 2 * n * k, 2.0 * n * k)


def bench_gemm(b: Bench, K, quick: bool) -> None:
    shapes = [(4096, 4096, 4096), (8192, 8192, 8192), (64, 8192, 8192), (32, 8192, 8192), (16, 28672, 8192)]
    for m, n, k in shapes[:1] + shapes[2:3] if quick else shapes:
        for dtype in (torch.float16,) if (quick or m < 4096) else (torch.float16, torch.bfloat16):
            a, bb = _rand(m, k, dtype=dtype), _rand(k, n, dtype=dtype)
            err = rel_err(K.gemm(a, bb), a.double() @ bb.double())

            def mk(fn, m=m, n=n, k=k, dtype=dtype):
                def make():
                    ai, bi = _rand(m, k, dtype=dtype), _rand(k, n, dtype=dtype)
                    return lambda: fn(ai, bi)
                return make
            tag = "fp16" if dtype == torch.float16 else "bf16"
            b.add(f"gemm {tag} {m}x{n}x{k}", mk(K.gemm), "cuBLAS", mk(torch.mm), 2 * (m * k + k * n + m * n),
                  2.0 * m * n * k, err)


def bench_quant(b: Bench, K, quick: bool) -> None:
    for n, k in [(8192, 8192)] if quick else [(8192, 8192), (28672, 8192)]:
        for bits, quantize in ((8, K.quantize_weight_int8), (4, K.quantize_weight_int4)):
            qw, s = quantize(_rand(n, k), 128)
            x = _rand(k)
            err = rel_err(K.quant_gemv(qw, s, x), K.dequantize_weight(qw, s, k).double() @ x.double())

            def ours(n=n, k=k, quantize=quantize):
                qi, si = quantize(_rand(n, k), 128)
                xi = _rand(k)
                return lambda: K.quant_gemv(qi, si, xi)

            def cublas(n=n, k=k):
                wi, xi = _rand(n, k), _rand(k)
                return lambda: torch.mv(wi, xi)
            nbytes = qw.numel() * qw.element_size() + s.numel() * s.element_size()
            b.add(f"W{bits}A16 gemv {n}x{k} g128", ours, "cuBLAS fp16 gemv", cublas, nbytes, 2.0 * n * k, err)
    for m in [16] if quick else [16, 64]:
        n = k = 8192
        for bits, quantize in ((8, K.quantize_weight_int8), (4, K.quantize_weight_int4)):
            qw, s = quantize(_rand(n, k), 128)
            a = _rand(m, k)
            err = rel_err(K.quant_gemm(a, qw, s), a.double() @ K.dequantize_weight(qw, s, k).double().T)

            def ours(m=m, quantize=quantize):
                qi, si = quantize(_rand(n, k), 128)
                ai = _rand(m, k)
                return lambda: K.quant_gemm(ai, qi, si)

            nbytes = qw.numel() * qw.element_size() + 2 * m * (n + k)
            b.add(f"W{bits}A16 gemm {m}x{n}x{k} g128", ours, "cuBLAS fp16 mm", _mm_anchor(m, n, k), nbytes,
                  2.0 * m * n * k, err)


def _mm_anchor(m: int, n: int, k: int) -> Callable[[], Callable]:
    """cuBLAS fp16 a [m, k] @ w [n, k]^T: the anchor of a weight-only quantized product on fresh inputs."""
    def make():
        wi, ai = _rand(n, k), _rand(m, k)
        return lambda: torch.mm(ai, wi.t())
    return make


# Llama-3-8B's decode products, (name, N, K): q/k/v joined, o, gate/up joined, down
_LLAMA_8B = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def bench_planes(b: Bench, K, quick: bool) -> None:
    """The batched weight-only kernel (kernels/planes.py) at Llama-3-8B's decode products, autotuned over all its
    configs, and over those that load the scales a tile ahead (PREFETCH_S) or not: what the prefetch buys."""
    P = importlib.import_module("automp.kernels.planes")
    for name, n, k in _LLAMA_8B[2:3] if quick else _LLAMA_8B:
        for m in [8] if quick else [8, 16, 32]:
            for bits, quantize in ((4, K.quantize_weight_int4), (8, K.quantize_weight_int8)):
                qw, s = quantize(_rand(n, k), 128)
                a = _rand(m, k)
                err = rel_err(P.quant_planes(qw, s, a), a.double() @ K.dequantize_weight(qw, s, k).double().T)
                nbytes = qw.numel() * qw.element_size() + s.numel() * s.element_size() + 2 * m * (n + k)
                for prefetch, tag in ((None, "autotuned"), (True, "scales ahead"), (False, "scales in the tile")):
                    def ours(m=m, n=n, k=k, quantize=quantize, prefetch=prefetch):
                        qi, si = quantize(_rand(n, k), 128)
                        ai = _rand(m, k)
                        return lambda: P.quant_planes(qi, si, ai, prefetch=prefetch)
                    b.add(f"W{bits}A16 planes {name} {m}x{n}x{k}, {tag}", ours, "cuBLAS fp16 mm",
                          _mm_anchor(m, n, k), nbytes, 2.0 * m * n * k, err)


def _int_mm_anchor(m: int, n: int, k: int) -> Callable[[], Callable]:
    """torch._int_mm with b column-major (cuBLASLt's preferred int8 layout), row-major if this build refuses."""
    def make():
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
        bt = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
        try:
            torch._int_mm(a, bt.t())
            return lambda: torch._int_mm(a, bt.t())
        except RuntimeError:
            b = bt.t().contiguous()
            return lambda: torch._int_mm(a, b)
    return make


def bench_int8(b: Bench, K, quick: bool) -> None:
    for m, n, k in [(4096, 4096, 4096)] if quick else [(4096, 4096, 4096), (8192, 8192, 8192), (64, 8192, 8192)]:
        a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
        bq = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda").t()
        sa, sb = torch.rand(m, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
        ref = (a.double() @ bq.double()) * sa.double()[:, None] * sb.double()[None, :]
        err = rel_err(K.int8_gemm(a, bq, sa, sb, out_dtype=torch.float32), ref)

        def ours(m=m, n=n, k=k):
            ai = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
            bi = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda").t()
            sai, sbi = torch.rand(m, device="cuda"), torch.rand(n, device="cuda")
            return lambda: K.int8_gemm(ai, bi, sai, sbi, out_dtype=torch.float16)
        b.add(f"int8 gemm {m}x{n}x{k} (+dequant)", ours, "torch._int_mm (int32 out)", _int_mm_anchor(m, n, k),
              m * k + k * n + 2 * m * n, 2.0 * m * n * k, err)


def bench_reduce(b: Bench, K, quick: bool) -> None:
    sizes = [4096 * 4096] * 4 + [4096 * 11008] * 3 + [4096] * 200  # an LLM-block-like mix: few big, many small
    total = sum(sizes)
    grads = [torch.randn(s, device="cuda") for s in sizes]
    inv = torch.tensor([1.0], device="cuda")  # values stay put over thousands of replays

    def ours():
        return lambda: K.unscale_and_check_(grads, inv)

    def torch_amp():
        found = torch.zeros(1, device="cuda")
        return lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    b.add(f"unscale+check {len(sizes)} fp32 tensors", ours, "torch._amp_foreach", torch_amp, 8 * total, total)
    x = _rand(64 * 2**20, dtype=torch.float32)
    b.add("cast fp32->bf16 64M", lambda: (lambda: K.cast(x, torch.bfloat16)), "Tensor.to",
          lambda: (lambda: x.to(torch.bfloat16)), 6 * x.numel(), 0.0,
          float((K.cast(x, torch.bfloat16) != x.to(torch.bfloat16)).sum().item()))


def _sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One decode token's attention as transformers' SDPA path runs it: each KV head repeated for its query heads
    (repeat_kv: expand, then a copy), a boolean mask [B, 1, 1, L], torch's scaled_dot_product_attention."""
    b, hkv, length, d = k.shape
    rep = q.shape[1] // hkv

    def repeat(t: torch.Tensor) -> torch.Tensor:
        return t[:, :, None].expand(b, hkv, rep, length, d).reshape(b, hkv * rep, length, d)
    out = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], repeat(k), repeat(v),
                                                           attn_mask=valid[:, None, None, :])
    return out[:, :, 0]


def bench_attention(b: Bench, K, quick: bool) -> None:
    """automp's decode attention at Llama-3-8B's heads (32 query on 8 KV heads, dim 128) against the SDPA path
    transformers runs at a decode step, over a static cache of L slots of which the first `n` hold tokens."""
    hq, hkv, d = 32, 8, 128
    cases = [(1, 256, 160), (8, 256, 160), (32, 256, 160), (1, 4096, 4000), (8, 1024, 900)]
    for bsz, length, n in cases[:2] if quick else cases:
        def inputs(bsz=bsz, length=length, n=n):
            valid = torch.zeros(bsz, length, dtype=torch.bool, device="cuda")
            valid[:, :n] = True
            return _rand(bsz, hq, d), _rand(bsz, hkv, length, d), _rand(bsz, hkv, length, d), valid
        q, k, v, valid = inputs()
        err = rel_err(K.decode_attention(q, k, v, valid, d ** -0.5),
                      _sdpa_decode(q.double(), k.double(), v.double(), valid))

        def ours(inputs=inputs):
            qi, ki, vi, m = inputs()
            return lambda: K.decode_attention(qi, ki, vi, m, d ** -0.5)

        def sdpa(inputs=inputs):
            qi, ki, vi, m = inputs()
            return lambda: _sdpa_decode(qi, ki, vi, m)
        b.add(f"decode attention B={bsz} L={length} tokens={n}", ours, "SDPA (repeat_kv)", sdpa,
              2 * bsz * hkv * n * d * 2 + 2 * bsz * hq * d * 2, 4.0 * bsz * hq * n * d, err)


PARTS = {"gemv": bench_gemv, "gemm": bench_gemm, "quant": bench_quant, "planes": bench_planes, "int8": bench_int8,
         "reduce": bench_reduce, "attention": bench_attention}


def gpu_checks(K) -> list[tuple[str, float, float]]:
    """(case, rel error, tolerance) on odd shapes against float64; a crashing case reports inf, not the run."""
    torch.manual_seed(0)
    G = importlib.import_module("automp.kernels.gemv")
    cases: list[tuple[str, Callable[[], float], float]] = []
    for dt, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        w = _rand(1000, 777, dtype=dt)
        for x in (_rand(777, dtype=dt), _rand(777, 3, dtype=dt)):
            ref = w.double() @ x.double()
            cases.append((f"gemv {dt} x{tuple(x.shape)}", lambda w=w, x=x, r=ref: rel_err(K.gemv(w, x), r), tol))
            cases.append((f"gemv split-k {dt} x{tuple(x.shape)}",
                          lambda w=w, x=x, r=ref: rel_err(G.gemv(w, x, split_k=5), r), tol))
        for m, n, k, bt in ((37, 1000, 333, True), (300, 1000, 333, False), (5000, 3000, 1000, False)):
            a = _rand(m, k, dtype=dt)
            bb = _rand(n, k, dtype=dt).t() if bt else _rand(k, n, dtype=dt)
            cases.append((f"gemm {dt} {m}x{n}x{k}{' b^T' if bt else ''}",
                          lambda a=a, bb=bb: rel_err(K.gemm(a, bb), a.double() @ bb.double()), tol))
        for quantize in (K.quantize_weight_int8, K.quantize_weight_int4):
            for m in (1, 45, 300):
                qw, s = quantize(_rand(300, 515), 64)
                deq = K.dequantize_weight(qw, s, 515).double()
                a = _rand(m, 515, dtype=dt)
                cases.append((f"{quantize.__name__} gemm M={m} {dt}",
                              lambda qw=qw, s=s, a=a, d=deq: rel_err(K.quant_gemm(a, qw, s), a.double() @ d.T), tol))
            x = a[0].contiguous()
            cases.append((f"{quantize.__name__} gemv {dt}",
                          lambda qw=qw, s=s, x=x, d=deq: rel_err(K.quant_gemv(qw, s, x), d @ x.double()), tol))
    for m, n, k in ((77, 99, 301), (1000, 700, 512)):
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda")
        bq = torch.randint(-128, 128, (k, n), dtype=torch.int8, device="cuda")
        sa, sb, z, bias = torch.rand(m, device="cuda"), torch.rand(n, device="cuda"), \
            torch.randint(-128, 128, (m,), device="cuda"), torch.randn(n, device="cuda")
        ref = ((a.double() - z.double()[:, None]) @ bq.double()) * sa.double()[:, None] * sb.double() + bias.double()
        cases.append((f"int8_gemm asym+bias {m}x{n}x{k}",
                      lambda a=a, bq=bq, sa=sa, sb=sb, bias=bias, z=z, r=ref:
                      rel_err(K.int8_gemm(a, bq, sa, sb, bias, torch.float32, z), r), 1e-6))
        cases.append((f"int8_gemm exact {m}x{n}x{k}", lambda a=a, bq=bq: float(
            (K.int8_gemm(a, bq, torch.ones(a.shape[0], device="cuda"), torch.ones(bq.shape[1], device="cuda"),
                         out_dtype=torch.float32) != (a.double() @ bq.double()).float()).sum()), 0.0))

    def unscale() -> float:
        ts = [torch.randn(n, device="cuda") for n in (5000, 1, 70000)] + [_rand(300, 7, dtype=torch.bfloat16)]
        ts[2][12345] = float("inf")
        ref = [t * 0.25 for t in ts]
        found = K.unscale_and_check_(ts, torch.tensor([0.25], device="cuda"))
        clean = K.unscale_and_check_(ts[:2], torch.tensor([1.0], device="cuda"))
        same = all(torch.equal(t, r) for t, r in zip(ts, ref))
        return abs(found.item() - 1.0) + clean.item() + (0.0 if same else 1.0)
    cases.append(("unscale_and_check_ flags+values", unscale, 0.0))
    x32 = torch.randn(3_000_001, device="cuda") * 1e3
    cases.append(("cast fp32->bf16/fp16 mismatches", lambda: float(
        (K.cast(x32, torch.bfloat16) != x32.bfloat16()).sum() + (K.cast(x32, torch.float16) != x32.half()).sum()), 0.0))
    out = []
    for name, fn, tol in cases:
        try:
            err = fn()
        except Exception as e:  # report and keep going: one broken kernel must not hide the others' numbers
            print(f"  check {name} raised {type(e).__name__}: ...{str(e)[-600:]}")
            err = float("inf")
        out.append((name, err, tol))
    return out


def plot(results: list[Result], copy_gbps: float, peak_tflops: float, path: str) -> None:
    """Roofline: achieved TF/s vs arithmetic intensity, ours filled, anchors hollow, both ceilings drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 6))
    ai = [10 ** (e / 10) for e in range(-10, 41)]
    ax.plot(ai, [min(peak_tflops, a * copy_gbps / 1e3) for a in ai], "k-", lw=1,
            label=f"roof: {copy_gbps:.0f} GB/s copy, {peak_tflops:.0f} TF/s cuBLAS")
    for i, r in enumerate(x for x in results if x.extra.get("TF/s")):
        color = f"C{i % 10}"
        ax.scatter(r.extra["AI flop/B"], r.extra["TF/s"], color=color, label=r.name)
        ax.scatter(r.extra["AI flop/B"], r.extra["anchor TF/s"], facecolors="none", edgecolors=color)
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (flop or op / byte)", ylabel="TF/s (TOP/s)",
           title=f"automp kernels (filled) vs anchors (hollow) — {device_name()}")
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="automp bench kernels")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--quick", action="store_true", help="a few shapes only (smoke test)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of: {', '.join(PARTS)} (default: all)")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    if not parts or not set(parts) <= set(PARTS):
        p.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; choose from {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        print("automp bench kernels: needs a CUDA GPU (the kernels' CPU path is the Triton interpreter)")
        return 1
    K = importlib.import_module("automp.kernels")
    print(f"device: {device_name()}, torch {torch.__version__}", flush=True)
    checks = gpu_checks(K)
    bad = [c for c in checks if not c[1] <= c[2]]
    for name, err, tol in checks:
        print(f"  check {name:<40} rel_err {err:.2e} (tol {tol:.0e}) {'FAIL' if (name, err, tol) in bad else 'ok'}")
    copy_gbps = copy_bandwidth_gbps()
    a, bb = _rand(8192, 8192), _rand(8192, 8192)
    peak = 2 * 8192**3 / time_fn(lambda: torch.mm(a, bb), warmup=5, iters=20) / 1e9  # noqa: F821
    del a, bb
    print(f"ceilings: copy {copy_gbps:.0f} GB/s (read+write), cuBLAS fp16 GEMM 8192^3 {peak:.0f} TF/s", flush=True)
    b = Bench(copy_gbps, peak)
    failed_parts = []
    for part in (PARTS[name] for name in parts):
        try:
            part(b, K, args.quick)
        except Exception as e:  # keep the other parts' numbers
            print(f"  {part.__name__} raised {type(e).__name__}: ...{str(e)[-600:]}", flush=True)
            failed_parts.append(part.__name__)
        torch.cuda.empty_cache()
    b.results.insert(0, Result(SUITE, "ceiling: D2D copy", 0.0, extra={"GB/s": copy_gbps}))
    b.results.insert(1, Result(SUITE, "ceiling: cuBLAS fp16 mm 8192^3", 0.0, extra={"TF/s": peak}))
    command = "automp bench kernels " + " ".join(argv)
    json_path, md_path = write_results(b.results, args.out, SUITE, command)
    with open(md_path, "a") as f:
        f.write("\nGPU correctness checks (odd shapes, float64 reference):\n\n"
                "| check | rel err | tol |\n|---|---:|---:|\n")
        f.writelines(f"| {n} | {e:.2e} | {t:.0e} |\n" for n, e, t in checks)
    plot(b.results[2:], copy_gbps, peak, os.path.join(args.out, f"{SUITE}.png"))
    print(markdown_table(b.results, {"date": "", "device": device_name(), "torch": torch.__version__,
                                     "command": command}))
    print(f"wrote {json_path}, {md_path}, {SUITE}.png; {len(bad)} failed checks, failed parts: {failed_parts}, "
          f"failed cases: {b.failed}", flush=True)
    return 1 if bad or failed_parts or b.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
