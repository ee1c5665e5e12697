"""The decode step's attention: transformers' own (SDPA) or automp's split-KV kernel, chosen by timing both.

A decode step attends from one new token per sequence over the whole static cache. transformers' SDPA path repeats
each KV head for its group of query heads (copies of the cache every step) and hands the single query to a kernel
built for long queries; automp.kernels.decode_attention reads each KV head once for its group and skips the slots not
yet written. Which is faster depends on the GPU, the batch and the cache length, so the decoder captures its step
with each (`variants`) and keeps the one whose replays measured faster (`faster`); elsewhere the model's own runs.

A verdict is kept on disk (automp's cache directory, `decode_attention.json`), keyed by what decides it: the GPU,
torch, the attention's shapes (heads, KV heads, head dim, batch, cache length) and dtype, not the weights. A later
decoder of the same key captures the winner alone: one compile instead of two.

The kernel is reached through transformers' attention registry: the decoder switches the model's
`config._attn_implementation` to NAME around its own calls only (`using`), so a user's forward outside generate()
keeps the model's attention. The registered function takes the kernel for single-token steps with a boolean mask and
hands everything else (the prompt's prefill) to transformers' SDPA function unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

ATTENTIONS = ("auto", "model", "kernel")  # generate(attention=...): measured choice, the model's own, the kernel
NAME = "automp_decode"
MAX_HEAD_DIM = 256  # automp.kernels.decode_attention's limit (not imported here: importing automp.llm loads no Triton)
# Largest relative difference of the two variants' logits over one step: a kernel that computes something else is off
# by the order of the logits themselves; two correct attentions differ by 16-bit rounding carried through the layers,
# up to about a percent for bf16 at full depth. The bound sits between the two.
AGREE = 0.1
ROUNDS, REPLAYS = 4, 8  # timed blocks of replays per variant, alternating (even: each leads as often as it trails)


@functools.cache
def register() -> str | None:
    """Registers NAME with transformers' attention and mask registries; None when done, else why it cannot be."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        return f"this transformers has no attention registry ({e.name or e})"
    import automp.kernels.ops  # noqa: F401 - torch.ops.automp.decode_attention (Triton: imported only when used)
    AttentionInterface.register(NAME, decode_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # a boolean mask, True where a slot is attended
    return None


def decode_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [B, Hq, q, D], key/value [B, Hkv, L, D] (the static cache), the
    output [B, q, Hq, D]. One query token with a boolean [B or 1, 1, 1, L] mask goes to the kernel; the rest to SDPA."""
    if (query.shape[2] == 1 and dropout == 0.0 and kwargs.get("position_bias") is None
            and isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1)
            and attention_mask.shape[-1] == key.shape[2] and query.dtype in (torch.float16, torch.bfloat16)
            and key.dtype == query.dtype and query.shape[-1] <= MAX_HEAD_DIM
            and query.shape[1] % key.shape[1] == 0):
        valid = attention_mask[:, 0, 0, :].expand(query.shape[0], -1)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = torch.ops.automp.decode_attention(query[:, :, 0], key, value, valid, float(scale))
        return out[:, None], None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def variants(model: nn.Module, attention: str, dtype: torch.dtype, graphs: bool,
             key: str | None = None) -> tuple[list[str], str]:
    """The attentions a decoder runs (timed against each other where there are two, the model's first), and why the
    kernel is not among them where it was asked for or would have been tried, or that a cached verdict under `key`
    decided ("" otherwise). dtype: the decode step's activations; graphs: the step is captured (CUDA)."""
    if attention == "model":
        return ["model"], ""
    known = cached(key) if attention == "auto" and graphs and key else None
    # a cached "kernel" came from another process: it is checked and registered in this one too
    why = None if known == "model" else "nothing to time the kernel against without a captured step" \
        if attention == "auto" and not graphs else _kernel_unfit(model, dtype) or register()
    if why is not None:
        return ["model"], f"decode attention kernel not used: {why}"
    if known is not None:
        return [known], f"decode attention {known}: the cached verdict of an earlier run"
    return (["model", "kernel"] if attention == "auto" else ["kernel"]), ""


def _kernel_unfit(model: nn.Module, dtype: torch.dtype) -> str | None:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return "the model has no transformers config"
    head_dim = _head_dim(config)
    if not head_dim or head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} (the kernel takes up to {MAX_HEAD_DIM})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{str(dtype).removeprefix('torch.')} activations (the kernel takes fp16 or bf16)"
    return None


def _head_dim(config: Any) -> int | None:
    """A transformers config's attention head size: its head_dim, else hidden size over heads; None if neither."""
    heads = getattr(config, "num_attention_heads", None)
    return getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)


@contextlib.contextmanager
def using(model: nn.Module, variant: str) -> Iterator[None]:
    """The model's attention set to `variant` for the calls inside ("model": left as it is)."""
    if variant == "model":
        yield
        return
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


def faster(replays: dict[str, Callable[[], None]], sync: Callable[[], None],
           clock: Callable[[], float]) -> tuple[str, dict[str, float]]:
    """The variant whose replays ran faster, and each one's median ms per replay: ROUNDS blocks of REPLAYS replays
    each, the variants alternating (A B, B A, ...), so a drifting clock favours neither. Each replay callable
    rewinds the cache's step state first (automp.llm.cache): the cache is left as one replay leaves it."""
    samples: dict[str, list[float]] = {v: [] for v in replays}
    names = list(replays)
    for r in range(ROUNDS):
        for v in names if r % 2 == 0 else names[::-1]:
            sync()
            t0 = clock()
            for _ in range(REPLAYS):
                replays[v]()
            sync()
            samples[v].append((clock() - t0) * 1e3 / REPLAYS)
    ms = {v: round(statistics.median(s), 5) for v, s in samples.items()}
    return min(names, key=lambda v: ms[v]), ms


def disagreement(logits: dict[str, torch.Tensor]) -> str | None:
    """Why the kernel's logits cannot stand for the model's, or None: after one replay of each captured step (the same
    step), ‖kernel − model‖ / ‖model‖ must stay within AGREE. A kernel that computes something else is never kept
    for being faster."""
    if "kernel" not in logits or "model" not in logits:
        return None
    ref, got = logits["model"].float(), logits["kernel"].float()
    rel = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    if rel <= AGREE:  # NaN fails this too
        return None
    return f"its logits differ from the model's attention's by {rel:.3g} (relative; at most {AGREE} is kept)"


def verdict_key(model: nn.Module, dtype: torch.dtype, batch: int, max_len: int, device: torch.device) -> str | None:
    """What decides the timed choice (see the module docstring); None off CUDA."""
    if device.type != "cuda":
        return None
    c = model.config
    heads = getattr(c, "num_attention_heads", 0)
    return "|".join(str(v) for v in (
        torch.cuda.get_device_name(device), torch.__version__, type(model).__name__, heads,
        getattr(c, "num_key_value_heads", heads), _head_dim(c), getattr(c, "num_hidden_layers", 0),
        str(dtype).removeprefix("torch."), batch, max_len))


def _verdicts() -> Path:
    from automp.config import default_cache_dir
    return Path(default_cache_dir(os.environ)) / "decode_attention.json"


def _load() -> dict:
    try:
        data = json.loads(_verdicts().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cached(key: str | None) -> str | None:
    """The variant an earlier run kept for `key`, or None (none, or an unreadable cache: then the two are timed)."""
    entry = _load().get(key) if key else None
    chosen = entry.get("chosen") if isinstance(entry, dict) else None
    return chosen if chosen in ("model", "kernel") else None


def remember(key: str | None, chosen: str, ms: dict[str, float]) -> None:
    """Keeps a timed verdict under `key` (an atomic replace; an unwritable cache costs the next run a second
    compile, nothing else)."""
    if not key:
        return
    from automp.files import atomic_output
    path = _verdicts()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load()
        data[key] = {"chosen": chosen, "replay_ms": ms}
        with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    except OSError:
        pass
