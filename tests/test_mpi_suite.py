"""Run the multi-rank suite (tests/mpi) under mpiexec at 1, 2, 3 and 4 ranks, and its
allreduce matrix again at 6 ranks (oversubscribed, the engine yielding).

Each rank runs the same pytest session; a hang is caught by pytest-timeout inside the ranks and
by the subprocess timeout here.  Set AL_TEST_RANKS=2,4 to choose rank counts, AL_MPIEXEC and
AL_MPIEXEC_ARGS to choose the launcher (tests/openmpi/run.sh: Open MPI's, with --oversubscribe).
"""
import os
import shlex
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = [int(n) for n in os.environ.get("AL_TEST_RANKS", "1,2,3,4").split(",") if n]


def mpiexec() -> str:
    """$AL_MPIEXEC (e.g. Open MPI's mpiexec), else the mpiexec next to this Python (the `mpich`
    wheel's), else the one on PATH."""
    exe = (os.environ.get("AL_MPIEXEC")
           or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
           or shutil.which("mpiexec"))
    if exe is None:
        pytest.fail("mpiexec not found (pip install mpich, or set AL_MPIEXEC)")
    return exe


def launcher() -> list:
    """:func:`mpiexec` followed by the words of $AL_MPIEXEC_ARGS (e.g. ``--oversubscribe`` for
    Open MPI on a machine with fewer cores than ranks)."""
    return [mpiexec()] + shlex.split(os.environ.get("AL_MPIEXEC_ARGS", ""))


@pytest.mark.parametrize("nranks", RANKS)
def test_mpi_suite(nranks):
    env = dict(os.environ, AL_TEST_INNER="1", PYTHONUNBUFFERED="1")
    cmd = [*launcher(), "-n", str(nranks), sys.executable, "-m", "pytest", os.path.join(HERE, "mpi"),
           "--with-mpi", "-q", "-x", "-p", "no:cacheprovider", "--timeout=300", "-o", "console_output_style=classic"]
    extra = os.environ.get("AL_TEST_ARGS")
    if extra:
        cmd += extra.split()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1500)
    out = proc.stdout
    print(out[-20000:])
    assert proc.returncode == 0, f"multi-rank suite failed at {nranks} ranks:\n{out[-8000:]}"


def test_allreduce_at_six_ranks_oversubscribed():
    """The allreduce matrix (every algorithm x dtype x op x size, in and out of place, blocking
    and nonblocking) and the bit-identity checks at 6 ranks: not a power of two (recursive
    doubling and Rabenseifner fold two ranks in, ring blocks are uneven), more ranks than the
    1-4 runs, and (on this 2-core machine) oversubscribed, with the progress engine yielding
    after idle polls (AL_ENGINE_YIELD=1, set here so it holds on any machine)."""
    env = dict(os.environ, AL_TEST_INNER="1", PYTHONUNBUFFERED="1", AL_ENGINE_YIELD="1")
    cmd = [*launcher(), "-n", "6", sys.executable, "-m", "pytest",
           os.path.join(HERE, "mpi", "test_allreduce.py"), "-k", "matrix or identical or nan",
           "--with-mpi", "-q", "-x", "-p", "no:cacheprovider", "--timeout=600",
           "--timeout-method=thread", "-o", "console_output_style=classic"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    print(proc.stdout[-20000:])
    assert proc.returncode == 0, f"allreduce at 6 ranks failed:\n{proc.stdout[-8000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_gpu_control_traffic_order_with_nonblocking_mpich_bcast():
    """tests/mpi/test_gpu_backend_cpu.py's control-communicator test at 2 ranks with MPICH's
    bcast run as a nonblocking schedule (and no device collectives): MPICH then matches the
    GPU backend's control bcast against collectives the engine has pending, so control traffic
    on the collective communicator hangs here; on the private control communicator it passes."""
    from mpi4py import MPI
    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("the CVARs that expose the ordering are MPICH's")
    env = dict(os.environ, AL_TEST_INNER="1", PYTHONUNBUFFERED="1",
               MPIR_CVAR_DEVICE_COLLECTIVES="none", MPIR_CVAR_BCAST_INTRA_ALGORITHM="nb")
    cmd = [*launcher(), "-n", "2", sys.executable, "-m", "pytest",
           os.path.join(HERE, "mpi", "test_gpu_backend_cpu.py"), "-k", "control", "--with-mpi",
           "-q", "-p", "no:cacheprovider", "--timeout=60"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-6000:]


@pytest.mark.parametrize("nranks", [n for n in RANKS if n <= 2] or [1])
def test_cuda_standin_suite(nranks):
    """tests/standin: the CUDA implementation of the device interface (the code that runs on a
    GPU) against the CUDA driver stand-in, under mpiexec, with AL_CUDA_LIBRARY set."""
    from aluminum_py.testing import cuda_standin
    env = dict(os.environ, AL_TEST_INNER="1", PYTHONUNBUFFERED="1",
               AL_CUDA_LIBRARY=cuda_standin.path(), AL_STANDIN_DRIVER_LOCK="1")
    cmd = [*launcher(), "-n", str(nranks), sys.executable, "-m", "pytest",
           os.path.join(HERE, "standin"), "--with-mpi", "-q", "-x", "-p", "no:cacheprovider",
           "--timeout=300", "--timeout-method=thread", "-o", "console_output_style=classic"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=900)
    print(proc.stdout[-20000:])
    assert proc.returncode == 0, f"stand-in suite failed at {nranks} ranks:\n{proc.stdout[-8000:]}"


@pytest.mark.parametrize("nranks", [n for n in RANKS if n in (1, 2, 4)] or [1])
def test_gpu_suite_on_standins(nranks):
    """The GPU suite (tests/gpu: every collective x op x NCCL dtype, blocking and nonblocking,
    every GPU algorithm, written for CuPy) and tests/standin/test_nccl_path.py (what reaches
    NCCL: launch records, thread limits, nonblocking communicators) on the CUDA and NCCL
    stand-ins, with the CuPy stand-in as ``cupy`` (-p aluminum_py.testing.pytest_standins).
    Four ranks run the NCCL-path file and the allreduce tests only: oversubscribed on two
    cores, the whole suite takes minutes there."""
    from aluminum_py.testing import cuda_standin
    path = cuda_standin.path()
    env = dict(os.environ, AL_TEST_INNER="1", PYTHONUNBUFFERED="1", AL_CUDA_LIBRARY=path,
               AL_NCCL_LIBRARY=path, AL_STANDIN_DRIVER_LOCK="1")
    cmd = [*launcher(), "-n", str(nranks), sys.executable, "-m", "pytest",
           "-p", "aluminum_py.testing.pytest_standins", os.path.join(HERE, "gpu"),
           os.path.join(HERE, "standin", "test_nccl_path.py"),
           os.path.join(HERE, "standin", "test_nccl_api.py"), "--with-mpi", "-q", "-x",
           "-p", "no:cacheprovider", "--timeout=300", "--timeout-method=thread",
           "-o", "console_output_style=classic"]
    if nranks > 2:
        cmd += ["-k", "test_nccl_path or test_nccl_api or test_allreduce_blocking_and_nonblocking or "
                      "(test_allreduce and float32)"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=1200)
    print(proc.stdout[-20000:])
    assert proc.returncode == 0, f"GPU suite on the stand-ins failed at {nranks} ranks:\n{proc.stdout[-8000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout
