"""Six tiny model families on generated data, for checking that reduced precision trains as well as FP32.

Each family is a `Task`: it owns its model(s), optimizer(s) and a seeded data generator, and its `train_step` is
written exactly as a user would write it (forward, loss, backward, step; no automp calls), so whatever precision
machinery is active around it (automp.enable, autocast + the loss-scaling hook) is tested the way users meet it.
`evaluate` measures the trained weights in FP32 on a fixed held-out batch.

`loss_mult` multiplies the training loss: a loss in small units (a down-weighted objective, a per-token sum divided
by a large count) whose gradients fall below fp16's range. With Adam, FP32 barely notices; fp16 without loss
scaling loses the gradients and stalls. "cnn-small-loss" is that case.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Size:
    width: int
    batch: int
    steps: int


SIZES = {"tiny": Size(width=16, batch=32, steps=60), "full": Size(width=128, batch=128, steps=400)}


class Task:
    """One family. Subclasses set `metric_name`/`higher_is_better`/`tolerance` (how far, in the metric's units, a
    low-precision run may trail FP32 and still count as converged) and build in `setup`."""
    metric_name = "loss"
    higher_is_better = False
    tolerance = 0.05
    lr = 3e-3
    steps_factor = 1.0  # families that need longer than the size's default

    def __init__(self, size: str = "tiny", device: str | torch.device = "cpu", seed: int = 0,
                 loss_mult: float = 1.0) -> None:
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}: expected one of {sorted(SIZES)}")
        self.size, self.device, self.loss_mult = SIZES[size], torch.device(device), loss_mult
        self.gen = torch.Generator().manual_seed(1000 + seed)
        torch.manual_seed(seed)
        self.setup(self.size.width)
        self.model.to(self.device)
        self.build_optimizers()

    def build_optimizers(self) -> None:
        self.opt = torch.optim.Adam(self.model.parameters(), lr=self.lr)

    @property
    def default_steps(self) -> int:
        return int(self.size.steps * self.steps_factor)

    def setup(self, width: int) -> None:
        raise NotImplementedError

    def batch(self, n: int) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def loss_and_metric(self, *batch: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def train_step(self, step: int) -> Tensor:
        data = [t.to(self.device) for t in self.batch(self.size.batch)]
        loss, _ = self.loss_and_metric(*data)
        self.opt.zero_grad()
        (loss * self.loss_mult).backward()
        self.opt.step()
        return loss.detach().float()

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        held_out = torch.Generator().manual_seed(99)
        gen, self.gen = self.gen, held_out
        try:
            data = [t.to(self.device) for t in self.batch(512)]
        finally:
            self.gen = gen
        loss, metric = self.loss_and_metric(*data)
        return float(loss), float(metric)


def _accuracy(logits: Tensor, target: Tensor) -> Tensor:
    return (logits.argmax(-1) == target).float().mean()


class Classifier(Task):
    """CNN on 12x12 images: each class is a fixed random template under heavy noise."""
    metric_name, higher_is_better = "accuracy", True

    def setup(self, w: int) -> None:
        self.templates = torch.randn(4, 1, 12, 12, generator=self.gen)
        self.model = nn.Sequential(nn.Conv2d(1, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                   nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                   nn.Flatten(), nn.Linear(2 * w * 9, 4))

    def batch(self, n: int) -> tuple[Tensor, ...]:
        y = torch.randint(0, 4, (n,), generator=self.gen)
        return self.templates[y] + 2.5 * torch.randn(n, 1, 12, 12, generator=self.gen), y

    def loss_and_metric(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.model(x).float()
        return F.cross_entropy(logits, y), _accuracy(logits, y)


class Detector(Task):
    """SSD-like: a 4x4 grid of cells over a 16x16 image holding one textured square; every cell predicts class
    (background + 3) and the cell holding the object's centre regresses its box (centre offset, size)."""
    metric_name, higher_is_better = "accuracy", True

    def setup(self, w: int) -> None:
        self.textures = torch.randn(3, 6, 6, generator=self.gen)
        self.model = nn.Sequential(nn.Conv2d(1, w, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.Conv2d(2 * w, 2 * w, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.Conv2d(2 * w, 4 + 4, 1))

    def batch(self, n: int) -> tuple[Tensor, ...]:
        g = self.gen
        x = 0.3 * torch.randn(n, 1, 16, 16, generator=g)
        cls = torch.randint(0, 3, (n,), generator=g)
        side = torch.randint(3, 7, (n,), generator=g)
        top = (torch.rand(n, generator=g) * (16 - side)).long()
        left = (torch.rand(n, generator=g) * (16 - side)).long()
        for i in range(n):
            s = int(side[i])
            x[i, 0, top[i]:top[i] + s, left[i]:left[i] + s] += 2.0 * self.textures[cls[i], :s, :s]
        cy, cx = top + side / 2, left + side / 2
        cell = (cy // 4).long() * 4 + (cx // 4).long()
        box = torch.stack([cy % 4 / 4, cx % 4 / 4, side / 6, side / 6], 1)
        return x, cls, cell, box

    def loss_and_metric(self, x: Tensor, cls: Tensor, cell: Tensor, box: Tensor) -> tuple[Tensor, Tensor]:
        out = self.model(x).float().flatten(2)  # [n, 8, 16 cells]
        n = x.shape[0]
        positive = torch.zeros(n, 16, dtype=torch.bool, device=x.device)
        positive[torch.arange(n), cell] = True
        pos = out[torch.arange(n), :, cell]  # [n, 8]: the positive cell's prediction
        neg = out[:, :4].transpose(1, 2)[~positive]  # [n * 15, 4]: background cells
        # positives and background weigh the same, as SSD's hard-negative mining aims for
        cls_loss = F.cross_entropy(pos[:, :4], cls + 1) + F.cross_entropy(neg, torch.zeros_like(neg[:, 0]).long())
        box_loss = F.smooth_l1_loss(pos[:, 4:], box)
        return cls_loss + box_loss, _accuracy(pos[:, :4], cls + 1)


class _Tokens(nn.Module):
    """Token + learned position embedding."""

    def __init__(self, vocab: int, d: int, length: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(0.02 * torch.randn(length, d))

    def forward(self, t: Tensor) -> Tensor:
        return self.tok(t) + self.pos[: t.shape[1]]


class Seq2Seq(nn.Module):
    def __init__(self, vocab: int, d: int, length: int) -> None:
        super().__init__()
        self.src, self.tgt = _Tokens(vocab, d, length), _Tokens(vocab, d, length)
        self.core = nn.Transformer(d, 2, 1, 1, 2 * d, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], device=src.device)
        return self.head(self.core(self.src(src), self.tgt(tgt_in), tgt_mask=mask))


class Translation(Task):
    """Toy NMT: translate a sequence into its reverse (encoder-decoder Transformer, teacher forcing)."""
    metric_name, higher_is_better, steps_factor = "token accuracy", True, 2.0
    vocab, length = 10, 8

    def setup(self, w: int) -> None:
        self.model = Seq2Seq(self.vocab + 1, 2 * w, self.length)

    def batch(self, n: int) -> tuple[Tensor, ...]:
        src = torch.randint(1, self.vocab + 1, (n, self.length), generator=self.gen)
        return src, src.flip(1)

    def loss_and_metric(self, src: Tensor, tgt: Tensor) -> tuple[Tensor, Tensor]:
        tgt_in = torch.cat([torch.zeros_like(tgt[:, :1]), tgt[:, :-1]], 1)  # 0 = begin-of-sequence
        logits = self.model(src, tgt_in).float()
        return F.cross_entropy(logits.flatten(0, 1), tgt.flatten()), _accuracy(logits, tgt)


class CausalLM(nn.Module):
    def __init__(self, vocab: int, d: int, length: int) -> None:
        super().__init__()
        self.embed = _Tokens(vocab, d, length)
        layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True)
        self.core, self.head = nn.TransformerEncoder(layer, 2), nn.Linear(d, vocab)

    def forward(self, t: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(t.shape[1], device=t.device)
        return self.head(self.core(self.embed(t), mask=mask, is_causal=True))


class LanguageModel(Task):
    """Next-token prediction on text from a random Markov chain (each token has a few likely successors), so the
    achievable loss is known to be well above zero. Metric: held-out perplexity."""
    metric_name, steps_factor = "perplexity", 1.5
    vocab, length = 16, 16

    def setup(self, w: int) -> None:
        logits = 3.0 * torch.randn(self.vocab, self.vocab, generator=self.gen)
        self.transition = logits.softmax(-1)
        self.model = CausalLM(self.vocab, 2 * w, self.length)

    def batch(self, n: int) -> tuple[Tensor, ...]:
        seq = [torch.randint(0, self.vocab, (n,), generator=self.gen)]
        for _ in range(self.length):
            seq.append(torch.multinomial(self.transition[seq[-1]], 1, generator=self.gen).squeeze(1))
        return (torch.stack(seq, 1),)

    def loss_and_metric(self, seq: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.model(seq[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
        return loss, loss.exp()


class GAN(Task):
    """A generator learns a 2-D Gaussian against a discriminator: two losses, two optimizers per step. The generator
    matches the mean of the discriminator's hidden features on real and fake data (feature matching, Salimans et
    al. 2016): plain non-saturating GANs oscillate on a toy target too much to compare runs. Metric: the distance
    of the generated samples' mean and std from the real ones."""
    metric_name, steps_factor, tolerance = "moment error", 10.0, 0.15
    real_mean, real_std = (1.5, -1.0), (0.3, 0.6)

    def setup(self, w: int) -> None:
        self.gen_net = nn.Sequential(nn.Linear(4, 2 * w), nn.ReLU(), nn.Linear(2 * w, 2 * w), nn.ReLU(),
                                     nn.Linear(2 * w, 2))
        self.features = nn.Sequential(nn.Linear(2, 2 * w), nn.LeakyReLU(0.2))
        self.disc = nn.Sequential(self.features, nn.Linear(2 * w, 1))
        self.model = nn.ModuleDict({"g": self.gen_net, "d": self.disc})

    def build_optimizers(self) -> None:
        self.opt = torch.optim.Adam(self.gen_net.parameters(), lr=self.lr, betas=(0.5, 0.999))
        self.opt_d = torch.optim.Adam(self.disc.parameters(), lr=self.lr, betas=(0.5, 0.999))

    def batch(self, n: int) -> tuple[Tensor, ...]:
        real = torch.tensor(self.real_mean) + torch.tensor(self.real_std) * torch.randn(n, 2, generator=self.gen)
        return real, torch.randn(n, 4, generator=self.gen)

    def train_step(self, step: int) -> Tensor:
        real, z = (t.to(self.device) for t in self.batch(2 * self.size.batch))
        ones = torch.ones(real.shape[0], 1, device=self.device)
        fake = self.gen_net(z)
        d_loss = F.binary_cross_entropy_with_logits(self.disc(real).float(), ones) + \
            F.binary_cross_entropy_with_logits(self.disc(fake.detach()).float(), torch.zeros_like(ones))
        self.opt_d.zero_grad()
        (d_loss * self.loss_mult).backward()
        self.opt_d.step()
        g_loss = (self.features(real).float().mean(0) - self.features(fake).float().mean(0)).pow(2).sum()
        self.opt.zero_grad()
        (g_loss * self.loss_mult).backward()
        self.opt.step()
        return (d_loss + g_loss).detach().float()

    def loss_and_metric(self, real: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
        fake = self.gen_net(z).float()
        ones = torch.ones(real.shape[0], 1, device=real.device)
        loss = F.binary_cross_entropy_with_logits(self.disc(fake).float(), ones)
        err = (fake.mean(0) - real.mean(0)).abs().sum() + (fake.std(0) - real.std(0)).abs().sum()
        return loss, err


class WideAndDeep(Task):
    """Click prediction from categorical fields (embeddings: a wide 1-d part and a deep part) plus dense features;
    labels come from a hidden logistic model with a feature cross, plus label noise."""
    metric_name, higher_is_better = "accuracy", True
    cards = (50, 30, 20)

    def setup(self, w: int) -> None:
        self.truth = [torch.randn(c, generator=self.gen) for c in self.cards]
        self.truth_dense = torch.randn(8, generator=self.gen)
        self.model = _WideDeepNet(self.cards, w)

    def batch(self, n: int) -> tuple[Tensor, ...]:
        cats = torch.stack([torch.randint(0, c, (n,), generator=self.gen) for c in self.cards], 1)
        dense = torch.randn(n, 8, generator=self.gen)
        logit = sum(t[cats[:, i]] for i, t in enumerate(self.truth)) + dense @ self.truth_dense
        logit = logit + 1.5 * self.truth[0][cats[:, 0]] * dense[:, 0]  # the cross the deep part must find
        y = (logit + 0.5 * torch.randn(n, generator=self.gen) > 0).float()
        return cats, dense, y

    def loss_and_metric(self, cats: Tensor, dense: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logit = self.model(cats, dense).float()
        return F.binary_cross_entropy_with_logits(logit, y), ((logit > 0).float() == y).float().mean()


class _WideDeepNet(nn.Module):
    def __init__(self, cards: tuple[int, ...], w: int) -> None:
        super().__init__()
        self.wide = nn.ModuleList(nn.Embedding(c, 1) for c in cards)
        self.deep = nn.ModuleList(nn.Embedding(c, w) for c in cards)
        self.mlp = nn.Sequential(nn.Linear(w * len(cards) + 8, 4 * w), nn.ReLU(), nn.Linear(4 * w, 2 * w),
                                 nn.ReLU(), nn.Linear(2 * w, 1))
        self.dense_wide = nn.Linear(8, 1)

    def forward(self, cats: Tensor, dense: Tensor) -> Tensor:
        wide = sum(e(cats[:, i]) for i, e in enumerate(self.wide)) + self.dense_wide(dense)
        deep = torch.cat([e(cats[:, i]) for i, e in enumerate(self.deep)] + [dense], 1)
        return (wide + self.mlp(deep)).squeeze(1)


SMALL_LOSS_MULT = 2.0 ** -22

FAMILIES: dict[str, Callable[..., Task]] = {
    "cnn": Classifier,
    "ssd": Detector,
    "nmt": Translation,
    "lm": LanguageModel,
    "gan": GAN,
    "widedeep": WideAndDeep,
}
# The case that stalls in fp16 without loss scaling (see the module docstring).
CASES: dict[str, tuple[str, float]] = {**{name: (name, 1.0) for name in FAMILIES},
                                       "cnn-small-loss": ("cnn", SMALL_LOSS_MULT)}


def make_task(case: str, size: str = "tiny", device: str | torch.device = "cpu", seed: int = 0) -> Task:
    if case not in CASES:
        raise ValueError(f"unknown convergence case {case!r}: expected one of {sorted(CASES)}")
    family, mult = CASES[case]
    return FAMILIES[family](size=size, device=device, seed=seed, loss_mult=mult)


