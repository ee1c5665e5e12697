"""Deployment benchmark: is the automp-optimized fp16 model at least as fast as torch.compile'd fp16?

Models: ResNet-50 (torchvision, random weights) and a MiniLM-shaped encoder (hidden 384, 6 layers, 12 heads,
seq 128), at batch 1 and 64. Cases, all timed in this process:
- fp32-eager:        the model as trained (also the accuracy reference)
- anchor:            torch.compile(model.half(), mode="reduce-overhead")
- automp-torch:      BN folded into convs, .half(), same torch.compile
- automp-ort-<ep>:   export -> automp passes -> fp16 ONNX, run by onnxruntime (CUDA provider when this onnxruntime
                     has it, with inputs/outputs bound to GPU memory; CPU otherwise)
Each row reports ms, speedup vs the anchor, and the output's relative error vs fp32-eager.

    automp bench deploy [--out bench-results] [--quick] [--models resnet,minilm] [--batches 1,64]

--quick: tiny models and batches, no torch.compile on CPU (a smoke check that runs in about a minute).
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.bench.harness import Result, command_line, time_fn, write_results


class EncoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.up = nn.Linear(hidden, inter)
        self.down = nn.Linear(inter, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads) + bias
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.out(att))  # post-LN residuals, as in BERT
        return self.ln2(x + self.down(F.gelu(self.up(x))))


class MiniLMEncoder(nn.Module):
    """all-MiniLM-L6-v2's shape (BERT, post-LN) with mean pooling and L2-normalised sentence embeddings."""

    def __init__(self, vocab: int = 30522, hidden: int = 384, layers: int = 6, heads: int = 12, inter: int = 1536,
                 max_pos: int = 512):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_pos, hidden)
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(EncoderLayer(hidden, heads, inter) for _ in range(layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.ln(self.tok(input_ids) + self.pos(pos))
        m = attention_mask.to(x.dtype)
        bias = (1.0 - m)[:, None, None, :] * -1e4  # additive mask, finite in fp16
        for layer in self.layers:
            x = layer(x, bias)
        pooled = (x * m[..., None]).sum(1) / m.sum(1, keepdim=True).clamp(min=1.0)
        return F.normalize(pooled, dim=-1)


def small_resnet(width: int = 16, classes: int = 10) -> nn.Module:
    """Conv-BN-ReLU stages with a residual block each: the ResNet pattern at smoke-test size."""
    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))

    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                         Block(width), nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width),
                         nn.ReLU(), Block(2 * width), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(2 * width, classes))


def _randomize_bn(model: nn.Module) -> nn.Module:
    """Fresh BN layers have mean 0 / var 1, which makes BN folding trivially exact; give them real statistics."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return model


def build_models(quick: bool, device: str, which: set[str]) -> list[tuple[str, nn.Module, Callable[[int], tuple]]]:
    torch.manual_seed(0)
    models = []
    try:
        import torchvision
        cnn, name, res = (torchvision.models.resnet18(num_classes=10), "resnet18", 32) if quick else \
            (torchvision.models.resnet50(), "resnet50", 224)
    except ImportError:
        cnn, name, res = small_resnet(), "small-resnet (no torchvision)", 32 if quick else 224
    if "resnet" in which:
        models.append((name, _randomize_bn(cnn), lambda b: (torch.randn(b, 3, res, res, device=device),)))
    enc = MiniLMEncoder(vocab=1000, hidden=64, layers=2, heads=4, inter=128) if quick else MiniLMEncoder()
    seq = 16 if quick else 128

    def enc_inputs(b: int) -> tuple:
        ids = torch.randint(0, enc.tok.num_embeddings, (b, seq), device=device)
        mask = torch.ones(b, seq, dtype=torch.long, device=device)
        if b > 1:
            mask[1:, seq * 3 // 4:] = 0  # padded sentences, as in a real batch
        return ids, mask
    if "minilm" in which:
        models.append((f"minilm-shaped (h{enc.ln.normalized_shape[0]}, seq {seq})", enc, enc_inputs))
    return [(n, m.eval().to(device), f) for n, m, f in models]


def _half_inputs(args: tuple) -> tuple:
    return tuple(a.half() if a.is_floating_point() else a for a in args)


def fold_bn_torch(model: nn.Module) -> nn.Module:
    """Fold each Conv2d directly followed by a BatchNorm2d (as sibling modules) with torch's public helper."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    for parent in model.modules():
        names = list(parent._modules)
        for a, b in zip(names, names[1:]):
            conv, bn = parent._modules[a], parent._modules[b]
            if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
                parent._modules[a] = fuse_conv_bn_eval(conv, bn)
                parent._modules[b] = nn.Identity()
    return model


def ort_session(model: nn.Module, args: tuple, device: str, allow_cpu: bool):
    """Export once (fp32, dynamic batch), optimize to fp16 with automp, open an onnxruntime session.
    Returns (label, session, input names) or None when only a CPU provider exists and allow_cpu is False
    (a CPU run of full-size models at batch 64 would take minutes and compare nothing useful)."""
    import onnxruntime as ort

    from automp.deploy import onnx_io, optimize, runtime

    cuda = device == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers()
    if not cuda and not allow_cpu:
        print(f"[deploy] onnxruntime has no CUDAExecutionProvider ({ort.get_available_providers()}): "
              "skipping the automp-ort case", file=sys.stderr)
        return None
    names = [f"in{k}" for k in range(len(args))]
    onnx_model = onnx_io.export_torch(model.cpu(), tuple(a[:2].cpu() for a in args), names, ["out"])
    model.to(device)
    fp16, _ = optimize(onnx_model, precision="fp16")
    return ("automp-ort-cuda" if cuda else "automp-ort-cpu"), runtime.session(fp16, "cuda" if cuda else "cpu"), names


def _ort_runner(prepared, args: tuple):
    label, sess, names = prepared
    if label.endswith("cpu"):
        feeds = {n: a.cpu().numpy() for n, a in zip(names, args)}
        return label, lambda: sess.run(None, feeds)[0]
    binding = sess.io_binding()
    args = tuple(a.contiguous() for a in args)
    for n, a in zip(names, args):
        binding.bind_input(n, "cuda", 0, np.float32 if a.is_floating_point() else np.int64, list(a.shape),
                           a.data_ptr())
    binding.bind_output("out", "cuda")
    torch.cuda.synchronize()  # onnxruntime reads the inputs on its own stream

    def run(_keep_alive=args):  # the binding holds raw pointers into these tensors
        sess.run_with_iobinding(binding)
        return binding.get_outputs()[0]
    return label, run


def _to_numpy(out) -> np.ndarray:
    if isinstance(out, torch.Tensor):
        return out.detach().float().cpu().numpy()
    if hasattr(out, "numpy"):
        return np.asarray(out.numpy(), dtype=np.float32)
    return np.asarray(out, dtype=np.float32)


def _rel(out, ref: np.ndarray) -> float:
    o = _to_numpy(out).astype(np.float64)
    return float(np.linalg.norm(o - ref) / np.linalg.norm(ref))


def bench_model(name: str, model: nn.Module, args: tuple, ort_prepared, device: str, compile_ok: bool,
                iters: int) -> list[Result]:
    import copy

    batch = args[0].shape[0]
    with torch.no_grad():
        ref_out = model(*args)
        ref = _to_numpy(ref_out).astype(np.float64)
        cases: list[tuple[str, Callable[[], object]]] = [("fp32-eager", lambda: model(*args))]
        half_args = _half_inputs(args)
        anchor_model = copy.deepcopy(model).half()
        ours_model = fold_bn_torch(copy.deepcopy(model)).half()
        if compile_ok:
            torch._dynamo.reset()
            anchor_fn = torch.compile(anchor_model, mode="reduce-overhead")
            ours_fn = torch.compile(ours_model, mode="reduce-overhead")
        else:
            anchor_fn, ours_fn = anchor_model, ours_model
        anchor_label = "anchor: torch.compile fp16" if compile_ok else "anchor: fp16 eager (no compile)"
        cases.append((anchor_label, lambda: anchor_fn(*half_args)))
        cases.append(("automp-torch (fold BN + fp16" + (" + compile)" if compile_ok else ")"),
                      lambda: ours_fn(*half_args)))
        if ort_prepared is not None:
            cases.append(_ort_runner(ort_prepared, args))
        results: list[Result] = []
        anchor_ms = None
        for label, fn in cases:
            err = _rel(fn(), ref)  # first call doubles as compile warmup
            ms = time_fn(fn, warmup=3 if compile_ok else 2, iters=iters)
            if label.startswith("anchor"):
                anchor_ms = ms
            results.append(Result("deploy", f"{name} bs{batch} {label}", ms,
                                  extra={"rel_err_vs_fp32": err, "batch": batch}))
    for r in results:
        r.anchor, r.anchor_ms = "torch.compile fp16" if compile_ok else "fp16 eager", anchor_ms
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="automp bench deploy", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench-results")
    p.add_argument("--quick", action="store_true", help="tiny models, CPU-friendly smoke run")
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,64; quick 1,4)")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--models", default="resnet,minilm", help="comma-separated subset of resnet,minilm")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,64")).split(",")]
    iters = args.iters or (5 if args.quick else 50)
    compile_ok = device == "cuda"  # reduce-overhead is CUDA graphs; on CPU the anchor is fp16 eager
    results: list[Result] = []
    which = set(args.models.split(","))
    if not which <= {"resnet", "minilm"}:
        p.error(f"--models: unknown {sorted(which - {'resnet', 'minilm'})}; choose from resnet, minilm")
    for name, model, make_inputs in build_models(args.quick, device, which):
        try:
            prepared = ort_session(model, make_inputs(2), device, allow_cpu=args.quick)
        except Exception as e:  # noqa: BLE001 — keep the torch cases; the failure is printed, not hidden
            print(f"[deploy] {name}: automp-ort case failed: {type(e).__name__}: {e}", file=sys.stderr)
            prepared = None
        for b in batches:
            inputs = make_inputs(b)
            rows = bench_model(name, model, inputs, prepared, device, compile_ok, iters)
            for r in rows:
                sp = f"{r.speedup:.2f}x" if r.speedup else ""
                print(f"{r.name:70s} {r.ms:9.3f} ms  {sp:>7s}  rel err {r.extra['rel_err_vs_fp32']:.2e}", flush=True)
            results.extend(rows)
    cmd = command_line("automp bench deploy", argv)
    json_path, md_path = write_results(results, args.out, "deploy", cmd)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
