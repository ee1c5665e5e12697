"""Eager mixed-precision nets for the scaling tests: FP32 master weights, fp16 compute inside forward, so the
backward runs in fp16 and small gradients really underflow (no automp graph pass needed)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class HalfMLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4, half: bool = True):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
        self.dtype = torch.float16 if half else torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.dtype
        h = F.linear(x.to(d), self.l1.weight.to(d), self.l1.bias.to(d)).relu()
        return F.linear(h, self.l2.weight.to(d), self.l2.bias.to(d)).float()


def twin(model: HalfMLP) -> HalfMLP:
    """Same weights, FP32 compute: the reference."""
    ref = HalfMLP(model.l1.in_features, model.l1.out_features, model.l2.out_features, half=False)
    ref.load_state_dict(model.state_dict())
    return ref


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]
