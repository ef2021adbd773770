"""The "shm" segment leaves nothing behind: a rank killed (SIGKILL, or os._exit) in the middle of
an shm allreduce, under mpiexec, and the job's processes end with no /dev/shm entry of ours;
while the job ran, every rank mapped rank 0's anonymous memory file (memfd), named nowhere.  A
rank killed during the setup itself (between rank 0's create and the others' open) leaves
nothing either; the named fallback works, forced (AL_SHM_NAMED=1, where such a death leaves the
name: what the memory file avoids) and taken because the peers may not open rank 0's fd."""
import os
import re
import shutil
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
                 if "al_shm_" in line})
print(f"rank {c.rank} pid {os.getpid()} mapped {mapped}", flush=True)
MPI.COMM_WORLD.Barrier()
while True:
    if c.rank == 1:
        req = c.Iallreduce(x, algorithm="shm")    # the engine runs it
        while req._op.describe().endswith(": new"):   # until the engine starts it (a loaded
            pass                                      # machine can take milliseconds)
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


RANDOM = "[0-9a-f]{16}"     # the named fallback's random suffix (nobody can pre-create it)


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
        # every rank mapped rank 0's memory file (never named: the kernel says "(deleted)")
        assert re.fullmatch(rf"\['/memfd:al_shm_{pid0}_1 \(deleted\)'\]", mapped), (rank, out)
    for rank, (pid, _) in maps.items():
        assert not os.path.exists(f"/proc/{pid}"), f"rank {rank} (pid {pid}) still runs"
    # (other jobs on the machine may create and remove their own segments meanwhile)
    left = ours() - before
    assert not [n for n in left for pid, _ in maps.values() if n.startswith(f"al_shm_{pid}_")], left


SETUP = r"""
import ctypes, os, sys
import numpy as np
from mpi4py import MPI
print(f"rank {MPI.COMM_WORLD.rank} pid {os.getpid()}", flush=True)
if sys.argv[1:] == ["no-proc"]:                    # the peers may not open rank 0's fds
    libc = ctypes.CDLL(None, use_errno=True)
    if MPI.COMM_WORLD.rank == 0:                   # /proc/<pid>/fd then needs CAP_SYS_PTRACE
        assert libc.prctl(4, 0, 0, 0, 0) == 0      # PR_SET_DUMPABLE, 0
    else:                                          # which a peer drops (if it has it: root)
        hdr = (ctypes.c_uint32 * 2)(0x20080522, 0) # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()
        assert libc.capget(hdr, data) == 0, ctypes.get_errno()
        data[0] &= ~(1 << 19)                      # effective CAP_SYS_PTRACE
        assert libc.capset(hdr, data) == 0, ctypes.get_errno()
if sys.argv[1:] == ["planted"] and MPI.COMM_WORLD.rank == 0:   # the names of old, taken
    planted = [f"/dev/shm/al_shm_{os.getpid()}_{n}" for n in (1, 2)]
    for path in planted:
        open(path, "x").close()
import aluminum_py as al
c = al.Communicator()                              # the segment's setup
x = np.arange(1000, dtype=np.float64) * (c.rank + 1)
y = np.empty_like(x)
c.Allreduce(x, y, algorithm="shm")
assert np.array_equal(y, np.arange(1000, dtype=np.float64) * sum(range(1, c.size + 1)))
mapped = sorted({line.split(None, 5)[5].strip() for line in open("/proc/self/maps")
                 if "al_shm_" in line})
print(f"rank {c.rank} ok mapped {mapped}", flush=True)
if sys.argv[1:] == ["planted"] and c.rank == 0:
    for path in planted:
        os.unlink(path)
"""


def run_setup(tmp_path, n, *args, rank0=(), **env):
    """SETUP at `n` ranks; `rank0`: words before rank 0's command only (MPMD: rank 0 is the
    first block)."""
    script = tmp_path / "setup.py"
    script.write_text(SETUP)
    env = dict(os.environ, AL_HANG_TIMEOUT="30", PYTHONUNBUFFERED="1", **env)
    cmd = [sys.executable, str(script), *args]
    if rank0:
        cmd = ["-n", "1", *rank0, *cmd, ":", "-n", str(n - 1), *cmd]
    else:
        cmd = ["-n", str(n), *cmd]
    proc = subprocess.run([mpiexec(), *cmd], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    pids = {int(r): int(p) for r, p in re.findall(r"rank (\d) pid (\d+)", proc.stdout)}
    return proc, pids


def left_by(pids, before):
    return sorted(n for n in ours() - before for pid in pids.values()
                  if n.startswith(f"al_shm_{pid}_"))


@pytest.mark.parametrize("die", [0, 1])
def test_rank_killed_in_setup_leaves_no_segment(tmp_path, die):
    # AL_SHM_TEST_DIE_IN_SETUP (a testing aid, ext/core/shm.pxi): rank 0 exits right after it
    # created the segment, rank 1 after it learnt where the segment is, before opening it
    before = ours()
    proc, pids = run_setup(tmp_path, 3, AL_SHM_TEST_DIE_IN_SETUP=str(die))
    assert proc.returncode != 0 and " ok mapped " not in proc.stdout, proc.stdout
    assert sorted(pids) == [0, 1, 2], proc.stdout
    assert left_by(pids, before) == [], proc.stdout


def test_named_fallback(tmp_path):
    # AL_SHM_NAMED=1: a named /dev/shm object, unlinked once every rank mapped it
    before = ours()
    proc, pids = run_setup(tmp_path, 2, AL_SHM_NAMED="1")
    assert proc.returncode == 0, proc.stdout
    for rank in (0, 1):
        assert re.search(rf"rank {rank} ok mapped \['/dev/shm/al_shm_{pids[0]}_1_{RANDOM} \(deleted\)'\]",
                         proc.stdout), proc.stdout
    assert left_by(pids, before) == [], proc.stdout
    # ... where a rank killed during the setup leaves the name (what the memory file avoids:
    # this checks that the test above can see a leak)
    proc, pids = run_setup(tmp_path, 2, AL_SHM_NAMED="1", AL_SHM_TEST_DIE_IN_SETUP="1")
    left = left_by(pids, before)
    for n in left:
        os.unlink(f"/dev/shm/{n}")
    assert proc.returncode != 0, proc.stdout
    assert len(left) == 1 and re.fullmatch(rf"al_shm_{pids[0]}_1_{RANDOM}", left[0]), proc.stdout


def test_named_fallback_name_cannot_be_taken_in_advance(tmp_path):
    # another user's process created /dev/shm/al_shm_<rank 0's pid>_1 (and _2) first: the name
    # has a random part, so the segment is still made (O_EXCL) and "shm" works
    before = ours()
    proc, pids = run_setup(tmp_path, 2, "planted", AL_SHM_NAMED="1")
    assert proc.returncode == 0, proc.stdout
    for rank in (0, 1):
        assert re.search(rf"rank {rank} ok mapped \['/dev/shm/al_shm_{pids[0]}_1_{RANDOM} "
                         rf"\(deleted\)'\]", proc.stdout), proc.stdout
    assert left_by(pids, before) == [], proc.stdout


def test_named_fallback_when_proc_refuses(tmp_path):
    # the peers get EACCES on /proc/<rank 0's pid>/fd/<fd>: the whole communicator takes the
    # named path (the second segment rank 0 made) and the allreduce is right
    before = ours()
    proc, pids = run_setup(tmp_path, 3, "no-proc")
    assert proc.returncode == 0, proc.stdout
    for rank in (0, 1, 2):
        assert re.search(rf"rank {rank} ok mapped \['/dev/shm/al_shm_{pids[0]}_2_{RANDOM} \(deleted\)'\]",
                         proc.stdout), proc.stdout
    assert left_by(pids, before) == [], proc.stdout


# An LD_PRELOAD library that makes libc's syscall(SYS_memfd_create, ...) (how al_shm.h calls
# memfd_create) fail with ENOSYS, as on a kernel without it; every other syscall goes through.
NO_MEMFD = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>
#include <unistd.h>

long syscall(long number, ...) {
  static long (*real)(long, ...);
  long a[6];
  va_list ap;
  int i;
  if (number == SYS_memfd_create) {
    static const char said[] = "no_memfd shim: memfd_create -> ENOSYS\n";
    (void)!write(2, said, sizeof(said) - 1);
    errno = ENOSYS;
    return -1;
  }
  if (real == NULL)
    real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  va_start(ap, number);
  for (i = 0; i < 6; i++)
    a[i] = va_arg(ap, long);
  va_end(ap);
  return real(number, a[0], a[1], a[2], a[3], a[4], a[5]);
}
"""


def no_memfd_library(tmp_path) -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler for the LD_PRELOAD library")
    src, lib = tmp_path / "no_memfd.c", tmp_path / "no_memfd.so"
    src.write_text(NO_MEMFD)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl"], check=True)
    return str(lib)


def test_named_fallback_without_memfd_create(tmp_path):
    # rank 0's memfd_create fails with ENOSYS (the library above, preloaded in rank 0 only):
    # rank 0 makes the named segment at once, every rank maps it, the allreduce is right, the
    # name is gone
    lib = no_memfd_library(tmp_path)
    before = ours()
    proc, pids = run_setup(tmp_path, 3, rank0=("env", f"LD_PRELOAD={lib}"))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count("no_memfd shim: memfd_create -> ENOSYS") == 1, proc.stdout
    for rank in (0, 1, 2):
        assert re.search(rf"rank {rank} ok mapped \['/dev/shm/al_shm_{pids[0]}_1_{RANDOM} \(deleted\)'\]",
                         proc.stdout), proc.stdout
    assert left_by(pids, before) == [], proc.stdout
