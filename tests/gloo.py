"""Two-process torch.distributed tests on the CPU (gloo over the loopback interface): a free port, a worker's join,
the spawn that runs `worker(rank, port, out, *args)` on every rank and loads what each rank saved as `<rank>.pt`, and
`cpu_host`, which has a test run as on a machine without CUDA wherever it runs."""
import os
import random
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A free port for a job's TCP store, below the kernel's ephemeral range. A port the kernel handed out (bind to
    port 0) and this function closed again can be handed to the next socket bound to port 0 before rank 0 binds it:
    gloo's listeners are such sockets, and a rank of one test connecting to another test's gloo listener can abort
    that process (gloo throws when a peer connects and leaves before its handshake, pytorch/gloo#514). No process
    binds below the ephemeral range by itself."""
    lo, _ = _ephemeral_range()
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(max(1024, lo - 20000), lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def join(rank: int, port: int, timeout_s: float = 60, world_size: int = 2) -> None:
    """In a worker: join the job's gloo process group (a hung peer fails the test after timeout_s, not never)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size,
                                         timeout=timedelta(seconds=timeout_s))


def cpu_host(monkeypatch) -> None:
    """This test as on a CPU-only host, on a GPU host too: code deciding in this process sees no CUDA, and processes
    started from it (torchrun, spawned ranks) get CUDA_VISIBLE_DEVICES="" (they decide for themselves, e.g. NCCL on
    CUDA, and torch.distributed's device meshes default to CUDA where it exists)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def _rank(rank: int, worker, *args) -> None:
    """A spawned rank: the worker, then an exit that skips the interpreter's teardown. A DDP or FSDP module still
    alive there (in a reference cycle, or a local of a frame that outlived destroy_process_group) tears its gloo
    reducer down during interpreter finalization, which aborts the process now and then (SIGABRT, "terminate called
    without an active exception", torch 2.13 on the CPU). A worker that raises exits through mp.spawn as usual."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker, out: Path, *args, nprocs: int = 2) -> list:
    """Run worker(rank, port, str(out), *args) in `nprocs` processes; each rank's torch.save'd `<out>/<rank>.pt`.
    The ranks see no CUDA device: they are gloo ranks on the CPU, also on a GPU host."""
    import torch.multiprocessing as mp
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU (gloo) test: the spawned ranks inherit it and see no GPU
    try:
        mp.spawn(_rank, args=(worker, free_port(), str(out), *args), nprocs=nprocs, join=True)
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    return [torch.load(Path(out) / f"{rank}.pt") for rank in range(nprocs)]
