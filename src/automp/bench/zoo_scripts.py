"""Small hand-written training scripts for `automp bench zoo`, plain PyTorch as a user writes it.

They cover what the big models do not: two models and two optimizers in one step (a DCGAN), a huge embedding table
whose every row Adam updates (a wide-and-deep recommender), a cuDNN LSTM, and a model so small that launch overhead
and casts dominate (an MLP). Each batch is fixed and learnable, so a few steps visibly lower the loss.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.bench.zoo_models import Loop, Workload, generator, images, one_model, tokens


def _generator_net(nz: int, width: int, levels: int) -> nn.Sequential:
    """DCGAN generator: 1x1 noise -> 4x4 -> ... -> (4 * 2**levels)^2 RGB in [-1, 1]."""
    layers: list[nn.Module] = [nn.ConvTranspose2d(nz, width * 2 ** (levels - 1), 4, 1, 0, bias=False),
                               nn.BatchNorm2d(width * 2 ** (levels - 1)), nn.ReLU(True)]
    for i in reversed(range(1, levels)):
        layers += [nn.ConvTranspose2d(width * 2 ** i, width * 2 ** (i - 1), 4, 2, 1, bias=False),
                   nn.BatchNorm2d(width * 2 ** (i - 1)), nn.ReLU(True)]
    return nn.Sequential(*layers, nn.ConvTranspose2d(width, 3, 4, 2, 1, bias=False), nn.Tanh())


def _discriminator_net(width: int, levels: int) -> nn.Sequential:
    """DCGAN discriminator, the generator mirrored; one logit per image (BCE-with-logits, autocast-safe)."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, True)]
    for i in range(1, levels):
        layers += [nn.Conv2d(width * 2 ** (i - 1), width * 2 ** i, 4, 2, 1, bias=False),
                   nn.BatchNorm2d(width * 2 ** i), nn.LeakyReLU(0.2, True)]
    return nn.Sequential(*layers, nn.Conv2d(width * 2 ** (levels - 1), 1, 4, 1, 0, bias=False), nn.Flatten(0))


def _gan_step(loop: Loop, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The DCGAN tutorial's loop: D on real and on fake.detach(), D steps; then G steps through D(fake).
    Returns D's loss (G's rises as D learns, so D's is the one that shows training works)."""
    real, z = batch
    g, d = loop.nets["G"], loop.nets["D"]
    ones, zeros = torch.ones(real.shape[0], device=real.device), torch.zeros(real.shape[0], device=real.device)
    with loop.autocast():
        fake = g(z)
        d_loss = (F.binary_cross_entropy_with_logits(d(real), ones)
                  + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros))
    loop.update(d_loss, "D")
    with loop.autocast():
        g_loss = F.binary_cross_entropy_with_logits(d(fake), ones)
    loop.update(g_loss, "G")
    return d_loss


def gan(quick: bool, device: str) -> Workload:
    """DCGAN on 64x64 images (B128, nz 100, width 64); "real" images are smooth random blobs."""
    b, nz, width, levels = (8, 16, 8, 2) if quick else (128, 100, 64, 4)
    g, d = _generator_net(nz, width, levels).to(device), _discriminator_net(width, levels).to(device)
    gen = generator()
    res = 4 * 2 ** levels
    real = torch.tanh(2 * F.interpolate(images(gen, b, 4, "cpu"), size=res, mode="bilinear")).to(device)
    z = torch.randn(b, nz, 1, 1, generator=gen).to(device)
    opts = {name: torch.optim.Adam(m.parameters(), lr=2e-4, betas=(0.5, 0.999)) for name, m in (("G", g), ("D", d))}
    return Workload({"G": g, "D": d}, opts, (real, z), _gan_step)


class WideAndDeep(nn.Module):
    """Wide: one learned weight per hashed (user, item) cross plus a linear on dense features. Deep: an MLP on the
    user and item embeddings and the dense features. The user table is the multi-million-row one."""

    def __init__(self, users: int, items: int, crosses: int, dim: int, dense: int, hidden: list[int]):
        super().__init__()
        self.crosses = crosses
        self.users, self.items = nn.Embedding(users, dim), nn.Embedding(items, dim)
        self.wide_cross, self.wide_dense = nn.Embedding(crosses, 1), nn.Linear(dense, 1)
        dims = [2 * dim + dense, *hidden]
        mlp: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            mlp += [nn.Linear(a, b), nn.ReLU()]
        self.deep = nn.Sequential(*mlp, nn.Linear(dims[-1], 1))

    def forward(self, user: torch.Tensor, item: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        cross = (user * 1_000_003 + item) % self.crosses
        wide = self.wide_cross(cross).squeeze(1) + self.wide_dense(dense).squeeze(1)
        deep = self.deep(torch.cat([self.users(user), self.items(item), dense], dim=1)).squeeze(1)
        return wide + deep


def _ctr_loss(model, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    user, item, dense, click = batch
    return F.binary_cross_entropy_with_logits(model(user, item, dense), click)


def recsys(quick: bool, device: str) -> Workload:
    """Wide-and-deep CTR model, 2M x 64 user table (+100k items), B4096, dense Adam over every row."""
    users, items, crosses, dim, hidden, b = ((10_000, 500, 10_000, 16, [64, 32], 64) if quick
                                             else (2_000_000, 100_000, 1_000_000, 64, [1024, 512, 256], 4096))
    dense_n = 13
    model = WideAndDeep(users, items, crosses, dim, dense_n, hidden).to(device)
    gen = generator()
    user = (users * torch.rand(b, generator=gen) ** 4).long()  # skewed: low ids are the popular users
    item = torch.randint(0, items, (b,), generator=gen)
    dense = torch.randn(b, dense_n, generator=gen)
    click = (torch.rand(b, generator=gen) < torch.sigmoid(dense[:, :4].sum(1))).float()
    batch = tuple(t.to(device) for t in (user, item, dense, click))
    return one_model(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch, _ctr_loss)


class LSTMLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, d, layers, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])


def _lm_loss(model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def lstm(quick: bool, device: str) -> Workload:
    """2-layer LSTM LM, d 1024, vocab 10k, B32 x T64; sequences are arithmetic progressions mod vocab (learnable)."""
    vocab, d, b, t = (64, 32, 4, 16) if quick else (10_000, 1024, 32, 64)
    model = LSTMLM(vocab, d, 2).to(device)
    gen = generator()
    start, stride = tokens(gen, vocab, (b, 1), "cpu"), tokens(gen, 7, (b, 1), "cpu", low=1)
    seq = ((start + stride * torch.arange(t + 1)) % vocab).to(device)
    return one_model(model, torch.optim.Adam(model.parameters(), lr=1e-3), (seq[:, :-1], seq[:, 1:]), _lm_loss)


def _mlp_loss(model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def mlp(quick: bool, device: str) -> Workload:
    """3-layer MLP, 784 -> 512 -> 512 -> 10 (B256), labels from a random linear teacher."""
    n_in, width, b = (32, 64, 32) if quick else (784, 512, 256)
    model = nn.Sequential(nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10)).to(device)
    gen = generator()
    x = torch.randn(b, n_in, generator=gen)
    y = (x @ torch.randn(n_in, 10, generator=gen)).argmax(1)
    return one_model(model, torch.optim.Adam(model.parameters(), lr=1e-3), (x.to(device), y.to(device)), _mlp_loss)
