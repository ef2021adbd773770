"""Run the multi-rank suite (tests/mpi) under mpiexec at 1, 2, 3 and 4 ranks, and its
allreduce matrix again at 6 ranks (oversubscribed, the engine yielding).  Above FULL_RANKS
ranks only the tests marked ``layout`` run: those of how data moves between ranks, whose code
path changes with the count (recursive doubling's steps, ring blocks, shm slots, hierarchical
splits); the rest (lifecycle, errors, progress, the torch and GPU glue) see nothing at 4
ranks that 2 and 3 have not shown.

Each rank runs the same pytest session; a hang is caught by pytest-timeout inside the ranks and
by the subprocess timeout here (HANG); both are hang guards, far above what a busy machine
needs.  Tests marked ``local`` (they never communicate through the library: argument checks,
names) run at one rank count only, LOCAL_RANKS (tests/conftest.py deselects them at the
others).  Set AL_TEST_RANKS=2,4 to choose rank counts, AL_MPIEXEC and
AL_MPIEXEC_ARGS to choose the launcher (tests/openmpi/run.sh: Open MPI's, with --oversubscribe),
AL_TEST_ARGS to pass arguments to every suite launched here (a suite it selects nothing in is
skipped).  docs/testing.md describes the layout.
"""
import os
import shlex
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = [int(n) for n in os.environ.get("AL_TEST_RANKS", "1,2,3,4").split(",") if n]
# the rank count that runs the tests marked `local`: the smallest with peers (a check of
# arguments that only exist with two ranks, such as a root that is another rank, runs there)
LOCAL_RANKS = min((n for n in RANKS if n >= 2), default=max(RANKS, default=1))
# the largest rank count that runs every test; larger ones run the `layout` tests only
FULL_RANKS = 3
HANG = 3600         # seconds a launched suite may take before it counts as hung
# every launched suite's pytest options (AL_TEST_ARGS comes after them)
COMMON = ["--with-mpi", "-q", "-p", "no:cacheprovider", "-o", "console_output_style=classic"]


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


SELECTORS = ("-k", "-m")        # pytest options of which only the last one given counts


def merge_args(own: list, extra: list) -> list:
    """`own` (a suite's pytest arguments) followed by `extra` (AL_TEST_ARGS's words), where a
    -k or -m expression in both is joined into one, "(own) and (extra)": pytest keeps only
    the last -k (and -m), so appending would drop the suite's own selection."""
    def split(args):
        rest, sel, i = [], {}, 0
        while i < len(args):
            a = args[i]
            opt = next((o for o in SELECTORS if a == o or a.startswith(o)), None)
            if opt is None:
                rest.append(a)
            elif a == opt:
                if i + 1 == len(args):
                    raise ValueError(f"AL_TEST_ARGS: {opt} needs an expression")
                sel[opt] = args[i + 1]
                i += 1
            else:
                sel[opt] = a[len(opt):].lstrip("=")
            i += 1
        return rest, sel

    rest_own, sel_own = split(own)
    rest_extra, sel_extra = split(extra)
    out = rest_own + rest_extra
    for opt in SELECTORS:
        exprs = [e for e in (sel_own.get(opt), sel_extra.get(opt)) if e]
        if exprs:
            out += [opt, exprs[0] if len(exprs) == 1 else f"({exprs[0]}) and ({exprs[1]})"]
    return out


def suite_env(**extra) -> dict:
    """The environment of a launched suite: this one's, with AL_TEST_INNER (tests/conftest.py
    then collects tests/mpi and tests/standin) and AL_TEST_LOCAL_RANKS."""
    return dict(os.environ, AL_TEST_INNER="1", PYTHONUNBUFFERED="1",
                AL_TEST_LOCAL_RANKS=str(LOCAL_RANKS), **extra)


def run_suite(nranks: int, own: list, env: dict) -> subprocess.CompletedProcess:
    """pytest with arguments `own`, COMMON and AL_TEST_ARGS (merge_args) under the launcher at
    `nranks` ranks; its output is printed (the end of it). A suite that AL_TEST_ARGS selects
    nothing in (pytest's exit status 5) skips the calling test."""
    extra = shlex.split(os.environ.get("AL_TEST_ARGS", ""))
    cmd = [*launcher(), "-n", str(nranks), sys.executable, "-m", "pytest",
           *merge_args(own + COMMON, extra)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=HANG)
    print(proc.stdout[-20000:])
    if extra and proc.returncode == 5:                # pytest: no tests collected
        pytest.skip(f"AL_TEST_ARGS={os.environ['AL_TEST_ARGS']!r} selects nothing in this suite")
    return proc


@pytest.mark.parametrize("nranks", RANKS)
def test_mpi_suite(nranks):
    """Every file of tests/mpi (new ones included) at `nranks` ranks; the tests marked
    ``local`` only at LOCAL_RANKS, and only those marked ``layout`` above FULL_RANKS."""
    own = [os.path.join(HERE, "mpi"), "-x", "--timeout=300"]
    if nranks > FULL_RANKS:
        own += ["-m", "layout"]
    proc = run_suite(nranks, own, suite_env())
    assert proc.returncode == 0, f"multi-rank suite failed at {nranks} ranks:\n{proc.stdout[-8000:]}"


def test_allreduce_at_six_ranks_oversubscribed():
    """The allreduce matrix (every algorithm x op x size, in and out of place, blocking and
    nonblocking, for dtypes of 1, 4 and 16 bytes: the reduction kernels do not change with the
    rank count, the 2-rank run takes every dtype) and the bit-identity checks at 6 ranks: not
    a power of two (recursive doubling and Rabenseifner fold two ranks in, ring blocks are
    uneven), more ranks than the 1-4 runs, and (on a 2-core machine) oversubscribed, with the
    progress engine yielding after idle polls (AL_ENGINE_YIELD=1, set here so it holds on any
    machine)."""
    allreduce = os.path.join(HERE, "mpi", "test_allreduce.py")
    proc = run_suite(6, [f"{allreduce}::{name}" for name in (
        "test_allreduce_matrix", "test_results_identical_on_all_ranks",
        "test_min_max_nan_and_signed_zero")] + [
        "-k", "not test_allreduce_matrix or uint8 or float32 or complex128",
        "-x", "--timeout=600", "--timeout-method=thread"], suite_env(AL_ENGINE_YIELD="1"))
    assert proc.returncode == 0, f"allreduce at 6 ranks failed:\n{proc.stdout[-8000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_shm_suites_with_streamed_slot_stores():
    """The shared-memory suites (the allreduce and every other collective over the segment:
    allgather, bcast, reduce_scatter, barrier, allgatherv, alltoall(v)) at 3 ranks with every
    slot written by streaming stores (AL_SHM_SLOT_STORES=streamed): the 1-4 rank runs take the
    default, which chooses by measurement and writes small messages with ordinary stores."""
    proc = run_suite(3, [os.path.join(HERE, "mpi", f) for f in (
        "test_shm.py", "test_shm_collectives.py", "test_shm_vcollectives.py")] + [
        "-x", "--timeout=300"], suite_env(AL_SHM_SLOT_STORES="streamed"))
    assert proc.returncode == 0, f"shm suites with streamed stores failed:\n{proc.stdout[-8000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_gpu_control_traffic_order_with_nonblocking_mpich_bcast():
    """tests/mpi/test_gpu_backend_cpu.py's control-communicator test at 2 ranks with MPICH's
    bcast run as a nonblocking schedule (and no device collectives): MPICH then matches the
    GPU backend's control bcast against collectives the engine has pending, so control traffic
    on the collective communicator hangs here; on the private control communicator it passes."""
    from mpi4py import MPI
    if "MPICH" not in MPI.Get_library_version():
        pytest.skip("the CVARs that expose the ordering are MPICH's")
    test = "test_control_traffic_does_not_interleave_with_engine_collectives"
    proc = run_suite(2, [os.path.join(HERE, "mpi", "test_gpu_backend_cpu.py") + "::" + test,
                         "--timeout=300"],
                     suite_env(MPIR_CVAR_DEVICE_COLLECTIVES="none",
                               MPIR_CVAR_BCAST_INTRA_ALGORITHM="nb"))
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-6000:]


@pytest.mark.parametrize("nranks", [n for n in RANKS if n <= 2] or [1])
def test_cuda_standin_suite(nranks):
    """tests/standin: the CUDA implementation of the device interface (the code that runs on a
    GPU) against the CUDA driver stand-in, under mpiexec, with AL_CUDA_LIBRARY set."""
    from aluminum_py.testing import cuda_standin
    proc = run_suite(nranks, [os.path.join(HERE, "standin"), "-x", "--timeout=300",
                              "--timeout-method=thread"],
                     suite_env(AL_CUDA_LIBRARY=cuda_standin.path(), AL_STANDIN_DRIVER_LOCK="1"))
    assert proc.returncode == 0, f"stand-in suite failed at {nranks} ranks:\n{proc.stdout[-8000:]}"


@pytest.mark.parametrize("nranks", [n for n in RANKS if n in (1, 2, 4)] or [1])
def test_gpu_suite_on_standins(nranks):
    """The GPU suite (tests/gpu: every collective x op x NCCL dtype, blocking and nonblocking,
    every GPU algorithm, written for CuPy) and tests/standin/test_nccl_path.py (what reaches
    NCCL: launch records, thread limits, nonblocking communicators) on the CUDA and NCCL
    stand-ins, with the CuPy stand-in as ``cupy`` (-p aluminum_py.testing.pytest_standins).
    Four ranks run the NCCL-path file, the allreduce tests (float32 SUM: the reduction itself
    does not change with the count, and one and two ranks take every op and dtype) and the
    v-collectives' uneven layouts only: oversubscribed on two cores, the whole suite takes
    minutes there."""
    from aluminum_py.testing import cuda_standin
    path = cuda_standin.path()
    args = ["-p", "aluminum_py.testing.pytest_standins", os.path.join(HERE, "gpu"),
            os.path.join(HERE, "standin", "test_nccl_path.py"),
            os.path.join(HERE, "standin", "test_nccl_api.py"), "-x", "--timeout=300",
            "--timeout-method=thread"]
    if nranks > 2:
        args += ["-k", "test_nccl_path or test_nccl_api or test_allreduce_blocking_and_nonblocking or "
                       "(test_allreduce and float32 and SUM) or (test_gpu_vcollectives and (uneven or launches))"]
    proc = run_suite(nranks, args, suite_env(AL_CUDA_LIBRARY=path, AL_NCCL_LIBRARY=path,
                                             AL_STANDIN_DRIVER_LOCK="1"))
    assert proc.returncode == 0, f"GPU suite on the stand-ins failed at {nranks} ranks:\n{proc.stdout[-8000:]}"
    assert " passed" in proc.stdout and " failed" not in proc.stdout
