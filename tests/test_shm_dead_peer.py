"""A peer that dies in the middle of an "shm" collective, with the launcher's clean-up off
(MPICH's ``-disable-auto-cleanup``, as a node lost or a launcher that does not kill the job):
every survivor raises aluminum_py.Error naming the dead rank, without AL_HANG_TIMEOUT (unset
here: it would wait forever).  The survivors wait on the dead rank's flag, and a wait looks
every few dozen milliseconds whether that rank's process still exists (ext/shm/segment.h,
"dead peers").  The last rank dies once rank 0's op is pending: a FIFO gates it, no sleep."""
import os
import re
import subprocess
import sys

import pytest

from test_reliability_launch import clean_env, mpiexec

DIES = r'''
import os, sys, time
import numpy as np
import aluminum_py as al
gate, what = sys.argv[1], sys.argv[2]
comm = al.Communicator()
victim = comm.size - 1
n = 4 if what == "small" else 1 << 20                # the symmetric / the split protocol
x = np.ones(n, np.float32)
comm.Allreduce(x.copy(), algorithm="shm")            # the segment works, every rank is up
if comm.rank == victim:
    with open(gate, "rb") as f:                      # until rank 0's op is pending
        f.read(1)
    os._exit(0)
t0 = time.monotonic()
try:
    if what == "bcast":
        req = comm.Ibcast(x, root=0, algorithm="shm")
    else:
        req = comm.Iallreduce(x, algorithm="shm")
    if comm.rank == 0:
        with open(gate, "wb") as f:
            f.write(b"x")
    req.Wait()
    print(f"RESULT rank {comm.rank}: completed", flush=True)
except al.TimeoutError as e:
    print(f"RESULT rank {comm.rank}: TimeoutError: {e}", flush=True)
except al.Error as e:
    print(f"RESULT rank {comm.rank}: Error after {time.monotonic() - t0:.2f} s: {e}",
          flush=True)
os._exit(0)                                          # (no MPI_Finalize with a peer gone)
'''

LIMIT = 120         # the test's own bound on the whole job: a survivor left waiting is a hang


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("what", ["small", "large", "bcast"])
def test_survivors_name_the_dead_rank(tmp_path, ranks, what):
    gate = str(tmp_path / "gate")
    os.mkfifo(gate)
    cmd = [mpiexec(), "-disable-auto-cleanup", "-n", str(ranks), sys.executable, "-c", DIES,
           gate, what]
    try:
        proc = subprocess.run(cmd, env=clean_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=LIMIT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"a survivor waited for the dead rank past {LIMIT} s: {e.output!r}"[-4000:])
    out = proc.stdout
    print(out[-3000:])
    victim = ranks - 1
    for r in range(victim):
        # the launcher may join two ranks' lines (one's newline written after the other's text)
        line = [ln for ln in re.split(r"\n|(?=RESULT rank )", out)
                if ln.startswith(f"RESULT rank {r}:")]
        assert line and ": Error after" in line[0] and f"rank {victim} died" in line[0], out[-4000:]
