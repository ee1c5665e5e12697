"""A plain PyTorch training script (no automp code): an MLP regressor on generated data.

Run it as `python examples/train_mlp.py` or, unchanged, as `automp run examples/train_mlp.py`."""
import argparse
import json

import torch
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
args = p.parse_args()
torch.manual_seed(0)
x = torch.randn(2048, 128)
w_true = torch.randn(128, 1) / 128 ** 0.5
y = torch.tanh(x @ w_true) + 0.01 * torch.randn(2048, 1)
model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(args.steps):
    idx = torch.randint(0, 2048, (256,))
    loss = nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
with torch.no_grad():
    final = nn.functional.mse_loss(model(x), y).item()
print(json.dumps({"final_loss": final}))
