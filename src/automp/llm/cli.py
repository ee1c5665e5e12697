"""`automp llm quantize | generate | bench`.

    automp llm quantize --model {tiny-llama,tiny-gpt2,llama-small,llama-1b|DIR} --bits 4 --group-size 128 -o OUT
    automp llm generate OUT --prompt "def " --max-new-tokens 64
    automp llm bench [--quick] [--out DIR]

Built-in models have seeded random weights (no hub downloads); text goes through the model directory's transformers
tokenizer when it has one, else the built-in byte tokenizer (UTF-8 bytes = ids 0..255). `generate` says when a model
is a built-in (its text is noise) and prints the text's non-printable characters escaped (\\x1b), so no output can
drive the terminal. User errors print one line and return 1, like `automp optimize`; usage errors (an output that
would overwrite the source model, a missing optional package, --device cuda without a CUDA device) return 2, before
any work. `automp llm bench` is a benchmark suite (automp.bench.suites.llm): the `automp` command routes it there,
since library code does not import the benchmarks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

import torch

from automp.argtypes import int_at_least

USER_ERRORS = (ValueError, TypeError, OSError, RuntimeError)


class UsageError(Exception):
    """A command line that cannot be run as given: one line, rc 2, nothing done."""


def require_transformers() -> None:
    """transformers and safetensors are an optional extra: without them a command stops with one line that says
    how to install them, before any work."""
    for name in ("transformers", "safetensors"):
        try:
            __import__(name)
        except ImportError:
            raise UsageError(f"needs the {name} package: pip install automp[llm]") from None


def _group(text: str) -> int | None:
    if text.lower() in ("none", "0", "channel"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a power of two >= 32 or 'none', got {text!r}") from None


_positive = int_at_least(1)


def build_parser() -> argparse.ArgumentParser:
    from automp.llm.store import BUILTIN
    parser = argparse.ArgumentParser(prog="automp llm", description="Weight-only quantized LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="quantize a model and save it")
    q.add_argument("--model", required=True, help=f"built-in ({', '.join(BUILTIN)}; random weights) or a local "
                                                  "transformers model directory")
    q.add_argument("--bits", type=int, choices=[4, 8], default=4, help="weight bits (default 4)")
    q.add_argument("--group-size", type=_group, default=128, help="power of two >= 32, or 'none' (one scale per row)")
    q.add_argument("--awq", action="store_true", help="activation-aware scales searched on calibration text")
    q.add_argument("--calib-text", metavar="FILE", default=None,
                   help="calibration text for --awq (default: Python standard library docstrings)")
    q.add_argument("--lm-head", action="store_true", help="quantize lm_head too (kept fp16 by default)")
    q.add_argument("--embeddings", action="store_true",
                   help="quantize the input embedding too (kept fp16 by default; with --lm-head: the smallest file)")
    q.add_argument("--edge-bits", type=int, choices=(4, 8), default=None,
                   help="bits of lm_head and the embedding where quantized (default: --bits; 8 keeps int4 models "
                        "accurate at <= 30%% of fp16 memory)")
    q.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                   help="dtype of activations and of the weights left unquantized (default float16)")
    q.add_argument("--no-fuse", action="store_true",
                   help="keep q/k/v and gate/up as separate kernel calls (default: one call per group, same results; "
                        "saved with the model)")
    q.add_argument("--device", default=None, help="where to quantize (default: cuda if available, else cpu)")
    q.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="directory to save to: new, empty, or an earlier save (replaced as a whole); not the source "
                        "model")
    g = sub.add_parser("generate", help="generate text with a saved quantized model")
    g.add_argument("model", metavar="DIR", help="a directory written by `automp llm quantize`")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=_positive, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    g.add_argument("--top-k", type=_positive, default=None,
                   help="sample only from the k most likely tokens (default: all; needs --temperature > 0)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default 0)")
    g.add_argument("--mode", choices=["auto", "compile", "graph", "eager"], default="auto",
                   help="decode step: compiled and captured as a CUDA graph, captured only, or eager; auto = compile "
                        "on CUDA, eager elsewhere")
    g.add_argument("--attention", choices=["auto", "model", "kernel"], default="auto",
                   help="the decode step's attention: the model's own (SDPA), automp's decode kernel, or auto = the "
                        "faster of the two, timed on CUDA (the model's own elsewhere)")
    g.add_argument("--device", default=None, help="where to run (default: cuda if available, else cpu)")
    sub.add_parser("bench", help="speed and accuracy benchmark (see `automp llm bench -h`)", add_help=False)
    return parser


def _device(name: str | None) -> torch.device:
    """--device, checked before any work: the quantized layers run on cpu or cuda, and a CUDA device asked for on a
    machine without one is a usage error here, not an assertion (or a pin_memory error) from deep inside torch."""
    cuda = torch.cuda.is_available()  # once, here: everything after uses the device this returns
    if name is None:
        return torch.device("cuda" if cuda else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name}: not a device (expected cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: automp llm runs on cpu or cuda")
    if device.type == "cuda":
        if not cuda:
            raise UsageError(f"--device {name}: CUDA was asked for, but no CUDA device is available "
                             "(torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: there is no CUDA device {device.index} "
                             f"({torch.cuda.device_count()} available)")
    return device


def printable(text: str) -> str:
    """`text` safe to print to a terminal: every character that is not printable (control characters such as ESC,
    BEL or CR, C1 controls, bidirectional overrides, line separators) written as its Python escape (\\x1b,
    \\u202e), newlines and tabs kept. Generated text is whatever bytes the model picked, and a random-weight model
    picks escape sequences too."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _tokenize(tokenizer, text: str, vocab: int) -> list[int]:
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("the text encodes to no tokens")
    if max(ids) >= vocab:
        raise ValueError(f"token id {max(ids)} is outside the model's vocabulary of {vocab} (the byte tokenizer "
                         f"needs a vocabulary of at least 256)")
    return ids


def _calib(args: argparse.Namespace, tokenizer, vocab: int) -> torch.Tensor:
    """[B, 256] token rows from --calib-text, else from the standard library's docstrings."""
    if args.calib_text:
        with open(args.calib_text, encoding="utf-8", errors="replace") as f:
            text = f.read()
    else:
        from automp.llm.corpus import stdlib_docstrings
        text = stdlib_docstrings(64 * 1024)[0].decode("utf-8", errors="replace")
    ids = torch.tensor(_tokenize(tokenizer, text, vocab))
    rows = ids[: (ids.numel() // 256) * 256].view(-1, 256)[:16]
    if rows.shape[0] == 0:
        raise ValueError(f"calibration text has {ids.numel()} tokens, need at least 256")
    return rows


def check_output(model: str, output: str) -> None:
    """Before any work: a save replaces the whole output directory, so it must be neither the source model, nor
    inside it, nor around it (each would destroy the weights being read), nor a directory of other files."""
    from automp.llm.store import BUILTIN, check_destination
    out = os.path.realpath(output)
    if model not in BUILTIN and os.path.exists(model):
        src = os.path.realpath(model)
        if out == src or (os.path.exists(out) and os.path.samefile(out, src)):
            raise UsageError(f"-o {output} is the source model {model}; refusing to overwrite it (write elsewhere)")
        if os.path.commonpath([out, src]) == src:
            raise UsageError(f"-o {output} is inside the source model {model}; refusing to write into it "
                             "(write elsewhere)")
        if os.path.commonpath([out, src]) == out:
            raise UsageError(f"-o {output} contains the source model {model}, and a save replaces the whole "
                             "directory; write elsewhere")
    try:
        check_destination(out)
    except OSError as e:
        raise UsageError(str(e).removeprefix("automp.llm.save: ")) from None


def _quantize(args: argparse.Namespace) -> int:
    require_transformers()
    check_output(args.model, args.output)
    from automp.llm.generate import ByteTokenizer
    from automp.llm.quantize import quantize, weight_bytes
    from automp.llm.store import BUILTIN, has_tokenizer, load_source, load_tokenizer, save
    # the tokenizer first: a damaged one fails in a second, before the model's weights are read
    tokenizer = load_tokenizer(args.model) if args.model not in BUILTIN and has_tokenizer(args.model) else None
    model = load_source(args.model, args.device)
    calib = _calib(args, tokenizer or ByteTokenizer(), model.config.vocab_size) if args.awq else None
    before = weight_bytes(model)
    scheme = f"int{args.bits}"
    quantize(model, scheme, args.group_size, calib=calib, awq=args.awq, quantize_lm_head=args.lm_head,
             quantize_embeddings=args.embeddings, dtype=args.dtype,
             edge_scheme=None if args.edge_bits is None else f"int{args.edge_bits}", fuse=not args.no_fuse)
    save(model, args.output, tokenizer=tokenizer)
    from automp.llm.fuse import fused_groups
    groups = len(fused_groups(model))
    print(f"{args.model} -> {args.output}: {scheme} group {args.group_size}{' awq' if args.awq else ''}, "
          f"weights {before / 2**20:.1f} MiB -> {weight_bytes(model) / 2**20:.1f} MiB"
          f"{f', {groups} sibling projection groups fused' if groups else ''}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    require_transformers()
    from automp.llm.generate import decode_info, generate
    from automp.llm.store import builtin_name, load, load_tokenizer
    device = args.device
    model = load(args.model, device)
    tokenizer = load_tokenizer(args.model)
    if builtin_name(model):
        print(f"note: {builtin_name(model)} is a built-in model with random weights; its text is noise",
              file=sys.stderr)
    ids = torch.tensor([_tokenize(tokenizer, args.prompt, model.config.vocab_size)], device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    t0 = time.perf_counter()
    out = generate(model, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, generator=gen,
                   eos_token_id=getattr(tokenizer, "eos_token_id", None), mode=args.mode, attention=args.attention)
    seconds = time.perf_counter() - t0
    print(printable(tokenizer.decode(out[0].tolist())))
    n = out.shape[1] - ids.shape[1]
    info = decode_info(model)
    print(f"[{n} tokens in {seconds:.2f} s, {n / seconds:.1f} tokens/s incl. warm-up; decode {info.get('mode')}"
          f"{': ' + info['reason'] if info.get('reason') else ''}; attention {info.get('attention') or 'model'}"
          f"{' (' + info['attention_note'] + ')' if info.get('attention_note') else ''}]", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        print("automp llm bench: error: the benchmark is a suite of automp.bench: run `automp llm bench` (or "
              "`python -m automp llm bench`)", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        args.device = _device(args.device)
        return _quantize(args) if args.command == "quantize" else _generate(args)
    except UsageError as e:
        print(f"automp llm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except USER_ERRORS as e:
        print(f"automp llm {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
