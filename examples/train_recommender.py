"""A plain PyTorch training script (no automp code): a click-through-rate model with a huge user-embedding table.

The user table (200,000 x 32) dwarfs everything else, but each step looks up only a batch of rows, so converting
the table to low precision would cost far more than it saves. Users are drawn from a skewed (popularity-like)
distribution so the hot users recur; a click depends on the user, the item and a few dense features.
Run it as `python examples/train_recommender.py` or, unchanged, as `automp run examples/train_recommender.py`."""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

USERS, ITEMS, DIM, DENSE = 200_000, 1_000, 32, 16

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=100)
p.add_argument("--batch", type=int, default=256)
args = p.parse_args()
torch.manual_seed(0)
user_taste, item_traits = torch.randn(USERS, 8), torch.randn(ITEMS, 8)
dense_weight = torch.randn(DENSE) / DENSE ** 0.5


def batch(n: int, gen: torch.Generator):
    users = (USERS * torch.rand(n, generator=gen) ** 6).long()  # skewed: low ids are the popular users
    items = torch.randint(0, ITEMS, (n,), generator=gen)
    dense = torch.randn(n, DENSE, generator=gen)
    logit = (user_taste[users] * item_traits[items]).sum(1) / 2 + 2 * dense @ dense_weight
    clicks = (torch.rand(n, generator=gen) < torch.sigmoid(logit)).float()
    return users, items, dense, clicks


class CTRModel(nn.Module):
    def __init__(self, hidden: int = 256):
        super().__init__()
        self.users = nn.Embedding(USERS, DIM)
        self.items = nn.Embedding(ITEMS, DIM)
        self.mlp = nn.Sequential(nn.Linear(2 * DIM + DENSE + DIM, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                 nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, users, items, dense):
        u, i = self.users(users), self.items(items)
        return self.mlp(torch.cat([u, i, dense, u * i], dim=1)).squeeze(1)


model = CTRModel()
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
train_gen, eval_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
eval_batch = batch(4096, eval_gen)
for step in range(args.steps):
    users, items, dense, clicks = batch(args.batch, train_gen)
    loss = F.binary_cross_entropy_with_logits(model(users, items, dense), clicks)
    opt.zero_grad()
    loss.backward()
    opt.step()
with torch.no_grad():
    final = F.binary_cross_entropy_with_logits(model(*eval_batch[:3]), eval_batch[3]).item()
print(json.dumps({"final_loss": final}))
