"""Two-process torch.distributed tests on the CPU (gloo over the loopback interface): a free port, a worker's join,
the spawn that runs `worker(rank, port, out, *args)` on every rank and loads what each rank saved as `<rank>.pt`, and
`cpu_host`, which has a test run as on a machine without CUDA wherever it runs."""
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def spawn(worker, out: Path, *args, nprocs: int = 2) -> list:
    """Run worker(rank, port, str(out), *args) in `nprocs` processes; each rank's torch.save'd `<out>/<rank>.pt`.
    The ranks see no CUDA device: they are gloo ranks on the CPU, also on a GPU host."""
    import torch.multiprocessing as mp
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU (gloo) test: the spawned ranks inherit it and see no GPU
    try:
        mp.spawn(worker, args=(free_port(), str(out), *args), nprocs=nprocs, join=True)
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    return [torch.load(Path(out) / f"{rank}.pt") for rank in range(nprocs)]
