"""A plain PyTorch training script (no automp code): a conv-BatchNorm-ReLU classifier on generated images.

Each of the 10 classes is a fixed random 3x16x16 pattern; a sample is its class pattern at a random contrast plus
noise, so the net has to learn the patterns. Run it as `python examples/train_cnn_bn.py` or, unchanged, as
`automp run examples/train_cnn_bn.py`."""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--batch", type=int, default=128)
args = p.parse_args()
torch.manual_seed(0)
patterns = torch.randn(10, 3, 16, 16)


def batch(n: int, gen: torch.Generator):
    labels = torch.randint(0, 10, (n,), generator=gen)
    contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=gen)
    images = contrast * patterns[labels] + 1.5 * torch.randn(n, 3, 16, 16, generator=gen)
    return images, labels


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


model = nn.Sequential(conv_bn(3, 32), nn.MaxPool2d(2), conv_bn(32, 64), nn.MaxPool2d(2), conv_bn(64, 128),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
train_gen, eval_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
eval_x, eval_y = batch(512, eval_gen)
model.train()
for step in range(args.steps):
    x, y = batch(args.batch, train_gen)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
model.eval()
with torch.no_grad():
    final = F.cross_entropy(model(eval_x), eval_y).item()
print(json.dumps({"final_loss": final}))
