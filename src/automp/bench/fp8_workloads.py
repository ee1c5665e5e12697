"""The workloads and loops of `automp bench fp8` (automp.bench.suites.fp8): third-party models at the sizes the FP8
issue names, each with a pool of batches, and the loops a user writes around them (the strongest bf16 loop by hand,
torchao's float8 recipes in the same loop, and the plain FP32 loop automp runs under)."""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.bench.liger import with_liger
from automp.bench.zoo_modes import fuse_adam

LR = 1e-4  # AdamW's, in every mode: the same recipe, so the losses compare

POOL = 8  # distinct batches, cycled: the loss falls as on data, not to zero as on one memorized batch


@dataclass
class Workload:
    model: nn.Module
    batches: list[Any]  # POOL batches, taken in turn
    loss: Callable[[Callable[..., Any], Any], torch.Tensor]
    lr: float = LR  # AdamW's in every loop built on this workload


def _lm_loss(model: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _batches(vocab: int, b: int, t: int, device: str, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    """Tokens from a fixed CPU generator, then moved: the same data in every mode and on every device (a data-parallel
    rank passes a seed of its own: its shard)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (b, t), generator=gen).to(device) for _ in range(POOL)]
    return [{"input_ids": i, "labels": i} for i in ids]


def _llama(quick: bool, device: str, hidden: int, ff: int, layers: int, tied: bool, seed: int = 1234) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM
    vocab, heads, kv, b, t = (512, 4, 2, 2, 32) if quick else (128256, 32, 8, 4, 2048)
    hidden, ff, layers = (64, 256, 2) if quick else (hidden, ff, layers)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ff, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=t,
                      tie_word_embeddings=tied, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    return Workload(LlamaForCausalLM(cfg).to(device), _batches(vocab, b, t, device, seed), _lm_loss)


def llama_d2048(quick: bool, device: str, layers: int, seed: int = 1234, depth: int = 16) -> Workload:
    """Llama-3.2-1B dims: hidden 2048, FFN 8192, 32 heads, 8 KV heads, vocab 128256, tied (B4, T2048); `depth`
    layers (16 as in Llama-3.2-1B; `layers` is llama-d4096's, which the fp8 suite passes to every builder)."""
    return _llama(quick, device, 2048, 8192, depth, True, seed)


def llama_d4096(quick: bool, device: str, layers: int, seed: int = 1234) -> Workload:
    """Llama-3-8B dims: hidden 4096, FFN 14336, 32 heads, 8 KV heads, vocab 128256, untied (B4, T2048); --layers
    layers (default 4), as many as fit one 80 GB GPU with FP32 weights and AdamW state."""
    return _llama(quick, device, 4096, 14336, layers, False, seed)


def gpt2(quick: bool, device: str, layers: int) -> Workload:
    """transformers GPT-2 124M (B8, T1024, vocab 50257), dropout 0."""
    from transformers import GPT2Config, GPT2LMHeadModel
    vocab, d, n, heads, b, t = (512, 64, 2, 4, 2, 32) if quick else (50257, 768, 12, 12, 8, 1024)
    cfg = GPT2Config(vocab_size=vocab, n_positions=t, n_embd=d, n_layer=n, n_head=heads, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return Workload(GPT2LMHeadModel(cfg).to(device), _batches(vocab, b, t, device), _lm_loss)


def vit_l16(quick: bool, device: str, layers: int) -> Workload:
    """timm ViT-L/16 at 224 (B32, 1000 classes), random images, cross-entropy."""
    import timm
    tiny = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4) if quick else {}
    b, res = (2, 32) if quick else (32, 224)
    model = timm.create_model("vit_large_patch16_224", pretrained=False, num_classes=1000, **tiny).to(device)
    gen = torch.Generator().manual_seed(1234)
    batches = [(torch.randn(b, 3, res, res, generator=gen).to(device),
                torch.randint(0, 1000, (b,), generator=gen).to(device)) for _ in range(POOL)]
    return Workload(model, batches, lambda net, xy: F.cross_entropy(net(xy[0]), xy[1]))


# name -> (builder, the library it needs); a mode -> the library it needs
MODELS: dict[str, tuple[Callable[[bool, str, int], Workload], str]] = {
    "llama-d2048": (llama_d2048, "transformers"), "llama-d4096": (llama_d4096, "transformers"),
    "gpt2": (gpt2, "transformers"), "vit-l16": (vit_l16, "timm")}
MODE_LIBS = {"torchao-tensorwise": "torchao", "torchao-rowwise": "torchao", "torchao-auto": "torchao",
             "bf16-liger": "liger_kernel"}


def _step_fn(work: Workload, net: Callable[..., Any], opt: torch.optim.Optimizer, autocast: str | None
             ) -> Callable[[], torch.Tensor]:
    turn = itertools.count()

    def step() -> torch.Tensor:
        batch = work.batches[next(turn) % len(work.batches)]
        with torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = work.loss(net, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def compiled_loop(work: Workload, device: str) -> Callable[[], torch.Tensor]:
    """autocast bf16 + torch.compile(mode="reduce-overhead") + fused AdamW: the strongest bf16 loop by hand."""
    opt = torch.optim.AdamW(work.model.parameters(), lr=work.lr)
    fuse_adam([opt])
    return _step_fn(work, torch.compile(work.model, mode="reduce-overhead"), opt, device)


def torchao_filter(module: nn.Module, fqn: str) -> bool:
    """torchao README's filter: not the final projection (LM head, classifier head), not dims off multiples of 16."""
    if fqn.split(".")[-1] in ("lm_head", "head"):
        return False
    return not isinstance(module, nn.Linear) or (module.in_features % 16 == 0 and module.out_features % 16 == 0)


def torchao_loop(recipe: str) -> Callable[[Workload, str], Callable[[], torch.Tensor]]:
    def build(work: Workload, device: str) -> Callable[[], torch.Tensor]:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(work.model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=torchao_filter)
        return compiled_loop(work, device)
    return build


def torchao_auto_loop(work: Workload, device: str) -> Callable[[], torch.Tensor]:
    """torchao's own filter for the tensorwise recipe (torchao.float8._auto_filter_for_recipe: dims off multiples
    of 16 and layers too small to gain are left bf16), the LM head and classifier head kept bf16 as on every side."""
    from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training
    convert_to_float8_training(work.model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=_auto_filter_for_recipe("tensorwise", filter_fqns=["lm_head", "head"]))
    return compiled_loop(work, device)


def liger_loop(work: Workload, device: str) -> Callable[[], torch.Tensor]:
    """The strongest bf16 loop with Liger-Kernel on the model (`with_liger`), Llama models only."""
    with_liger(work.model)
    return compiled_loop(work, device)


def fp32_loop(work: Workload, device: str) -> Callable[[], torch.Tensor]:
    """The plain FP32 loop automp runs under: what the user wrote, unchanged."""
    return _step_fn(work, work.model, torch.optim.AdamW(work.model.parameters(), lr=work.lr), None)


LOOPS: dict[str, Callable[[Workload, str], Callable[[], torch.Tensor]]] = {
    "bf16-reduce-overhead": compiled_loop, "torchao-tensorwise": torchao_loop("tensorwise"),
    "torchao-rowwise": torchao_loop("rowwise"), "torchao-auto": torchao_auto_loop, "bf16-liger": liger_loop,
    "automp-bf16": fp32_loop, "automp-fp8": fp32_loop, "automp-bf16-siblings": fp32_loop, "automp-fp8-auto": fp32_loop,
    "automp-fp8-siblings": fp32_loop, "automp-bf16-masked": fp32_loop}


def automp_options(mode: str) -> dict[str, Any]:
    """automp.enable's arguments for an automp mode: its dtype ("automp-bf16" -> bf16), for "-siblings" the
    sibling-GEMM rewrite (automp.precision.siblings), for "-auto" each FP8 layer's recipe chosen per layer
    (fp8_recipe="auto") and for "-masked" the model's causal mask kept (automp.precision.causal_mask off), so that
    one process times automp with and without them."""
    extra = {"-siblings": {"fuse_siblings": True}, "-auto": {"fp8_recipe": "auto"},
             "-masked": {"causal_attention": False}}
    return {"dtype": mode.split("-")[1], **next((v for k, v in extra.items() if mode.endswith(k)), {})}
