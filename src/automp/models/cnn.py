"""A small conv-BatchNorm-ReLU classifier: the layer pattern of every ResNet-era vision model, at demo size.

BatchNorm is the interesting part for mixed precision: its batch statistics must stay FP32 while the convolutions
around it run in low precision, and its running statistics must keep working in eval mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass
class CNNConfig:
    in_channels: int = 3
    widths: tuple[int, ...] = (32, 64, 128)
    classes: int = 10


def conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class CNN(nn.Module):
    """conv-bn-relu stages, each but the last followed by 2x2 max pooling, then global average pooling + linear."""

    def __init__(self, cfg: CNNConfig):
        super().__init__()
        if not cfg.widths:
            raise ValueError("CNNConfig: widths must name at least one stage")
        layers: list[nn.Module] = []
        cin = cfg.in_channels
        for i, width in enumerate(cfg.widths):
            layers.append(conv_bn_relu(cin, width))
            if i < len(cfg.widths) - 1:
                layers.append(nn.MaxPool2d(2))
            cin = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(cin, cfg.classes)

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))
