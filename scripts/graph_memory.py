"""Diagnostic: where the memory of a CUDA-graphed training step goes, in a process of its own.

For one zoo model in one mode, after warm-up (cached blocks released, peaks reset), the last step records at three
points (forward done, backward done, optimizer stepped) the bytes allocated and reserved in the default pool and in
CUDA graphs' private pools (torch.cuda.memory_snapshot's segment_pool_id), and the steady-state peaks.

    python scripts/graph_memory.py llama fp32|anchor|anchor-ro|autocast-compile|autocast-graphs|auto [steps]

Also prints the whole run's reserved peak (warm-up and trial included) and each pool's largest segments; the
allocator's settings come from PYTORCH_CUDA_ALLOC_CONF. A mode that is not an anchor is automp's path (auto: the trial).

anchor-ro: the anchor compiled with mode="reduce-overhead" (stock CUDA graphs, the hand-written way to get them).
fp32: the user's plain FP32 eager script, what automp's whole-run peak (its trial) is held against.
GRAPH_MEMORY_HISTORY=1 records every allocation's Python stack and prints where the largest live blocks came from:
the way to name a steady-state difference between two modes.
"""
import os
import sys

import torch

import automp
from automp.bench.suites import zoo

GIB = 2**30


def pool_of(seg: dict) -> str:
    """A memory_snapshot segment's pool: the default one, or a CUDA graphs' private one."""
    return "default" if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0) else "graph"


def pools() -> dict[str, float]:
    out = {"default_alloc": 0, "default_resv": 0, "graph_alloc": 0, "graph_resv": 0}
    for seg in torch.cuda.memory_snapshot():
        kind = pool_of(seg)
        out[f"{kind}_alloc"] += seg["allocated_size"]
        out[f"{kind}_resv"] += seg["total_size"]
    return {k: round(v / GIB, 3) for k, v in out.items()}


class Probe(zoo.ModeLoop):
    """A ModeLoop that records memory around the update when asked to."""
    record: list | None = None

    def update(self, loss, name):
        if self.record is not None:
            torch.cuda.synchronize()
            self.record.append(("forward", pools()))
        opt = self.work.optimizers[name]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.record is not None:
            torch.cuda.synchronize()
            self.record.append(("backward", pools()))
        opt.step()
        if self.record is not None:
            torch.cuda.synchronize()
            self.record.append(("step", pools()))


def main(name, mode, steps=8):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    if os.environ.get("GRAPH_MEMORY_HISTORY"):
        torch.cuda.memory._record_memory_history(max_entries=200000)
    anchor, plain = mode.startswith("anchor"), mode == "fp32"
    loop = Probe(zoo.MODELS[name][0](False, "cuda"), zoo.ANCHOR if anchor else "fp32-eager", "cuda")
    if mode == "anchor-ro":
        loop.nets = {k: torch.compile(m, mode="reduce-overhead") for k, m in loop.work.modules.items()}
    if not (anchor or plain):
        automp.enable(dtype="bf16", path=mode)
    done = 0
    while done < int(steps) or (not (anchor or plain) and not automp.settled() and done < 300):
        loop.step()  # automp's trial must be over, or "steady state" would time the recording of a graph
        done += 1
    torch.cuda.synchronize()
    whole = torch.cuda.max_memory_reserved() / GIB
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        loop.step()
    loop.record = []
    loop.step()
    torch.cuda.synchronize()
    peak_a, peak_r = torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB
    if not (anchor or plain):
        for c in automp.disable().get("choices", []):
            print(f"    automp: {c['module']} runs {c['path']}", flush=True)
    print(f"{name} {mode}: steady peak allocated {peak_a:.3f} GiB, reserved {peak_r:.3f} GiB; whole-run reserved "
          f"peak {max(whole, peak_r):.3f} GiB ({done} steps to settle); allocator "
          f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default')}", flush=True)
    for where, p in loop.record:
        print(f"    after {where:8s} {p}", flush=True)
    segments()
    if os.environ.get("GRAPH_MEMORY_HISTORY"):
        live_blocks()


def segments() -> None:
    """Each pool's segments by size: how much of what is reserved is one large block vs many small ones."""
    by: dict[str, list] = {}
    for seg in torch.cuda.memory_snapshot():
        by.setdefault(pool_of(seg), []).append((seg["total_size"], seg["allocated_size"]))
    for kind, segs in by.items():
        segs.sort(reverse=True)
        top = ", ".join(f"{t / 2**20:.0f}/{a / 2**20:.0f}" for t, a in segs[:12])
        print(f"    {kind}: {len(segs)} segments; largest (MiB total/allocated): {top}", flush=True)


def live_blocks(top: int = 25) -> None:
    """The largest live blocks with the innermost frames outside torch that allocated them."""
    blocks = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                frames = [f for f in b.get("frames", []) if f["filename"].endswith(".py")
                          and "/torch/" not in f["filename"]][:3]
                where = " < ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in frames)
                blocks.append((b["size"], pool_of(seg), where or "(no python frame)"))
    blocks.sort(reverse=True)
    print(f"    live blocks: {len(blocks)}, {sum(b[0] for b in blocks) / 2**20:.1f} MiB", flush=True)
    for size, pool, where in blocks[:top]:
        print(f"      {size / 2**20:8.2f} MiB {pool:7s} {where}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
