"""Diagnostic: what channels_last parameters are worth on the zoo's convolutional models, per mode.

    python scripts/memory_format.py resnet50:autocast-bf16-eager gan:fp32-eager:hooks effnet:fp32-eager:in ...

variants: params (default: the parameters converted), in (parameters and the batch), hooks (the parameters left as
they are; a forward pre-hook on every 2-d convolution converts its input).

Why: cuDNN's bf16/fp16 convolutions run NHWC kernels; a conv whose weight is channels_last makes its output
channels_last, so converting the parameters once carries the layout through the network with no change to the
script. Inductor already picks channels_last inside compiled graphs (layout optimization), converting weights at the
graph's edge each call. Two copies of the workload (same seed), one converted; blocks of steps alternate between
them (the order flips each round); medians and peaks are printed.
"""
import statistics
import sys

import torch

from automp.bench.suites import zoo
from automp.bench.suites.zoo_interleave import block_ms

BLOCK, ROUNDS = 10, 6
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def to_channels_last(x):
    if isinstance(x, torch.Tensor) and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if isinstance(x, (list, tuple)):
        return type(x)(to_channels_last(v) for v in x)
    if isinstance(x, dict):
        return {k: to_channels_last(v) for k, v in x.items()}
    return x


def measure(name: str, mode: str, variant: str) -> None:
    loops = {}
    for cl in (False, True):
        torch.manual_seed(0)
        work = zoo.MODELS[name][0](False, DEV)
        if cl and variant == "hooks":
            for m in work.modules.values():
                for c in m.modules():
                    if isinstance(c, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
                        c.register_forward_pre_hook(lambda mod, a: (to_channels_last(a[0]),) + tuple(a[1:]))
        elif cl:
            for m in work.modules.values():
                m.to(memory_format=torch.channels_last)
            if variant == "in":
                work.batch = to_channels_last(work.batch)
        loops[cl] = zoo.ModeLoop(work, mode, DEV)
        block_ms(loops[cl].step, 3, DEV)
    times: dict[bool, list[float]] = {False: [], True: []}
    peak = {False: 0.0, True: 0.0}
    for r in range(ROUNDS):
        for cl in ((False, True) if r % 2 == 0 else (True, False)):
            torch.cuda.is_available() and torch.cuda.reset_peak_memory_stats()
            times[cl].append(block_ms(loops[cl].step, BLOCK, DEV))
            peak[cl] = max(peak[cl], (torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0))
    a, b = statistics.median(times[False]), statistics.median(times[True])
    print(f"| {name} | {mode} | {variant} | {a:.2f} | {b:.2f} | {a / b:.3f} "
          f"| {peak[False]:.3f} | {peak[True]:.3f} |", flush=True)


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    print("| model | mode | converted | contiguous ms | channels_last ms | ratio | peak GiB contiguous | "
          "channels_last |\n|---|---|---|---:|---:|---:|---:|---:|")
    for arg in sys.argv[1:]:
        name, mode, *rest = arg.split(":")
        try:
            measure(name, mode, rest[0] if rest else "params")
        except Exception as e:  # noqa: BLE001 - one model's failure must not lose the others' rows
            print(f"| {name} | {mode} | error: {type(e).__name__}: {str(e)[:150]} |", flush=True)
        torch._dynamo.reset()
        torch.cuda.is_available() and torch.cuda.empty_cache()
