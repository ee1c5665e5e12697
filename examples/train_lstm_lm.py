"""A plain PyTorch training script (no automp code): an LSTM language model on a generated corpus.

The corpus comes from a fixed random Markov chain in which every token has only 4 possible successors, so a model
that learns the chain gets the loss down from ln(100) ≈ 4.6 towards ln(4) ≈ 1.4. Run it as
`python examples/train_lstm_lm.py` or, unchanged, as `automp run examples/train_lstm_lm.py`."""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SUCCESSORS = 100, 4

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--batch", type=int, default=128)
p.add_argument("--seq", type=int, default=32)
args = p.parse_args()
torch.manual_seed(0)
successors = torch.randint(0, VOCAB, (VOCAB, SUCCESSORS))


def batch(n: int, gen: torch.Generator) -> torch.Tensor:
    tokens = torch.empty(n, args.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (n,), generator=gen)
    for t in range(args.seq):
        choice = torch.randint(0, SUCCESSORS, (n,), generator=gen)
        tokens[:, t + 1] = successors[tokens[:, t], choice]
    return tokens


class LSTMLM(nn.Module):
    def __init__(self, vocab: int, emb: int = 64, hidden: int = 256):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(idx))
        return self.head(h)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


model = LSTMLM(VOCAB)
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
train_gen, eval_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
eval_tokens = batch(256, eval_gen)
for step in range(args.steps):
    tokens = batch(args.batch, train_gen)
    loss = lm_loss(model(tokens[:, :-1]), tokens)
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
with torch.no_grad():
    final = lm_loss(model(eval_tokens[:, :-1]), eval_tokens).item()
print(json.dumps({"final_loss": final}))
