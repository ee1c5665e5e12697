"""Check on a GPU: training loops of different shapes on automp's CUDA-graphed path (forced), against the same
loop on autocast-compiled, and the graphs' memory pool given back at automp.disable().

    python scripts/graph_pool_check.py [no-rescue]

Loops: top (zero_grad, forward, backward, step), tutorial (forward, zero_grad, backward, step), accumulate (two
micro-batches per step, zero_grad at the top), keep (zero_grad(set_to_none=False)), siamese (the module called on two
inputs before one backward: the second replay must not overwrite what the first saved for the backward). Prints per
loop the relative difference of the final parameters, or the error the loop raised. no-rescue: graph_pool.GradRescue
switched off.
"""
import sys

import torch
import torch.nn as nn

import automp
from automp.runtime import graph_pool

GIB = 2**30


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda()


def train(path, loop, steps=8):
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(256, 512, device="cuda", generator=gen) for _ in range(4)]
    automp.enable(dtype="bf16", path=path)
    try:
        for i in range(steps):
            if loop == "accumulate":
                opt.zero_grad()
                for x in xs[:2]:
                    net(x).float().pow(2).mean().backward()
                opt.step()
                continue
            if loop in ("top", "keep"):
                opt.zero_grad(set_to_none=loop == "top")
            if loop == "siamese":
                loss = (net(xs[i % 4]).float() - net(xs[(i + 1) % 4]).float()).pow(2).mean()
            else:
                loss = net(xs[i % 4]).float().pow(2).mean()
            if loop == "tutorial":
                opt.zero_grad()
            loss.backward()
            opt.step()
        torch.cuda.synchronize()
        return torch.cat([p.detach().flatten() for p in net.parameters()]), None
    except Exception as e:  # noqa: BLE001 - the point is which loops fail
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"
    finally:
        automp.disable()


def release():
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x = torch.randn(4096, 512, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved() / GIB
    automp.enable(dtype="bf16", path="autocast-graphs")
    for _ in range(6):
        opt.zero_grad()
        net(x).float().pow(2).mean().backward()
        opt.step()
    torch.cuda.synchronize()
    print(f"  graph functions {graph_pool.graph_functions(0)}, live pool storages "
          f"{len(graph_pool.live_storages(0) or ())} (None = internals unknown: {graph_pool.live_storages(0) is None})")
    opt.zero_grad()
    held = torch.cuda.memory_reserved() / GIB
    rep = automp.disable()
    torch.cuda.synchronize()
    after = torch.cuda.memory_reserved() / GIB
    setting = [s for s in rep["settings"] if s["setting"] == "CUDA graphs memory pool"]
    print(f"  reserved: before {base:.3f} GiB, on graphs {held:.3f}, after disable {after:.3f}; report {setting}")
    # CUDA graphs after the release still work (a new tree)
    again = torch.compile(mine := model(), mode="reduce-overhead")
    for _ in range(4):
        mine.zero_grad()
        y = again(x).float().pow(2).mean()
        y.backward()
    torch.cuda.synchronize()
    print(f"  the script's own reduce-overhead graphs after the release: loss {y.item():.4f}")


def count_copies():
    """Wraps GradRescue.before_replay to count the gradients it copies, per loop."""
    copied, plain = [], graph_pool.GradRescue.before_replay

    def counting(self, params):
        copied.append(plain(self, params))
        return copied[-1]
    graph_pool.GradRescue.before_replay = counting
    return copied


def main(mode=""):
    if mode == "no-rescue":
        graph_pool.GradRescue.before_replay = lambda self, params: 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, rescue {'off' if mode else 'on'}", flush=True)
    copied = count_copies()
    for loop in ("top", "tutorial", "accumulate", "keep", "siamese"):
        ref, err_ref = train("autocast-compile", loop)
        copied.clear()
        out, err = train("autocast-graphs", loop)
        diff = None if ref is None or out is None else ((out - ref).norm() / ref.norm()).item()
        print(f"  {loop:10s} graphed vs autocast-compiled: rel diff {diff}  error {err or err_ref}; gradients copied "
              f"per graphed call {copied}", flush=True)
    if not mode:
        release()


if __name__ == "__main__":
    main(*sys.argv[1:2])
