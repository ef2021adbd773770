"""Reliability cases that need their own launch (issue 16), each in a fresh subprocess:

* the soak test (tests/mpi/test_reliability.py::test_soak) at 2 ranks for AL_SOAK_SECONDS
  (default 20): its figures (ops/s, memory and fd growth) are printed;
* a dying peer: one rank is SIGKILLed in the middle of a large nonblocking allreduce, or of a
  blocking one; the survivor gets al.TimeoutError within AL_HANG_TIMEOUT or al.MPIError, or is
  ended by the launcher, and the job never outlives the test's timeout;
* Communicator() warns below MPI_THREAD_MULTIPLE (ThreadLevelWarning), not at "multiple".
"""
import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def mpiexec() -> str:
    exe = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if exe is None:
        pytest.skip("mpiexec not found (pip install mpich)")
    return exe


def clean_env(**extra):
    """The environment without an enclosing launcher's variables and AL_HANG_TIMEOUT."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPI_LOCALRANKID",
                                "MPI_LOCALNRANKS", "OMPI_")) and k != "AL_HANG_TIMEOUT"}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def run(cmd, timeout, **env):
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=clean_env(**env), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc, time.monotonic() - t0


def test_soak_two_ranks():
    seconds = os.environ.get("AL_SOAK_SECONDS", "20")
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "pytest",
           os.path.join(HERE, "mpi", "test_reliability.py"), "-k", "soak", "--with-mpi", "-q",
           "-s", "-p", "no:cacheprovider", "--timeout=300"]
    proc, _ = run(cmd, 600, AL_TEST_INNER="1", AL_SOAK_SECONDS=seconds)
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("soak rank")))
    assert proc.returncode == 0, proc.stdout[-8000:]
    assert "soak rank 0" in proc.stdout, proc.stdout[-4000:]


DYING = r'''
import os, signal, sys, time
import numpy as np
import aluminum_py as al
comm = al.Communicator()
mode = sys.argv[1]
x = np.ones(16 << 20, dtype=np.float32)            # 64 MiB
comm.Allreduce(np.ones(4, np.float32))             # both ranks are up
t0 = time.monotonic()
if comm.rank == 1:
    req = comm.Iallreduce(x, algorithm="ring")
    while req._op.describe().endswith(": new"):    # until the engine starts it: a 64 MiB
        pass                                       # step cannot be done microseconds later
    os.kill(os.getpid(), signal.SIGKILL)
try:
    if mode == "nonblocking":
        comm.Iallreduce(x, algorithm="ring").Wait()
    else:
        comm.Allreduce(x, algorithm="ring")
    print(f"RESULT rank {comm.rank}: completed", flush=True)
except al.TimeoutError as e:
    print(f"RESULT rank {comm.rank}: TimeoutError after {time.monotonic() - t0:.1f} s: {e}",
          flush=True)
    os._exit(3)
except al.Error as e:
    print(f"RESULT rank {comm.rank}: {type(e).__name__}: {e}", flush=True)
    os._exit(4)
'''

HANG = 5.0          # AL_HANG_TIMEOUT of the dying-peer runs
# What the survivor may raise: al.TimeoutError (AL_HANG_TIMEOUT ran out waiting for the dead
# rank), or al.MPIError when MPI itself reports the failure first (e.g. MPICH's shared-memory
# transfer failing with "process_vm_readv failed (errno 3)": the peer's process is gone).
SURVIVOR_ERRORS = ("TimeoutError", "MPIError")
LIMIT = 300         # the test's own bound on the whole job: a hang guard (a busy machine
                    # takes tens of seconds to start two ranks)


@pytest.mark.parametrize("mode", ["nonblocking", "blocking"])
def test_dying_peer(mode):
    """Rank 1 is SIGKILLed as its 64 MiB ring allreduce starts (its own runs in its
    engine; rank 0's is nonblocking or blocking). The job ends well within
    LIMIT: either rank 0 raised a clear error (al.TimeoutError after about AL_HANG_TIMEOUT, or
    al.MPIError from MPI), or the launcher (MPICH's hydra) ended it on seeing a rank die,
    reporting the signal. Never a hang, never a completed call."""
    try:
        proc, took = run([mpiexec(), "-n", "2", sys.executable, "-c", DYING, mode], LIMIT,
                         AL_HANG_TIMEOUT=str(HANG))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the job outlived {LIMIT} s (a hang): {e.output!r}"[-4000:])
    out = proc.stdout
    print(f"\n[{mode}] exit status {proc.returncode} after {took:.1f} s; output:\n{out[-3000:]}")
    assert proc.returncode != 0, out[-4000:]           # a rank died: the job failed
    survivor_raised = any(f"RESULT rank 0: {name}: " in out for name in SURVIVOR_ERRORS)
    launcher_ended = "KILLED BY SIGNAL: 9" in out or "BAD TERMINATION" in out
    assert survivor_raised or launcher_ended, out[-4000:]
    assert "RESULT rank 0: completed" not in out, out[-4000:]


THREAD_LEVEL = r'''
import sys, warnings
import mpi4py
mpi4py.rc.thread_level = sys.argv[1]
import aluminum_py as al
from aluminum_py.errors import ThreadLevelWarning
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    comm = al.Communicator()
msgs = [str(x.message) for x in w if issubclass(x.category, ThreadLevelWarning)]
print("RESULT", repr(msgs))
'''


@pytest.mark.parametrize("level", ["serialized", "multiple"])
def test_thread_level_warning(level):
    """Below MPI_THREAD_MULTIPLE, Communicator() warns, naming the level provided and what
    will fail; at "multiple" (mpi4py's default) it does not."""
    proc, _ = run([sys.executable, "-c", THREAD_LEVEL, level], 120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][0]
    msgs = eval(line[len("RESULT "):])                  # a list of str, printed with repr
    if level == "multiple":
        assert msgs == []
    else:
        assert len(msgs) == 1 and "MPI_THREAD_SERIALIZED" in msgs[0] \
            and "nonblocking" in msgs[0], msgs
