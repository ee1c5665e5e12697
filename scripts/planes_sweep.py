"""Config sweep of the planes kernel at Llama-3-8B decode products: which tile shapes, warps, stages and K splits
stream fastest at batch 1, 8, 16, 32 (int4, int8 optional), against the autotuned default, the batch-1 GEMV and cuBLAS.

Phase 1 compiles every (config, M_P2, SPLIT) in worker processes (Triton's disk cache); phase 2 times in this one.
Timing: a CUDA graph over weight copies that overflow L2, replayed; ms per call."""
import argparse, itertools, json, math, os, statistics, sys, time, traceback
import multiprocessing as mp

import torch
import triton

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
L2 = 50 * 2**20


def grid_configs(quick, grid="prefetch-x"):
    """wide: every tile shape, warps and stages (scales a tile ahead); prefetch-x: the configs that won in the wide
    grid and their neighbours, each with and without the activations loaded a tile ahead (PREFETCH_X)."""
    if quick:
        return [dict(BLOCK_N=16, BLOCK_K=128, PREFETCH_S=True, PREFETCH_X=x, num_warps=4, num_stages=2)
                for x in (False, True)]
    out = []
    if grid == "wide":
        for bn, bk, w, s in itertools.product((16, 32, 64, 128, 256), (64, 128), (1, 2, 4, 8), (2, 3, 4, 5, 6)):
            if bn * 32 // (32 * w) > 128 or bn * bk // 8 < 32 * w:  # accumulator registers; words per thread
                continue
            out.append(dict(BLOCK_N=bn, BLOCK_K=bk, PREFETCH_S=True, num_warps=w, num_stages=s))
        return out
    for bn, w, st, px in itertools.product((32, 64, 128), (1, 2, 4), (3, 4), (False, True)):
        out.append(dict(BLOCK_N=bn, BLOCK_K=128, PREFETCH_S=True, PREFETCH_X=px, num_warps=w, num_stages=st))
    for bn in (64, 128):
        out += [dict(BLOCK_N=bn, BLOCK_K=128, PREFETCH_S=True, PREFETCH_X=px, num_warps=8, num_stages=3)
                for px in (False, True)]
    return out


def launch(P, qw, s, a, cfg, split_k, bits):
    from automp.kernels.quant import _gemm_split, _split_sum_kernel, _SUM_BLOCK, kernel_group
    from automp.kernels.gemv import num_sms
    m, k = a.shape
    n = qw.shape[0]
    group = kernel_group(k, s.shape[1])
    split, span = _gemm_split(m, n, k, group, num_sms(a.device), split_k, P._WAVES)
    bk = cfg["BLOCK_K"]
    if not (bk <= group and bk * bits // 32 >= 16 and (span >= k or span % bk == 0)):
        return None
    y = torch.empty((m, n), dtype=a.dtype, device=a.device)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    m_p2 = max(16, triton.next_power_of_2(m))
    args = (qw, s, a, out, m, n, k, span, qw.stride(0) // 4, s.stride(0), a.stride(0), a.stride(1), group, bits,
            split > 1, m_p2, True, not P.INTERPRET)
    kw = {k_: v for k_, v in cfg.items()}
    P._wq_planes_kernel.fn[(triton.cdiv(n, cfg["BLOCK_N"]), split)](*args, **kw)

    def call():
        y = torch.empty((m, n), dtype=a.dtype, device=a.device)
        out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
        P._wq_planes_kernel.fn[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
            qw, s, a, out, *args[4:], **kw)
        if split > 1:
            _split_sum_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](out, y, m * n, split, triton.next_power_of_2(split),
                                                                 BLOCK=_SUM_BLOCK)
        return y
    return call, split


def weights(bits, n, k, dev):
    import automp.kernels as K
    q = K.quantize_weight_int4 if bits == 4 else K.quantize_weight_int8
    return q(torch.randn(n, k, device=dev), 128)


def compile_worker(tasks, bits, quick, grid):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    from automp.kernels import planes as P
    done = 0
    cache = {}
    for (shape, m, ci, split_k) in tasks:
        name, n, k = shape
        if (n, k) not in cache:
            cache[(n, k)] = weights(bits, n, k, dev)
        qw, s = cache[(n, k)]
        a = torch.randn(m, k, dtype=torch.float16, device=dev)
        try:
            launch(P, qw, s, a, grid_configs(quick, grid)[ci], split_k, bits)
            done += 1
        except Exception as e:  # noqa: BLE001
            print("compile fail", grid_configs(quick, grid)[ci], repr(e)[:200], flush=True)
    if dev == "cuda":
        torch.cuda.synchronize()
    return done


def graph_time(calls, iters=10):
    if not torch.cuda.is_available():
        for c in calls:
            c()
        return float("nan")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    rounds = max(1, math.ceil(24 / len(calls)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for c in calls:
                c()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    del g
    return 1e3 * statistics.median(ts) / (rounds * len(calls))  # us per call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--grid", default="prefetch-x", choices=["wide", "prefetch-x"])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    bits, quick = args.bits, args.quick
    batches = [int(b) for b in args.batches.split(",")]
    shapes = [("tiny", 48, 512)] if quick else SHAPES
    cfgs = grid_configs(quick, args.grid)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.time()
    # phase 1: compile each (config, M_P2, SPLIT) once, on a representative shape
    tasks, seen = [], set()
    for ci, (m, split_k) in itertools.product(range(len(cfgs)), [(m, sk) for m in batches for sk in (None, 1)]):
        m_p2 = max(16, triton.next_power_of_2(m))
        for shape in ([shapes[0]] if quick else [("down", 4096, 14336)] if split_k is None else [("gate_up", 28672, 4096)]):
            key = (ci, m_p2, split_k)
            if key not in seen:
                seen.add(key)
                tasks.append((shape, m, ci, split_k if split_k else 8))
                if split_k == 1:
                    tasks[-1] = (shape, m, ci, 1)
    if dev == "cuda" and args.workers > 1:
        ctx = mp.get_context("spawn")
        chunks = [tasks[i::args.workers] for i in range(args.workers)]
        with ctx.Pool(args.workers) as pool:
            done = sum(pool.starmap(compile_worker, [(c, bits, quick, args.grid) for c in chunks]))
    else:
        done = compile_worker(tasks, bits, quick, args.grid)
    print(f"compiled {done}/{len(tasks)} in {time.time() - t0:.0f} s, {len(cfgs)} configs", flush=True)

    import automp.kernels as K
    from automp.kernels import planes as P
    rows = []
    for name, n, k in shapes:
        wbytes = n * k * bits // 8 + n * (k // 128) * 2
        copies = max(1, min(16, math.ceil(3 * L2 / wbytes)))
        ws = [weights(bits, n, k, dev) for _ in range(copies)]
        for m in batches:
            xs = [torch.randn(m, k, dtype=torch.float16, device=dev) for _ in range(copies)]
            wd = [torch.randn(n, k, dtype=torch.float16, device=dev) for _ in range(min(copies, 4 if n * k > 2**26 else copies))]
            anchor = graph_time([(lambda w=w, x=x: torch.mm(x, w.t())) for w, x in zip(wd * copies, xs)])
            default = graph_time([(lambda q=q, x=x: K.quant_planes(q[0], q[1], x)) for q, x in zip(ws, xs)])
            gemv = graph_time([(lambda q=q, x=x: K.quant_gemv(q[0], q[1], x[0])) for q, x in zip(ws, xs)]) if m == 1 else None
            best_cfg = str(P._wq_planes_kernel.best_config) if dev == "cuda" else ""
            # reference check of one config (the first fitting)
            res = []
            for ci, cfg in enumerate(cfgs):
                try:
                    made = [launch(P, q[0], q[1], x, cfg, None, bits) for q, x in zip(ws, xs)]
                    if made[0] is None:
                        continue
                    us = graph_time([c for c, _ in made])
                    res.append((us, ci, None, made[0][1]))
                except Exception as e:  # noqa: BLE001
                    pass
            res.sort()
            top = res[: args.top]
            for us, ci, _, _ in list(top):
                for sk in (1, 2, 4, 8, 16):
                    try:
                        made = [launch(P, q[0], q[1], x, cfgs[ci], sk, bits) for q, x in zip(ws, xs)]
                        if made[0] is None:
                            continue
                        res.append((graph_time([c for c, _ in made]), ci, sk, made[0][1]))
                    except Exception:  # noqa: BLE001
                        pass
            res.sort()
            # correctness of the winner
            us, ci, sk, split = res[0]
            ref = xs[0].double() @ K.dequantize_weight(ws[0][0], ws[0][1], k).double().T
            got = launch(P, ws[0][0], ws[0][1], xs[0], cfgs[ci], sk, bits)[0]()
            err = ((got.double() - ref).norm() / ref.norm()).item()
            # confirm: winner vs default alternately
            conf_best, conf_def = [], []
            win = [launch(P, q[0], q[1], x, cfgs[ci], sk, bits)[0] for q, x in zip(ws, xs)]
            for _ in range(3):
                conf_best.append(graph_time(win))
                conf_def.append(graph_time([(lambda q=q, x=x: K.quant_planes(q[0], q[1], x)) for q, x in zip(ws, xs)]))
            row = dict(bits=bits, shape=name, n=n, k=k, m=m, cublas_us=round(anchor, 2), default_us=round(default, 2),
                       default_cfg=best_cfg, gemv_us=None if gemv is None else round(gemv, 2),
                       best_us=round(us, 2), best_cfg=cfgs[ci], best_split_k=sk, best_split=split,
                       confirm_best_us=[round(v, 2) for v in conf_best], confirm_default_us=[round(v, 2) for v in conf_def],
                       best_rel_err=err, gbs_best=round(wbytes / us / 1e3, 1), gbs_default=round(wbytes / default / 1e3, 1),
                       top=[(round(u, 2), cfgs[c], s_, sp) for u, c, s_, sp in res[:8]])
            rows.append(row)
            print(json.dumps({k_: row[k_] for k_ in row if k_ != "top"}), flush=True)
            print("   top:", json.dumps(row["top"][:5]), flush=True)
            del xs, wd
        del ws
        torch.cuda.empty_cache() if dev == "cuda" else None
    meta = {"commit": os.environ.get("C"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
            "seconds": round(time.time() - t0)}
    with open(os.path.join(args.out, f"planes-sweep-{args.grid}-int{bits}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
