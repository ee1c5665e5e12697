"""The zoo's models and the loops a user writes around them (`automp bench zoo` and its interleaved ratios share them).

Modes, each the same training loop as the user would write it:
  fp32-eager             the plain loop, TF32 off (matmul and cuDNN) so FP32 means FP32
  autocast-bf16-eager    torch.autocast(bf16) around forward+loss
  autocast-bf16-compile  the same + torch.compile of every module: what a careful user writes
  autocast-bf16-graphs   the same with torch.compile(mode="reduce-overhead") (CUDA graphs) and fused Adam/AdamW: the
                         strongest loop an expert writes by hand, the ANCHOR of the results table where it is run
  bf16-liger             autocast-bf16-graphs with Liger-Kernel's fused linear cross-entropy on a transformers Llama
                         (llama, llama-1b; automp.bench.liger.with_liger): the strongest loop for an HF LLM
  autocast-fp16-compile  torch.autocast(fp16) + torch.compile + torch.amp.GradScaler
  automp-bf16/-fp16      the fp32-eager loop unchanged, automp.enable() before it, disable() after (`automp run`)
"""
from __future__ import annotations

import contextlib
import importlib.util
import signal
import threading
from typing import Any, Callable, Iterator

import torch

from automp.bench import zoo_models as zm
from automp.bench.liger import with_liger
from automp.bench import zoo_scripts as zs

# name -> (builder, libraries it needs): the order of the tables and the plot
MODELS: dict[str, tuple[Callable[[bool, str], zm.Workload], tuple[str, ...]]] = {
    "gpt2": (zm.gpt2, ("transformers",)), "llama": (zm.llama, ("transformers",)),
    "bert": (zm.bert, ("transformers",)), "t5": (zm.t5, ("transformers",)),
    "vit": (zm.vit, ("timm", "torchvision")), "convnext": (zm.convnext, ("timm", "torchvision")),
    "effnet": (zm.effnet, ("timm", "torchvision")), "resnet50": (zm.resnet50, ("torchvision",)),
    "detector": (zm.detector, ("torchvision",)),
    "gan": (zs.gan, ()), "recsys": (zs.recsys, ()), "lstm": (zs.lstm, ()), "mlp": (zs.mlp, ()),
    "llama-1b": (zm.llama_1b, ("transformers",)),
}
EXTRA_MODELS = ("llama-1b",)  # accepted by --models, not run by default (1.2B parameters: minutes per mode)
MODES = ("fp32-eager", "autocast-bf16-eager", "autocast-bf16-compile", "autocast-fp16-compile", "automp-bf16",
         "automp-fp16")
ANCHOR = "autocast-bf16-compile"  # the default anchor: every default run has it
STRONGEST = "autocast-bf16-graphs"  # the expert's loop; ratios are taken against it in a run that has it
LIGER = "bf16-liger"  # the strongest loop plus Liger-Kernel, for transformers Llama models
EXTRA_MODES = (STRONGEST, LIGER)  # accepted by --modes, not run by default (each compiles the model once more)


class ModeLoop:
    """The `Loop` a workload's step runs against: autocast, compile and GradScaler as `mode` asks."""

    def __init__(self, work: zm.Workload, mode: str, device: str):
        self.work, self.device = work, device
        if mode == LIGER:
            for module in work.modules.values():
                with_liger(module)
            mode = STRONGEST
        graphs = mode.endswith("-graphs")
        compiled = mode.endswith("-compile") or graphs
        self.nets = {k: (torch.compile(m, mode="reduce-overhead") if graphs else torch.compile(m)) if compiled else m
                     for k, m in work.modules.items()}
        if graphs:
            fuse_adam(work.optimizers.values())
        self.dtype = {"autocast-bf16": torch.bfloat16, "autocast-fp16": torch.float16}.get(mode[:13])
        self.scaler = torch.amp.GradScaler(device) if self.dtype == torch.float16 else None

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device, dtype=self.dtype) if self.dtype else contextlib.nullcontext()

    def update(self, loss: torch.Tensor, name: str) -> None:
        opt = self.work.optimizers[name]
        opt.zero_grad(set_to_none=True)
        if self.scaler is None:
            loss.backward()
            opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(opt)

    def step(self) -> torch.Tensor:
        """One iteration of the user's loop (GradScaler updates once, after all its optimizers stepped)."""
        loss = self.work.step(self, self.work.batch)
        if self.scaler is not None:
            self.scaler.update()
        return loss.detach()


def missing_libraries(name: str) -> list[str]:
    return [lib for lib in MODELS[name][1] if importlib.util.find_spec(lib) is None]


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[list[TimeoutError]]:
    """Yields a list that holds a TimeoutError once `seconds` have passed; the alarm also raises it in the main
    thread, to interrupt a compile that runs away. Code that swallows it (automp steps aside when a compilation
    fails) is caught by the caller checking the list. No limit for seconds <= 0 or off the main thread."""
    expired: list[TimeoutError] = []
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield expired
        return

    def expire(signum: int, frame: Any) -> None:
        expired.append(TimeoutError(f"timeout: the mode ran past --mode-timeout {seconds:g} s"))
        raise expired[0]

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield expired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)




def fuse_adam(optimizers: Any) -> None:
    """fused=True for the Adam/AdamW groups left at their defaults on CUDA: what an expert passes to the constructor
    (`torch.optim.AdamW(..., fused=True)`), done after the workload built its optimizers."""
    for opt in optimizers:
        if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for group in opt.param_groups:
            if group.get("fused") is None and group.get("foreach") is None and all(
                    p.is_cuda and p.is_floating_point() for p in group["params"]):
                group["fused"], group["foreach"] = True, False
