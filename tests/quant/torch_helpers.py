"""Seeded torch models and inputs shared by the tests of automp.quant's torch layers, of its PTQ pipeline and of
automp.deploy.quantized (a plain module: conftest files are not meant to be imported)."""
from __future__ import annotations

import torch
import torch.nn as nn

# Compiled Triton on a GPU, the Triton interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def mlp(*widths: int, seed: int = 0) -> nn.Sequential:
    """Linear-GELU stacks with random (seeded) weights and biases, FP32, eval mode."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k, n in zip(widths, widths[1:]):
        layers += [nn.Linear(k, n), nn.GELU()]
    return nn.Sequential(*layers[:-1]).eval().to(DEVICE)


def tiny_bert(layers: int = 1, pooler: bool = True):
    """A transformers BertModel at test size (hidden 64, 4 heads, FFN 96), random init, FP32."""
    transformers = __import__("pytest").importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                  intermediate_size=96, max_position_embeddings=32)
    return transformers.BertModel(cfg, add_pooling_layer=pooler).eval().to(DEVICE)


def bert_batch(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1:, seq - 2:] = 0  # padded rows, as in a real batch
    return {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE)}
