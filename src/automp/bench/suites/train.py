"""`automp bench train`: training step time of GPT-124M and ResNet-50, automp vs what users write by hand.

All modes run in one process on the same data: FP32 (TF32 off), TF32, hand-written autocast (+GradScaler for fp16),
the same + torch.compile, and automp with no code change (enable() around the plain FP32 loop, exactly what
`automp run` does). Ratios are against hand-written autocast+torch.compile, the anchor the issue asks us to meet.

ResNet-50 comes from torchvision, an optional package (automp[zoo]): without it the suite says so in one line
before any work, rather than failing halfway.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.argtypes import int_at_least
from automp.bench.harness import Result, device_name, write_results
from automp.timing import time_fn


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """nanoGPT-shaped decoder: GPT-2 small at d=768, 12 layers, 12 heads, vocab 50304."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight
        for w in (self.tok.weight, self.pos.weight):
            nn.init.normal_(w, std=0.02)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _gpt(quick: bool, device: str):
    vocab, d, layers, heads, b, t = (512, 64, 2, 4, 2, 64) if quick else (50304, 768, 12, 12, 8, 1024)
    model = GPT(vocab, d, layers, heads, t).to(device)
    x = torch.randint(0, vocab, (b, t), device=device)
    y = torch.randint(0, vocab, (b, t), device=device)
    return model, (x, y), lambda m, batch: m(*batch)


def _resnet(quick: bool, device: str):
    import torchvision
    b, res = (4, 64) if quick else (128, 224)
    model = torchvision.models.resnet50().to(device).to(memory_format=torch.channels_last)
    x = torch.randn(b, 3, res, res, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (b,), device=device)
    return model, (x, y), lambda m, batch: F.cross_entropy(m(batch[0]), batch[1])


MODELS = {"gpt124m": _gpt, "resnet50": _resnet}


def _step_fn(mode: str, model: nn.Module, batch, loss_of: Callable, device: str) -> Callable[[], float]:
    """One optimizer step in the style of `mode`. Returns a closure; automp modes enable automp around it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    low = torch.float16 if "fp16" in mode else torch.bfloat16
    use_autocast = mode.startswith("autocast")
    scaler = torch.amp.GradScaler(device) if use_autocast and low == torch.float16 else None
    fwd = torch.compile(model) if mode.endswith("+compile") else model

    def step():
        ctx = torch.autocast(device, dtype=low) if use_autocast else contextlib.nullcontext()
        with ctx:
            loss = loss_of(fwd, batch)
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss

    return step


def _time_steps(step: Callable, warmup: int, iters: int, device: str) -> tuple[float, float]:
    """(median ms per step, the last step's loss)."""
    losses = []
    ms = time_fn(lambda: losses.append(step()), warmup, iters, device=device)
    return ms, float(losses[-1].detach())


def run_model(name: str, modes: list[str], quick: bool, device: str, warmup: int, iters: int) -> list[Result]:
    import automp

    results: dict[str, tuple[float, float]] = {}
    for mode in modes:
        torch.manual_seed(0)
        torch._dynamo.reset()
        torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
        torch.backends.cudnn.allow_tf32 = mode == "tf32"
        model, batch, loss_of = MODELS[name](quick, device)
        step = _step_fn(mode, model, batch, loss_of, device)
        if mode.startswith("automp"):
            automp.enable(dtype="fp16" if "fp16" in mode else "bf16")
        try:
            ms, loss = _time_steps(step, warmup, iters, device)
        except Exception as e:  # noqa: BLE001 - one failing mode must not lose the others' numbers
            print(f"{name} {mode}: FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        finally:
            rep = automp.disable() if mode.startswith("automp") else None
        if rep is not None and rep["fallbacks"]:
            print(f"{name} {mode}: FP32 fallbacks: {rep['fallbacks']}")
        results[mode] = (ms, loss)
        print(f"{name:9s} {mode:24s} {ms:9.2f} ms/step  loss {loss:.4f}", flush=True)
        del model, step
        if device == "cuda":
            torch.cuda.empty_cache()
    anchor = next((m for m in ("autocast-bf16+compile", "autocast-fp16+compile") if m in results), None)
    out = []
    for mode, (ms, loss) in results.items():
        out.append(Result("train", f"{name} {mode}", ms, anchor, results[anchor][0] if anchor else None,
                          {"loss": loss, "vs_fp32": results["fp32"][0] / ms if "fp32" in results else math.nan}))
    return out


DEFAULT_MODES = ["fp32", "tf32", "autocast-fp16", "autocast-fp16+compile", "autocast-bf16+compile", "automp-bf16",
                 "automp-fp16"]


def _names(valid: list[str], what: str):
    """argparse type: a comma-separated subset of `valid`, in the order given."""
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in valid]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or repr(text)}; choose from "
                                             f"{', '.join(valid)}")
        return names
    return parse


def _missing_packages(models: list[str]) -> str | None:
    """The one-line reason the chosen models cannot be built here (an optional package not installed), or None."""
    if "resnet50" in models:
        try:
            import torchvision  # noqa: F401
        except ImportError:
            return ("resnet50 needs torchvision: pip install automp[zoo] (or leave it out: --models "
                    f"{','.join(m for m in models if m != 'resnet50') or 'gpt124m'})")
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="automp bench train", description=__doc__.split("\n")[0])
    p.add_argument("--models", type=_names(list(MODELS), "model"), default=list(MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)} (default: both; resnet50 needs torchvision)")
    p.add_argument("--modes", type=_names(DEFAULT_MODES, "mode"), default=DEFAULT_MODES,
                   help=f"comma-separated, from {', '.join(DEFAULT_MODES)} (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    p.add_argument("--warmup", type=int_at_least(0), default=5, help="untimed steps per mode first (default 5)")
    p.add_argument("--iters", type=int_at_least(1), default=20, help="timed steps per mode; the median is kept "
                                                                      "(default 20)")
    p.add_argument("--out", default="bench-results", help="directory for train.json and train.md")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    missing = _missing_packages(args.models)
    if missing:
        print(f"automp bench train: error: {missing}", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {device_name()}  torch {torch.__version__}")
    results = []
    for name in args.models:
        results += run_model(name, args.modes, args.quick, device, args.warmup, args.iters)
    paths = write_results(results, args.out, "train", "automp bench train " + " ".join(argv))
    print(open(paths[1]).read())
    return 0
