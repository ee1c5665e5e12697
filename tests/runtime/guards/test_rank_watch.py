"""Ranks started without torchrun's agent (as `srun python -m automp run ...` starts them, here two processes with
RANK / WORLD_SIZE set, gloo): a rank that raises stops the others within seconds, with a message naming it, even where
they are busy outside any collective and would otherwise run on (or wait for ever)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from automp.runtime.guards.rank_watch import RankWatch
from tests import gloo

SRC = str(Path(__file__).resolve().parents[2] / "src")
SCRIPT = '''
import sys, time, torch, torch.distributed as dist
failing = int(sys.argv[1])
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == failing:
    raise RuntimeError("rank failed on purpose")
end = time.time() + 120  # busy outside any collective: no gloo error will ever reach it
while time.time() < end:
    time.sleep(0.05)
print("ran to the end")
'''


@pytest.mark.ranks
@pytest.mark.skipif(sys.platform != "linux", reason="gloo on the loopback interface")
@pytest.mark.parametrize("failing", [0, 1])  # rank 0 hosts the store: its failure must still reach rank 1
def test_a_failing_rank_stops_the_others(tmp_path, failing):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    port = gloo.free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", AUTOMP_CACHE_DIR=str(tmp_path / "cache"),
                   CUDA_VISIBLE_DEVICES="")  # CPU (gloo) ranks, also on a GPU host: automp in them sees no GPU either
        procs.append(subprocess.Popen([sys.executable, "-m", "automp", "run", "--dtype", "bf16", "--path", "eager",
                                       str(script), str(failing)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    t0 = time.perf_counter()
    outs = [p.communicate(timeout=150) for p in procs]
    seconds = time.perf_counter() - t0
    other = 1 - failing
    assert procs[failing].returncode == 1 and "rank failed on purpose" in outs[failing][1]
    assert procs[other].returncode == 1, outs[other]
    assert f"another rank of this job ended: rank {failing} failed: RuntimeError: rank failed on purpose" \
        in outs[other][1]
    assert "ran to the end" not in outs[other][0]
    assert seconds < 60  # not the 120 s the busy rank would run on


def test_the_watch_is_quiet_outside_torch_distributed():
    exits = []
    watch = RankWatch(0, poll=0.01, exit=exits.append).start()
    watch.failed("nothing to tell")  # no process group: nothing written, nothing raised
    time.sleep(0.05)
    watch.stop()
    assert exits == []
