"""Two-process torch.distributed tests on the CPU (gloo over the loopback interface): a free port, a worker's join,
and the spawn that runs `worker(rank, port, out, *args)` on every rank and loads what each rank saved as `<rank>.pt`."""
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


def spawn(worker, out: Path, *args, nprocs: int = 2) -> list:
    """Run worker(rank, port, str(out), *args) in `nprocs` processes; each rank's torch.save'd `<out>/<rank>.pt`."""
    import torch.multiprocessing as mp
    mp.spawn(worker, args=(free_port(), str(out), *args), nprocs=nprocs, join=True)
    return [torch.load(Path(out) / f"{rank}.pt") for rank in range(nprocs)]
