"""Diagnostic: is automp's peak memory above the anchor's its own, or left over from the mode before it?

The zoo runs its modes in one process, one after another, and `peak_gib` is the device's maximum allocated memory
over the timed steps: whatever an earlier mode left allocated counts in the next mode's peak. EfficientNet-B0 read
3.514 GiB under automp against the anchor's 3.509 in two H100 runs. This runs the anchor, automp and the anchor
again as `automp bench zoo` does (gc, Dynamo reset and empty_cache between them), prints what was still allocated
before each mode and each mode's peak, and lists the largest blocks still alive after each mode with the Python
frames that allocated them (torch.cuda.memory history).

    python scripts/peak_residue.py effnet [steps]
"""
import gc
import sys

import torch

from automp.bench.suites import zoo

MIB = 2 ** 20


def residue(label, before):
    """The blocks allocated since `before` bytes were and still alive, largest first, with their allocating frames."""
    now = torch.cuda.memory_allocated()
    print(f"  after {label}: {now / MIB:.1f} MiB allocated ({(now - before) / MIB:+.1f} MiB)", flush=True)
    if now <= before:
        return
    blocks = []
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                frames = [f for f in b.get("frames", []) if f.get("filename", "").endswith(".py")]
                where = " <- ".join(f"{f['filename'].rsplit('/', 2)[-1]}:{f['line']}:{f['name']}" for f in frames[:5])
                blocks.append((b["size"], where))
    for size, where in sorted(blocks, reverse=True)[:8]:
        print(f"    {size / MIB:8.2f} MiB  {where}", flush=True)


def main(name, steps="10"):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.cuda.memory._record_memory_history(max_entries=200000)
    for mode in (zoo.ANCHOR, "automp-bf16", zoo.ANCHOR):
        before = torch.cuda.memory_allocated()
        print(f"{mode}: {before / MIB:.1f} MiB allocated before it", flush=True)
        row = zoo.run_mode(name, mode, False, "cuda", int(steps), 3, 200, 280)
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        print(f"  {mode}: peak {row['peak_gib']} GiB, {row['step_ms']} ms/step, paths {row.get('paths')}"
              f"{' error ' + row['error'] if row.get('error') else ''}", flush=True)
        residue(mode, before)


if __name__ == "__main__":
    main(*sys.argv[1:])
