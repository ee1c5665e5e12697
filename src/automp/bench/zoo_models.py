"""Third-party models for `automp bench zoo`, built the way a user's training script builds them.

Random init only (transformers models from a Config, never from_pretrained; timm/torchvision with pretrained
weights off), so nothing is downloaded. Each builder returns a `Workload`: the modules, the optimizers the user
would pick, one fixed batch (drawn from a CPU generator, so CPU and GPU runs see the same numbers) and one training
step written against `Loop`, the few places where the benchmark's modes differ (autocast, compile, GradScaler).
Dropout is off in the transformers configs so each mode's last loss can be compared with FP32's.
The libraries are imported inside the builders: a missing one only skips its models.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F


class Loop(Protocol):
    """What a training step needs from the benchmark mode it runs in."""

    nets: dict[str, Callable[..., Any]]  # the workload's modules, torch.compile'd in the compile modes

    def autocast(self) -> contextlib.AbstractContextManager: ...

    def update(self, loss: torch.Tensor, name: str) -> None:
        """zero_grad, backward (scaled for GradScaler) and step of the optimizer named `name`."""


StepFn = Callable[[Loop, Any], torch.Tensor]


@dataclass
class Workload:
    modules: dict[str, nn.Module]
    optimizers: dict[str, torch.optim.Optimizer]
    batch: Any
    step: StepFn  # one training step; returns the loss it logs


def single_step(loss_fn: Callable[[Callable[..., Any], Any], torch.Tensor]) -> StepFn:
    """The usual loop body for one model and one optimizer: forward+loss under autocast, then update."""
    def step(loop: Loop, batch: Any) -> torch.Tensor:
        with loop.autocast():
            loss = loss_fn(loop.nets["model"], batch)
        loop.update(loss, "model")
        return loss
    return step


def one_model(model: nn.Module, opt: torch.optim.Optimizer, batch: Any,
              loss_fn: Callable[[Callable[..., Any], Any], torch.Tensor]) -> Workload:
    return Workload({"model": model}, {"model": opt}, batch, single_step(loss_fn))


def generator() -> torch.Generator:
    """Every batch is drawn from this seed, on the CPU, then moved: the same data on every device and mode."""
    return torch.Generator().manual_seed(1234)


def tokens(gen: torch.Generator, vocab: int, shape: tuple[int, ...], device: str, low: int = 0) -> torch.Tensor:
    return torch.randint(low, vocab, shape, generator=gen).to(device)


def images(gen: torch.Generator, b: int, res: int, device: str) -> torch.Tensor:
    return torch.randn(b, 3, res, res, generator=gen).to(device)


def _hf_loss(model: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _adamw(model: nn.Module, lr: float = 3e-4) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def gpt2(quick: bool, device: str) -> Workload:
    """transformers GPT-2 124M (B8, T1024): causal LM, labels = inputs (the model shifts them)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    vocab, d, layers, heads, b, t = (512, 64, 2, 4, 2, 32) if quick else (50257, 768, 12, 12, 8, 1024)
    cfg = GPT2Config(vocab_size=vocab, n_positions=t, n_embd=d, n_layer=layers, n_head=heads, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).to(device)
    ids = tokens(generator(), vocab, (b, t), device)
    return one_model(model, _adamw(model), {"input_ids": ids, "labels": ids}, _hf_loss)


def _llama(device: str, vocab: int, d: int, ff: int, layers: int, heads: int, kv: int, b: int, t: int) -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=t,
                      tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
    model = LlamaForCausalLM(cfg).to(device)
    ids = tokens(generator(), vocab, (b, t), device)
    return one_model(model, _adamw(model), {"input_ids": ids, "labels": ids}, _hf_loss)


def llama(quick: bool, device: str) -> Workload:
    """Llama-style ~107M (B8, T1024): RMSNorm, SwiGLU, RoPE, grouped-query attention (12 heads, 4 KV heads)."""
    return _llama(device, *((512, 64, 192, 2, 4, 2, 2, 32) if quick else (32000, 768, 2304, 12, 12, 4, 8, 1024)))


def llama_1b(quick: bool, device: str) -> Workload:
    """Llama-3.2-1B dims (B4, T2048): hidden 2048, FFN 8192, all 16 layers, 32 heads, 8 KV heads, vocab 128256, tied."""
    return _llama(device, *((512, 64, 256, 2, 4, 2, 2, 32) if quick else (128256, 2048, 8192, 16, 32, 8, 4, 2048)))


def bert(quick: bool, device: str) -> Workload:
    """transformers BERT-base masked LM (B16, T512): 15% of the tokens masked, loss on those only."""
    from transformers import BertConfig, BertForMaskedLM
    vocab, d, ff, layers, heads, b, t = (512, 64, 128, 2, 4, 2, 32) if quick else (30522, 768, 3072, 12, 12, 16, 512)
    mask_id = 4 if quick else 103  # [MASK] of bert-base-uncased's vocabulary
    cfg = BertConfig(vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=layers,
                     num_attention_heads=heads, max_position_embeddings=t, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(cfg).to(device)
    gen = generator()
    ids = tokens(gen, vocab, (b, t), "cpu", low=5 if quick else 1000)
    masked = torch.rand(b, t, generator=gen) < 0.15
    batch = {"input_ids": ids.masked_fill(masked, mask_id).to(device),
             "labels": ids.masked_fill(~masked, -100).to(device)}
    return one_model(model, _adamw(model, 1e-4), batch, _hf_loss)


def t5(quick: bool, device: str) -> Workload:
    """transformers T5-small seq2seq (B16, source T512, target T128), the decoder fed the shifted labels."""
    from transformers import T5Config, T5ForConditionalGeneration
    vocab, d, ff, kv, layers, heads, b, src, tgt = ((512, 64, 128, 16, 2, 4, 2, 32, 16) if quick
                                                    else (32128, 512, 2048, 64, 6, 8, 16, 512, 128))
    cfg = T5Config(vocab_size=vocab, d_model=d, d_ff=ff, d_kv=kv, num_layers=layers, num_heads=heads,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(cfg).to(device)
    gen = generator()
    batch = {"input_ids": tokens(gen, vocab, (b, src), device, low=2),
             "labels": tokens(gen, vocab, (b, tgt), device, low=2)}
    return one_model(model, _adamw(model, 1e-4), batch, _hf_loss)


def _classify(model: Callable[..., Any], batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _timm(name: str, quick_kwargs: dict[str, Any], b: int, quick: bool, device: str) -> Workload:
    import timm
    classes, res = (10, 32) if quick else (1000, 224)
    model = timm.create_model(name, pretrained=False, num_classes=classes, **(quick_kwargs if quick else {}))
    model = model.to(device)
    gen = generator()
    batch = (images(gen, 2 if quick else b, res, device), tokens(gen, classes, (2 if quick else b,), device))
    return one_model(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05), batch, _classify)


def vit(quick: bool, device: str) -> Workload:
    """timm ViT-B/16 at 224 (B64)."""
    return _timm("vit_base_patch16_224", dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4),
                 64, quick, device)


def convnext(quick: bool, device: str) -> Workload:
    """timm ConvNeXt-T at 224 (B128)."""
    return _timm("convnext_tiny", dict(depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)), 128, quick, device)


def effnet(quick: bool, device: str) -> Workload:
    """timm EfficientNet-B0 at 224 (B128): depthwise convs, squeeze-excite, SiLU, BatchNorm."""
    return _timm("efficientnet_b0", {}, 128, quick, device)


def resnet50(quick: bool, device: str) -> Workload:
    """torchvision ResNet-50 (B128, 224), channels_last model and input; SGD+momentum, the reference recipe's
    lr 0.1 at B256 scaled to B128."""
    import torchvision
    b, res, classes = (2, 32, 10) if quick else (128, 224, 1000)
    model = torchvision.models.resnet50(weights=None, num_classes=classes)
    model = model.to(device, memory_format=torch.channels_last)
    gen = generator()
    batch = (images(gen, b, res, device).contiguous(memory_format=torch.channels_last),
             tokens(gen, classes, (b,), device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return one_model(model, opt, batch, _classify)


def _detection_loss(model: Callable[..., Any], batch: tuple[list, list]) -> torch.Tensor:
    return sum(model(*batch).values())


def detector(quick: bool, device: str) -> Workload:
    """torchvision Faster R-CNN, MobileNetV3-Large FPN (B8 images of 512, resized to 800 by the model): proposals,
    sampling and NMS give data-dependent shapes, the case torch.compile finds hardest."""
    import torchvision
    b, res = (2, 64) if quick else (8, 512)
    sizes = dict(min_size=64, max_size=64) if quick else {}
    model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_fpn(
        weights=None, weights_backbone=None, num_classes=91, **sizes).to(device)
    gen = generator()
    imgs, targets = [], []
    for _ in range(b):
        n = int(torch.randint(1, 6, (), generator=gen))
        xy = torch.rand(n, 2, generator=gen) * res * 0.7
        wh = res * (0.05 + 0.25 * torch.rand(n, 2, generator=gen))
        boxes = torch.cat([xy, (xy + wh).clamp(max=res - 1)], dim=1)
        imgs.append(torch.rand(3, res, res, generator=gen).to(device))
        targets.append({"boxes": boxes.to(device), "labels": tokens(gen, 91, (n,), device, low=1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    return one_model(model, opt, (imgs, targets), _detection_loss)
