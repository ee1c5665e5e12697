"""`automp llm bench [--quick] [--out DIR]`: decode speed and accuracy of weight-only int8 / int4.

A benchmark suite (automp.bench imports the library, never the reverse): the `automp` command routes `llm bench`
here.

Speed, batch 1 (GPU: TinyLlama-1.1B-shaped random model, prompt 32, 128 new tokens), all in one process:
  hf-generate-fp16   transformers' generate (dynamic cache, eager): the anchor
  automp-fp16        automp.llm.generate with fp16 weights (static cache, compiled + CUDA-graph decode step)
  automp-int8-g128   the same with int8 weights,  automp-int4-g128  with int4 weights
  automp-int4-g128-unfused  int4 with q/k/v and gate/up as separate GEMV calls (quantize(fuse=False)): what the
                     fused calls (automp.llm.fuse; 4 GEMVs per Llama layer instead of 7) gain
Each row: tokens/s over the whole call (prompt included), decode ms/token = (t(N) - t(1)) / (N - 1), peak memory,
weight bytes and their ratio to fp16, and the fraction of the bandwidth roofline: the decode step must read every
weight but the input embedding once, so its floor is those bytes / the device-to-device copy bandwidth measured here.

Accuracy: a small Llama (GPU: 4 layers, d=256; byte-level) trained here on the Python standard library's docstrings
(read with `ast` from the source files, not imported: importing the whole stdlib has side effects), then held-out
perplexity (files split by a hash of their path) for fp16, int8, int4 and int4 + AWQ, and the change vs fp16.

Speed matrix (automp.bench.llm_speed), when any of its options (--model, --layers, --batches, --cases, --repeats,
--case-timeout, --time-limit, --profile) is given:
fp16-compiled (the anchor), automp-int8/int4 and torchao-int8/int4 at each batch size on a random Llama-3-8B-shaped
(or TinyLlama-shaped) model, rows merged into `<out>/llm-<gpu>.json`; --profile adds where one decode step's kernel
time goes (automp.bench.llm_profile). Speed only.

--quick: the same on the CPU with tiny models (Triton interpreter for the kernels), a smoke test of under a minute.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from automp.bench.harness import copy_bandwidth_gbps, device_name, free, gpu_slug, provenance, usage_problem
from automp.bench.llm_results import CASES
from automp.files import write_json_and_markdown
from automp.llm.corpus import stdlib_docstrings
from automp.timing import time_fn

__all__ = ["main", "build_parser", "stdlib_docstrings", "as_tokens", "train_lm", "perplexity", "speed", "accuracy"]


@dataclass(frozen=True)
class BenchConfig:
    device: str
    model: str             # speed: built-in model
    prompt: int
    new_tokens: int
    repeats: int
    warmup: bool           # one untimed run first (compile, capture, autotune)
    group: int
    acc_model: str         # accuracy: built-in byte-level model, trained here
    train_seconds: float
    max_steps: int
    seq: int
    batch: int
    eval_seqs: int
    corpus_bytes: int


GPU = BenchConfig("cuda", "llama-1b", 32, 128, 3, True, 128, "llama-small", 75.0, 4000, 256, 32, 64,
                  3_000_000)  # more than the stdlib has (about 1.5 MB of docstrings): all of it
QUICK = BenchConfig("cpu", "tiny-llama", 8, 4, 1, False, 32, "tiny-llama", 8.0, 400, 64, 16, 1, 300_000)


def _log(msg: str) -> None:
    print(f"[llm bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- data
def as_tokens(text: bytes, device: torch.device | str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device)


# ----------------------------------------------------------------------------------------------- training / eval
def train_lm(model: torch.nn.Module, data: torch.Tensor, steps: int, seq: int, batch: int, lr: float = 2e-3,
             seconds: float = float("inf"), seed: int = 0) -> dict:
    """Next-byte training on random crops of `data` (uint8 [n]) for `steps` steps or `seconds`, whichever ends first;
    the cosine schedule follows whichever is further along, so a time-capped run still anneals."""
    if data.numel() < seq + 2:
        raise ValueError(f"training data has {data.numel()} tokens, need more than {seq + 1}")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq + 1, device=data.device)
    cuda = data.device.type == "cuda"
    t0, recent, step = time.perf_counter(), [], 0
    while step < steps:
        progress = max(step / steps, (time.perf_counter() - t0) / seconds)
        if progress >= 1:
            break
        warm = min(1.0, (step + 1) / 50)
        for group in opt.param_groups:
            group["lr"] = lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        start = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen).to(data.device)
        x = data[start[:, None] + offsets].long()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = recent[-19:] + [loss.detach()]  # no per-step sync: read once at the end
        step += 1
    model.eval()
    loss_end = float(torch.stack(recent).mean()) if recent else None
    return {"steps": step, "seconds": round(time.perf_counter() - t0, 1), "train_loss_last20": loss_end}


@torch.no_grad()
def perplexity(model: torch.nn.Module, data: torch.Tensor, seq: int, n_seqs: int, batch: int = 8) -> float:
    """exp(mean next-token NLL) over the first n_seqs non-overlapping windows of data."""
    n = min(n_seqs, (data.numel() - 1) // seq)
    if n < 1:
        raise ValueError(f"evaluation data has {data.numel()} tokens, need more than {seq}")
    rows = torch.stack([data[i * seq: i * seq + seq + 1] for i in range(n)]).long()
    nll = 0.0
    for chunk in rows.split(batch):
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        nll += float(F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
    return math.exp(nll / (n * seq))


# ----------------------------------------------------------------------------------------------- speed
def _decode_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every weight once, except the input embedding (one row per token) unless it is
    also the output head."""
    from automp.llm.quantize import input_embedding, weight_bytes
    _, _, emb_bytes, tied = input_embedding(model)
    return weight_bytes(model) - (0 if tied else emb_bytes)


def speed_case(name: str, model: torch.nn.Module, run: Callable[[int], torch.Tensor], cfg: BenchConfig,
               bandwidth_gbps: float, fp16_bytes: int) -> dict:
    from automp.llm.generate import decode_info
    from automp.llm.quantize import weight_bytes
    device = torch.device(cfg.device)
    n = cfg.new_tokens
    t0 = time.perf_counter()
    out = run(n) if cfg.warmup else None
    warm = time.perf_counter() - t0
    if out is not None and out.shape[1] != cfg.prompt + n:
        raise RuntimeError(f"{name}: generated {out.shape[1] - cfg.prompt} tokens, expected {n}")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    full = time_fn(lambda: run(n), warmup=0, iters=cfg.repeats, device=device) / 1e3
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    one = time_fn(lambda: run(1), warmup=0, iters=cfg.repeats, device=device) / 1e3
    per_token = (full - one) / (n - 1) if full > one else float("nan")  # nan: below timing noise
    floor = _decode_bytes(model) / (bandwidth_gbps * 1e9)
    info = decode_info(model) if name.startswith("automp") else {"cache": "dynamic", "mode": "eager"}
    row = {"case": name, "weight_mib": weight_bytes(model) / 2**20, "weight_ratio": weight_bytes(model) / fp16_bytes,
           "tokens_per_s": n / full, "decode_ms_per_token": per_token * 1e3, "decode_tokens_per_s": 1 / per_token,
           "roofline_fraction": floor / per_token, "peak_mib": peak / 2**20 if peak is not None else None,
           "warmup_s": warm, "decode": info.get("mode"), "note": info.get("reason", "")}
    row = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}  # JSON has no NaN
    _log(f"{name}: decode {row['decode_ms_per_token']} ms/token, {row['tokens_per_s']:.1f} tokens/s, roofline "
         f"fraction {row['roofline_fraction']}, warm-up {warm:.1f} s, decode step {row['decode']} {row['note']}")
    return row


def speed(cfg: BenchConfig, mode: str) -> tuple[list[dict], float]:
    from automp.llm.generate import generate
    from automp.llm.quantize import quantize, weight_bytes
    from automp.llm.store import build
    device = torch.device(cfg.device)
    bandwidth = copy_bandwidth_gbps(2**30 if device.type == "cuda" else 2**26)
    _log(f"copy bandwidth {bandwidth:.0f} GB/s")
    base = build(cfg.model, device, torch.float16)
    ids = torch.randint(0, base.config.vocab_size, (1, cfg.prompt), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    fp16_bytes = weight_bytes(base)

    def hf(n: int) -> torch.Tensor:  # an explicit mask: a prompt token equal to pad_token_id is not padding
        return base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)

    rows = [speed_case("hf-generate-fp16", base, hf, cfg, bandwidth, fp16_bytes),
            speed_case("automp-fp16", base, lambda n: generate(base, ids, n, mode=mode), cfg, bandwidth, fp16_bytes)]
    base = None  # free it (and its decoder) before the quantized models
    free()
    edges = dict(quantize_lm_head=True, quantize_embeddings=True, edge_scheme="int8")  # the <= 30% memory variant
    cases = (("int8", {}, ""), ("int4", {}, ""), ("int4", {"fuse": False}, "-unfused"), ("int4", edges, "-edges-int8"))
    for scheme, kw, suffix in cases:
        q = quantize(build(cfg.model, device, torch.float16), scheme, cfg.group, **kw)
        run = lambda n, q=q: generate(q, ids, n, mode=mode)  # noqa: E731
        rows.append(speed_case(f"automp-{scheme}-g{cfg.group}{suffix}", q, run, cfg, bandwidth, fp16_bytes))
        q = None
        free()
    return rows, bandwidth


# ----------------------------------------------------------------------------------------------- accuracy
def accuracy(cfg: BenchConfig) -> dict:
    from automp.llm.quantize import quantize
    from automp.llm.store import build
    device = torch.device(cfg.device)
    t0 = time.perf_counter()
    train_text, held_text = stdlib_docstrings(cfg.corpus_bytes)
    _log(f"corpus: {len(train_text)} train / {len(held_text)} held-out bytes in {time.perf_counter() - t0:.1f} s")
    train, held = as_tokens(train_text, device), as_tokens(held_text, device)
    model = build(cfg.acc_model, device, torch.float32)
    stats = train_lm(model, train, cfg.max_steps, cfg.seq, cfg.batch, seconds=cfg.train_seconds)
    _log(f"trained {cfg.acc_model}: {stats}")
    calib = train[: 16 * cfg.seq].long().view(16, cfg.seq)
    variants = {
        "fp32": lambda m: m,
        "fp16": lambda m: m.half(),
        "int8": lambda m: quantize(m, "int8", cfg.group),
        "int4": lambda m: quantize(m, "int4", cfg.group),
        "int4-awq": lambda m: quantize(m, "int4", cfg.group, calib=calib, awq=True),
        # the smallest files: lm_head and the input embedding quantized too (what int4's memory target needs)
        "int8-all": lambda m: quantize(m, "int8", cfg.group, quantize_lm_head=True, quantize_embeddings=True),
        "int4-all": lambda m: quantize(m, "int4", cfg.group, quantize_lm_head=True, quantize_embeddings=True),
        "int4-edges-int8": lambda m: quantize(m, "int4", cfg.group, quantize_lm_head=True, quantize_embeddings=True,
                                              edge_scheme="int8"),
    }
    rows = []
    for name, make in variants.items():
        ppl = perplexity(make(copy.deepcopy(model)), held, cfg.seq, cfg.eval_seqs)
        rows.append({"case": name if name.startswith("fp") else f"{name}-g{cfg.group}", "ppl": ppl})
        _log(f"{rows[-1]['case']}: held-out perplexity {ppl:.4f}")
    ref = rows[1]["ppl"]
    for r in rows:
        r["rel_change_vs_fp16"] = r["ppl"] / ref - 1
    return {"model": cfg.acc_model, "train": stats, "train_bytes": len(train_text), "heldout_bytes": len(held_text),
            "eval_tokens": min(cfg.eval_seqs, (held.numel() - 1) // cfg.seq) * cfg.seq, "rows": rows}


# ----------------------------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    m, acc = result["meta"], result["accuracy"]
    c = m["config"]
    lines = [f"{m['date']} · {m['device']} · torch {m['torch']} · transformers {m['transformers']} · "
             f"`{m['command']}`"]
    if result["speed"]:
        lines += ["", f"Decode, batch 1, {c['model']}, prompt {c['prompt']}, {c['new_tokens']} new tokens; copy "
                  f"bandwidth {m['bandwidth_gbps']:.0f} GB/s", "",
                  "| case | weights MiB | vs fp16 | tokens/s | decode ms/token | decode tokens/s | roofline | peak MiB "
                  "| decode |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["speed"]:
        f = {k: ("" if v is None else format(v, spec)) for k, spec in
             (("peak_mib", ".0f"), ("decode_ms_per_token", ".3f"), ("decode_tokens_per_s", ".1f"),
              ("roofline_fraction", ".2f")) for v in [r[k]]}
        lines.append(f"| {r['case']} | {r['weight_mib']:.1f} | {r['weight_ratio']:.3f} | {r['tokens_per_s']:.1f} | "
                     f"{f['decode_ms_per_token']} | {f['decode_tokens_per_s']} | {f['roofline_fraction']} "
                     f"| {f['peak_mib']} | {r['decode']} |")
    if acc is None:
        return "\n".join(lines) + "\n"
    t = acc["train"]
    lines += ["", f"Held-out perplexity (bytes), {acc['model']} trained {t['steps']} steps / {t['seconds']} s on "
              f"{acc['train_bytes']} bytes of stdlib docstrings, evaluated on {acc['eval_tokens']} held-out tokens", "",
              "| case | perplexity | vs fp16 |", "|---|---:|---:|"]
    lines += [f"| {r['case']} | {r['ppl']:.4f} | {100 * r['rel_change_vs_fp16']:+.2f}% |" for r in acc["rows"]]
    return "\n".join(lines) + "\n"


def write(result: dict, out: str) -> tuple[str, str]:
    return write_json_and_markdown(out, "llm", result, markdown(result))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="automp llm bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models on the CPU (smoke test, < 1 minute)")
    p.add_argument("--out", default="bench-results",
                   help="directory for llm.json and llm.md (the speed matrix: llm-<gpu>.json and .md)")
    p.add_argument("--decode", choices=["compile", "graph", "eager"], default="compile",
                   help="decode step of automp rows: compiled + CUDA graph, CUDA graph only, or eager")
    p.add_argument("--train-seconds", type=float, default=None, help="cap on the accuracy model's training time")
    p.add_argument("--only", choices=["speed", "accuracy"], default=None, help="run one half of the benchmark")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens generated per timed speed call (default 128; --quick 4)")
    m = p.add_argument_group("speed matrix (any of these: decode speed by case and batch size, into "
                             "<out>/llm-<gpu>.json, merged with earlier runs; speed only)")
    m.add_argument("--model", default=None, help="llama-8b-shape (default) or llama-1b: random weights, built here")
    m.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own: 32 / 22)")
    m.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1)")
    m.add_argument("--cases", default=None, help="comma-separated, of: " + ", ".join(CASES) + " (default: all)")
    m.add_argument("--repeats", type=int, default=None,
                   help="alternating rounds per batch size (default 5): each round times every case once, in "
                        "reversed order every other round; a row is the median of its rounds, with their spread")
    m.add_argument("--case-timeout", type=float, default=None,
                   help="seconds per case (default 150 per batch size; 0 = none): its model's build and the "
                        "warm-up (compile, capture) of all its batch sizes, not the timed rounds; the rest is skipped")
    m.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole matrix (default 0 = none): cases not started by then are skipped")
    m.add_argument("--profile", action="store_true",
                   help="also profile one decode step per case and batch size (batch 1 if none is given) into "
                        "<out>/llm-profile-<gpu>.json")
    return p


_CASE_SECONDS = 150.0  # --case-timeout's default per batch size


def _batches(text: str) -> tuple[tuple[int, ...], str | None]:
    """--batches as sizes in the given order, or a usage error."""
    try:
        sizes = tuple(dict.fromkeys(int(b) for b in text.split(",")))
    except ValueError:
        return (), f"--batches: expected comma-separated whole numbers, got {text!r}"
    if min(sizes) < 1:
        return (), f"--batches: batch sizes must be at least 1, got {text!r}"
    return sizes, None


def _matrix(args: argparse.Namespace, argv: Sequence[str] | None, cfg: BenchConfig) -> int:
    """The speed matrix (automp.bench.llm_speed): usage errors before any work, one line, rc 2."""
    from automp.bench import llm_profile
    from automp.bench.llm_results import Results, markdown as matrix_markdown
    from automp.bench.llm_speed import MODELS, Matrix, run_matrix
    slug = gpu_slug(device_name(cfg.device))
    batches, error = _batches(args.batches or "1")
    # Each batch size compiles, autotunes and captures its own step (at 32 layers of the 8B shape about 100 s for
    # int4), so the default grows with them: a flat 150 s skipped batch 16 and 32 of `--batches 8,16,32`.
    case_timeout = _CASE_SECONDS * max(1, len(batches)) if args.case_timeout is None else args.case_timeout
    time_limit = args.time_limit or 0.0
    repeats = 5 if args.repeats is None else args.repeats
    model = args.model or "llama-8b-shape"
    error = error or (f"--model: unknown {model!r}; choose from {', '.join(MODELS)}" if model not in MODELS else None)
    error = error or ("the speed matrix's options measure speed: drop --only accuracy"
                      if args.only == "accuracy" else None)
    error = error or usage_problem(
        [("--cases", args.cases or ",".join(CASES), CASES)],
        [("--layers", 1 if args.layers is None else args.layers, 1), ("--repeats", repeats, 1),
         ("--case-timeout", case_timeout, 0), ("--time-limit", time_limit, 0)],
        os.path.join(args.out, f"llm-{slug}"), exts=(".json", ".md"))
    try:
        results = Results(args.out, f"llm-{slug}", matrix_markdown) if not error else None
        profiles = Results(args.out, f"llm-profile-{slug}", llm_profile.markdown) if args.profile and results \
            else None
    except ValueError as e:
        error = f"--out: {e}"
    if error:
        print(f"automp llm bench: error: {error}", file=sys.stderr)
        return 2
    if not args.quick and not torch.cuda.is_available():
        print("automp llm bench: error: the speed matrix needs a CUDA GPU (use --quick on the CPU)", file=sys.stderr)
        return 1
    m = Matrix(model=model, layers=args.layers, batches=batches, cases=tuple((args.cases or ",".join(CASES)).split(
        ",")), prompt=cfg.prompt, new_tokens=cfg.new_tokens, repeats=repeats, group=cfg.group,
        device=cfg.device, tiny=args.quick, mode="eager" if cfg.device == "cpu" else args.decode,
        case_timeout=case_timeout, time_limit=time_limit, profile=args.profile)
    meta = {**provenance(cfg.device), "command": "automp llm bench " + " ".join(argv or []),
            "run": time.strftime("%Y-%m-%dT%H:%M:%S")}  # which rows were timed in the same rounds (llm_results)
    run_matrix(m, results, profiles, meta, _log)
    print(matrix_markdown(results.rows))
    if profiles is not None:
        print(llm_profile.markdown(profiles.rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as e:
        print(f"automp llm bench: error: needs the {e.name} package: pip install automp[llm]", file=sys.stderr)
        return 2
    cfg = QUICK if args.quick else GPU
    if cfg.device == "cpu":
        if "triton" not in sys.modules:  # exercise the kernels (interpreted), not the torch fallback
            os.environ.setdefault("TRITON_INTERPRET", "1")
        # Tiny ops: with a second thread, each op waits on a busy core's scheduler slice (100x slower under load).
        torch.set_num_threads(1)
    if args.new_tokens is not None:
        if args.new_tokens < 2:
            print(f"automp llm bench: error: --new-tokens must be at least 2, got {args.new_tokens}", file=sys.stderr)
            return 2
        cfg = replace(cfg, new_tokens=args.new_tokens)
    if args.profile or any(v is not None for v in (args.model, args.layers, args.batches, args.cases, args.repeats,
                                                    args.case_timeout, args.time_limit)):
        return _matrix(args, argv, cfg)
    if not args.quick and not torch.cuda.is_available():
        print("automp llm bench: error: the full benchmark needs a CUDA GPU (use --quick on the CPU)", file=sys.stderr)
        return 1
    if args.train_seconds is not None:
        cfg = replace(cfg, train_seconds=args.train_seconds)
    mode = "eager" if cfg.device == "cpu" else args.decode
    t0 = time.perf_counter()
    rows, bandwidth = speed(cfg, mode) if args.only != "accuracy" else ([], None)
    acc = accuracy(cfg) if args.only != "speed" else None
    result = {"meta": {**provenance(cfg.device), "transformers": transformers.__version__,
                       "command": "automp llm bench " + " ".join(argv or []), "bandwidth_gbps": bandwidth,
                       "config": asdict(cfg), "seconds": round(time.perf_counter() - t0, 1)},
              "speed": rows, "accuracy": acc}
    for path in write(result, args.out):
        _log(f"wrote {path}")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
