"""A failed rank stops the other ranks of its job, also where no launcher agent does it.

torchrun's agent ends every worker once one fails. Ranks started otherwise (`srun python -m automp run ...`, an MPI
launcher, a notebook per rank) get no such help: when one raises, the others wait in their next collective until the
process group's timeout (10 to 30 minutes), or for ever in a loop that never reaches one. So `automp run` watches the
job's store, the key-value store every rank already shares through `init_process_group`: a rank whose script raises
(or exits non-zero) writes why under FAILED and waits a few polls before it exits, and every other rank checks that
key once per `poll` seconds from a daemon thread, then prints who failed and why and exits with code 1. Nothing is
written or read before the script has initialized torch.distributed, and a store that goes away at the end of a good
run (rank 0 hosts it) ends the watch quietly.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

from automp.world import distributed

FAILED = "automp/failed"
EXIT_CODE = 1
LINGER = 3  # polls a failing rank waits after writing FAILED, so that the store outlives the others' next check


def _store():
    """The default process group's store, or None outside torch.distributed (or once it is gone)."""
    if not distributed():
        return None
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()


class RankWatch:
    """One per `automp run` process; `exit` and `err` are injectable for tests."""

    def __init__(self, rank: int, poll: float = 1.0, exit: Callable[[int], None] = os._exit,
                 err: TextIO | None = None) -> None:
        self.rank, self.poll, self._exit, self._err = rank, poll, exit, err
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RankWatch:
        self._thread = threading.Thread(target=self._watch, name="automp-rank-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()

    def failed(self, why: str) -> None:
        """This rank is ending in failure: tell the others (a no-op outside torch.distributed)."""
        self._done.set()  # its own message is the script's traceback, not the watch's
        try:
            store = _store()
            if store is not None:
                store.set(FAILED, f"rank {self.rank} failed: {why}")
                # rank 0's process hosts the store: it stays up until every other rank's next check has read it
                time.sleep(LINGER * self.poll)
        except Exception:  # noqa: BLE001 - the store itself may be what broke; the failure is reported anyway
            pass

    def _watch(self) -> None:
        while not self._done.wait(self.poll):
            try:
                store = _store()
                if store is None or not store.check([FAILED]):
                    continue
                why = store.get(FAILED).decode(errors="replace")
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending without this rank's help
                return
            if self._done.is_set():
                return
            print(f"automp (rank {self.rank}): stopping, as another rank of this job ended: {why}",
                  file=self._err or sys.stderr, flush=True)
            self._exit(EXIT_CODE)
            return
