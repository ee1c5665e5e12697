"""Generated training data with a known amount of learnable structure, for the demo.

Generated rather than downloaded so the demo runs offline in seconds, and with structure whose best achievable
loss is known exactly: a fall in loss is then learning, not noise, and "how far from the floor" is meaningful.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MarkovCorpus:
    """Token streams from a fixed random Markov chain where each token has only `successors` possible next tokens.

    A language model that learns the chain reaches the chain's entropy rate, ln(successors) for uniform choices,
    far below the ln(vocab) of a model that learned nothing."""

    vocab: int = 128
    successors: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.successors <= self.vocab:
            raise ValueError(f"MarkovCorpus: successors must be in [1, vocab={self.vocab}], got {self.successors}")
        gen = torch.Generator().manual_seed(self.seed)
        self.table = torch.stack([torch.randperm(self.vocab, generator=gen)[:self.successors]
                                  for _ in range(self.vocab)])

    def entropy(self) -> float:
        """The loss floor (nats per token) of a perfect model."""
        return float(torch.log(torch.tensor(float(self.successors))))

    def batch(self, n: int, seq: int, gen: torch.Generator) -> torch.Tensor:
        """[n, seq + 1] token ids: inputs are [:, :-1], next-token targets [:, 1:]."""
        tokens = torch.empty(n, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab, (n,), generator=gen)
        for t in range(seq):
            pick = torch.randint(0, self.successors, (n,), generator=gen)
            tokens[:, t + 1] = self.table[tokens[:, t], pick]
        return tokens


@dataclass
class PatternImages:
    """Images whose class is a fixed random pattern, shown at a random contrast under Gaussian noise.

    The noise makes single pixels useless, so the classifier has to learn the patterns with its convolutions."""

    classes: int = 10
    channels: int = 3
    size: int = 16
    noise: float = 1.5
    seed: int = 0

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        self.patterns = torch.randn(self.classes, self.channels, self.size, self.size, generator=gen)

    def batch(self, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, self.classes, (n,), generator=gen)
        contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=gen)
        noise = self.noise * torch.randn(n, self.channels, self.size, self.size, generator=gen)
        return contrast * self.patterns[labels] + noise, labels
