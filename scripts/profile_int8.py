"""Why is W8A8 int8 slower than compiled fp16 on encoders? Per-shape GEMM sweep and per-kernel profiles.

    python scripts/profile_int8.py [--model bert-base|minilm] [--batches 1,64] [--seq 128] [--out DIR]

Part 1, per linear shape of the model (M = batch x seq): CUDA-graph-replayed time of cuBLAS fp16 F.linear (the
anchor's kernel), automp's int8_gemm as the autotuner picks it, the best of every int8 tile config forced one by one
(so the config list can be judged), torch._int_mm (cuBLASLt int8, int32 out, no dequant), and the row quantization
of the input as Inductor compiles it.
Part 2, the whole model: anchor (fp16, reduce-overhead) against automp int8 (dynamic and static), median ms and
the top GPU kernels per forward under torch.profiler.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    sys.exit("profile_int8: needs a CUDA GPU")

import triton  # noqa: E402

from automp import kernels  # noqa: E402
from automp.bench.harness import time_fn  # noqa: E402
from automp.bench.suites import deploy_gpu  # noqa: E402
from automp.bench.suites.kernels import graph_ms  # noqa: E402
from automp.kernels import quant  # noqa: E402

CANDIDATES = [(bm, bn, bk, w, s) for (bm, bn, bk, w, s) in [
    (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 128, 64, 4, 4),
    (128, 256, 64, 8, 4), (64, 128, 128, 4, 4), (64, 64, 256, 4, 3), (64, 64, 128, 4, 4), (128, 64, 128, 4, 4),
    (64, 128, 256, 4, 3), (32, 64, 256, 4, 3), (32, 128, 128, 4, 4), (16, 64, 256, 4, 4), (128, 64, 256, 8, 3),
    (64, 256, 128, 8, 3), (128, 128, 256, 8, 3)]]


def linear_shapes(model: torch.nn.Module) -> dict[tuple[int, int], int]:
    shapes: dict[tuple[int, int], int] = defaultdict(int)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[(m.in_features, m.out_features)] += 1
    return dict(shapes)


def forced(a_q, b_q, sa, sb, bias, cfg):
    bm, bn, bk, w, s = cfg
    m, k = a_q.shape
    n = b_q.shape[1]
    c = torch.empty((m, n), dtype=torch.float16, device="cuda")
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

    def call():
        quant._int8_gemm_kernel.fn[grid](a_q, b_q, c, sa, sb, bias, sa, sa, sa, sa, m, n, k, a_q.stride(0),
                                         a_q.stride(1), b_q.stride(0), b_q.stride(1), 1, 1, True, False, False,
                                         False, False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w,
                                         num_stages=s, EVEN_K=k % bk == 0)
    return call


def sweep(shapes: dict, batches: list[int], seq: int) -> None:
    rowq = torch.compile(lambda x: kernels.quantize_rowwise_int8(x), dynamic=False)
    gelu_lin = torch.compile(lambda x, w, b: F.gelu(F.linear(x, w, b)), dynamic=False)
    print(f"\n{'M':>6} {'K':>5} {'N':>5} {'n':>3} | {'fp16 lin':>8} {'i8 auto':>8} {'i8 best':>8} {'best cfg':>20} "
          f"{'_int_mm':>8} {'rowquant':>8} {'lin+gelu':>8} {'i8 rq':>8} | auto/fp16 best/fp16 rq/(lin+gelu)")
    for b in batches:
        m = b * seq
        for (k, n), count in shapes.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            w = torch.randn(n, k, device="cuda", dtype=torch.float16) / k ** 0.5
            bias = torch.randn(n, device="cuda", dtype=torch.float32)
            qw, ws = kernels.quantize_weight_int8(w.float(), group_size=None)
            ws = ws.reshape(-1).float().contiguous()
            a_q, sa = kernels.quantize_rowwise_int8(x)
            bytes_ = m * k * 2 + n * k * 2 + m * n * 2
            t_lin = graph_ms(lambda: (lambda: F.linear(x, w, bias.half())), bytes_)
            t_auto = graph_ms(lambda: (lambda: kernels.int8_gemm(a_q, qw.t(), sa, ws, bias, out_dtype=torch.float16)),
                              bytes_)
            best, best_cfg = float("inf"), None
            for cfg in CANDIDATES:
                try:
                    t = graph_ms(lambda cfg=cfg: forced(a_q, qw.t(), sa, ws, bias, cfg), bytes_, min_calls=12)
                except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                    print(f"   cfg {cfg}: {type(e).__name__}", file=sys.stderr)
                    continue
                if t < best:
                    best, best_cfg = t, cfg
            try:
                t_im = graph_ms(lambda: (lambda: torch._int_mm(a_q, qw.t())), bytes_)
            except Exception as e:  # noqa: BLE001
                print(f"   _int_mm: {e}", file=sys.stderr)
                t_im = float("nan")
            rowq(x)
            t_q = graph_ms(lambda: (lambda: rowq(x)), m * k * 3)
            gelu_lin(x, w, bias.half())
            t_lg = graph_ms(lambda: (lambda: gelu_lin(x, w, bias.half())), bytes_)
            mult = torch.rand(n, device="cuda") + 20.0
            t_rq = graph_ms(lambda: (lambda: kernels.int8_gemm_requant(a_q, qw.t(), sa, ws, bias, mult, gelu=True)),
                            bytes_)
            print(f"{m:6d} {k:5d} {n:5d} {count:3d} | {t_lin * 1e3:7.1f}u {t_auto * 1e3:7.1f}u {best * 1e3:7.1f}u "
                  f"{str(best_cfg):>20} {t_im * 1e3:7.1f}u {t_q * 1e3:7.1f}u {t_lg * 1e3:7.1f}u {t_rq * 1e3:7.1f}u | "
                  f"{t_lin / t_auto:6.2f}x {t_lin / best:6.2f}x {t_lg / t_rq:6.2f}x", flush=True)


def profile(fn, label: str, out: str | None, steps: int = 10) -> None:
    from torch.profiler import ProfilerActivity, profile as prof

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name][0] += 1
            agg[e.name][1] += e.device_time
    total = sum(v[1] for v in agg.values()) / steps
    print(f"\n-- {label}: {total:.1f} us GPU per forward, {sum(v[0] for v in agg.values()) / steps:.0f} kernels")
    for name, (cnt, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"   {us / steps:8.1f} us  x{cnt / steps:5.1f}  {name[:90]}")
    if out:
        p.export_chrome_trace(os.path.join(out, f"trace-{label.replace(' ', '_')}.json"))


def whole(name: str, batches: list[int], seq: int, out: str | None) -> None:
    from automp.deploy.quantized import TorchQuantConfig, quantize_module

    fp32, make = deploy_gpu.load_minilm() if name == "minilm" else deploy_gpu.load_bert_base(False)
    fp32 = fp32.eval().cuda()
    calib = [{k: v.cuda() for k, v in make(16, seq, 200 + i).items()} for i in range(2)]
    inputs = {b: {k: v.cuda() for k, v in make(b, seq, 7).items()} for b in batches}
    with torch.no_grad():
        anchor = torch.compile(copy.deepcopy(fp32).half(), mode="reduce-overhead", dynamic=False)
        int8, _ = quantize_module(fp32, "int8", calib, TorchQuantConfig(measure=False, activations="dynamic"))
        static, _ = quantize_module(fp32, "int8", calib, TorchQuantConfig(measure=False, activations="static"))
        for label, model in (("anchor", anchor), ("int8", int8), ("int8-static", static)):
            for b in batches:
                fn = lambda model=model, b=b: model(**inputs[b])  # noqa: E731
                ms = time_fn(fn, warmup=10, iters=50)
                print(f"{name} bs{b} {label}: {ms:.3f} ms", flush=True)
                profile(fn, f"{name} bs{b} {label}", out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="bert-base", choices=("bert-base", "minilm"))
    p.add_argument("--batches", default="1,64")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", default=None)
    p.add_argument("--skip-sweep", action="store_true")
    p.add_argument("--skip-whole", action="store_true")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    fp32, _ = deploy_gpu.load_minilm() if a.model == "minilm" else deploy_gpu.load_bert_base(False)
    if not a.skip_sweep:
        sweep(linear_shapes(fp32), batches, a.seq)
    if not a.skip_whole:
        whole(a.model, batches, a.seq, a.out)


if __name__ == "__main__":
    main()
