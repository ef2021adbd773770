"""The "shm" segment leaves nothing behind: a rank killed (SIGKILL, or os._exit) in the middle of
an shm allreduce, under mpiexec, and the job's processes end with no /dev/shm entry of ours;
while the job ran, every rank mapped the segment and /dev/shm no longer named it."""
import os
import re
import subprocess
import sys

import pytest

from test_mpi_suite import mpiexec

SCRIPT = r'''
import os, signal, sys, time
import numpy as np
import aluminum_py as al
from mpi4py import MPI

how = sys.argv[1]
c = al.Communicator()
x = np.ones(16 << 20, np.float32)                 # 64 MiB: 64 chunks of the 1 MiB slot
c.Allreduce(x[:1000], algorithm="shm")            # the segment exists from here on
mapped = sorted({line.split(None, 5)[5].strip() for line in open("/proc/self/maps")
                 if "/al_shm_" in line})
print(f"rank {c.rank} pid {os.getpid()} mapped {mapped}", flush=True)
MPI.COMM_WORLD.Barrier()
while True:
    if c.rank == 1:
        req = c.Iallreduce(x, algorithm="shm")    # the engine runs it
        time.sleep(0.002)
        if not req.done:                          # mid-operation
            print(f"rank 1 dies mid-operation ({req._op.describe()})", flush=True)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        req.Wait()
    else:
        c.Allreduce(x, algorithm="shm")
'''


def ours():
    return {n for n in os.listdir("/dev/shm") if n.startswith("al_shm_")}


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_killed_rank_leaves_no_segment(tmp_path, how):
    script = tmp_path / "die.py"
    script.write_text(SCRIPT)
    before = ours()
    env = dict(os.environ, AL_HANG_TIMEOUT="30", PYTHONUNBUFFERED="1")
    proc = subprocess.run([mpiexec(), "-n", "3", sys.executable, str(script), how], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode != 0, out
    assert "rank 1 dies mid-operation (allreduce/shm: split protocol" in out, out
    maps = dict((int(r), (int(p), m)) for r, p, m in
                re.findall(r"rank (\d) pid (\d+) mapped (\[[^]]*\])", out))
    assert sorted(maps) == [0, 1, 2], out
    pid0 = maps[0][0]
    for rank, (pid, mapped) in maps.items():
        # every rank mapped rank 0's segment, already unlinked (the kernel says "(deleted)")
        assert re.fullmatch(rf"\['/dev/shm/al_shm_{pid0}_1 \(deleted\)'\]", mapped), (rank, out)
    for rank, (pid, _) in maps.items():
        assert not os.path.exists(f"/proc/{pid}"), f"rank {rank} (pid {pid}) still runs"
    # (other jobs on the machine may create and remove their own segments meanwhile)
    left = ours() - before
    assert not [n for n in left for pid, _ in maps.values() if n.startswith(f"al_shm_{pid}_")], left
