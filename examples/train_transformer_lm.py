"""A plain PyTorch training script (no automp code): a small causal Transformer LM (nn.TransformerEncoder).

Each generated sequence counts up modulo the vocabulary in its own stride (1, 2, 3, 5 or 7), with 10% of tokens
replaced by noise: the next token follows from the previous one once the stride is read off the context, which is
what attention has to learn. Run it as `python examples/train_transformer_lm.py` or, unchanged, as
`automp run examples/train_transformer_lm.py`."""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, STRIDES, NOISE = 128, torch.tensor([1, 2, 3, 5, 7]), 0.1

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--seq", type=int, default=48)
args = p.parse_args()
torch.manual_seed(0)


def batch(n: int, gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, VOCAB, (n, 1), generator=gen)
    stride = STRIDES[torch.randint(0, len(STRIDES), (n, 1), generator=gen)]
    tokens = (start + stride * torch.arange(args.seq + 1)) % VOCAB
    noise = torch.rand(n, args.seq + 1, generator=gen) < NOISE
    return torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=gen), tokens)


class TransformerLM(nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int = 128, heads: int = 4, layers: int = 2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.norm(self.encoder(x, mask=mask, is_causal=True)))


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


model = TransformerLM(VOCAB, args.seq)
opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
train_gen, eval_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
eval_tokens = batch(128, eval_gen)
for step in range(args.steps):
    tokens = batch(args.batch, train_gen)
    loss = lm_loss(model(tokens[:, :-1]), tokens)
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
model.eval()
with torch.no_grad():
    final = lm_loss(model(eval_tokens[:, :-1]), eval_tokens).item()
print(json.dumps({"final_loss": final}))
