"""Issue 28's guarantees, each program in its own mpiexec launch under a wall-clock limit
(tests/trust_prog.py): whatever the threads do, a call returns the right values or raises
aluminum_py.Error, and every job ends; ranks calling with different counts raise on every
rank; Free() during another thread's call raises instead of unmapping the segment under it;
a forked child's exit leaves the parent's communicators alone.

Every program prints a line per finding (a wrong value, a call that should have raised, a
thread that never ended) and "DONE" per rank; a test fails on any finding, on a missing DONE
(a rank that crashed or hung) or on the time limit.
"""
import os
import sys

import pytest

from test_reliability_launch import mpiexec, run

PROG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trust_prog.py")
ALL_COLLS = "Allreduce,Allgather,Reduce_scatter,Barrier"


def launch(ranks: int, *args, timeout: float = 240, **env) -> str:
    env.setdefault("AL_EXIT_GRACE", "0.5")
    try:
        proc, _ = run([mpiexec(), "-n", str(ranks), sys.executable, PROG, *args], timeout, **env)
    except Exception as e:           # subprocess.TimeoutExpired: a hang
        pytest.fail(f"{' '.join(args)} at {ranks} ranks did not end: {e}")
    out = proc.stdout
    findings = [ln for ln in out.splitlines()
                if any(w in ln for w in ("WRONG", "HANG", "NOERROR", "Traceback"))]
    assert not findings, out[-6000:]
    for r in range(ranks):
        assert f"rank {r}: DONE" in out, out[-6000:]
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.mark.parametrize("timeline", [False, True])
def test_two_threads_on_one_communicator(timeline, tmp_path):
    """Each rank's owner thread and a second thread loop over calls (shm, auto, ring, mpi;
    Allreduce/Iallreduce, Allgather, Reduce_scatter, Barrier), the second thread starting at a
    different point of the owner's loop each repetition: every call that returns is right, the
    others raise aluminum_py.Error (the second thread's first call breaks the communicator on
    every rank), every thread ends."""
    env = {"AL_TIMELINE": str(tmp_path / "tl_{rank}.json")} if timeline else {}
    launch(2, "threads", "shm,auto,ring,mpi", ALL_COLLS, "6" if timeline else "12", **env)


def test_two_threads_hierarchical_three_ranks():
    """The same at 3 ranks on two emulated nodes (AL_NODE_LAYOUT=0,0,1): "hierarchical" (over
    the node segment), its point-to-point form, ring, mpi and auto."""
    launch(3, "threads", "hierarchical,hierarchical_p2p,ring,mpi,auto", "Allreduce", "8",
           AL_NODE_LAYOUT="0,0,1")


@pytest.mark.parametrize("ranks,layout", [(2, None), (3, "0,0,1")])
def test_call_from_a_second_thread_on_one_rank(ranks, layout):
    """Rank 0 calls from a thread that does not own the communicator, the other ranks from the
    owner: rank 0's call raises at once, the others' raise too (a notice through the segment's
    health word, or a tagged message across nodes) instead of waiting forever, and every later
    call raises."""
    env = {"AL_NODE_LAYOUT": layout} if layout else {}
    algs = "hierarchical,ring,mpi" if layout else "shm,ring,mpi,recursive_doubling"
    out = launch(ranks, "asymmetric", algs, **env)
    assert "refused a call" in out or "owned by thread" in out, out[-4000:]


def test_mismatched_counts_shm():
    """Rank 0 allreduces 1000 floats, rank 1 1002 (and the reversed order: 1000 then 1002
    against 1002 then 1000), over shm and auto: al.Error on both ranks naming both calls (the
    fingerprints of the shm rounds), no value returned."""
    out = launch(2, "mismatch", "shm,auto")
    assert "rank 1 called Allreduce(count=1002, float32, SUM" in out, out[-4000:]


def test_mismatched_counts_al_check():
    """The same with AL_CHECK=1 over the point-to-point algorithms and "mpi"."""
    out = launch(2, "mismatch", "ring,recursive_doubling,rabenseifner,mpi", AL_CHECK="1")
    assert "(AL_CHECK)" in out, out[-4000:]


@pytest.mark.parametrize("alg,check", [("hierarchical", "0"), ("hierarchical_p2p", "1")])
def test_mismatched_counts_hierarchical(alg, check):
    """And at 3 ranks on two emulated nodes: the node phases' fingerprints (hierarchical: rank
    2, alone on its node, learns it from a notice) or AL_CHECK (hierarchical_p2p)."""
    launch(3, "mismatch", alg, AL_CHECK=check, AL_NODE_LAYOUT="0,0,1")


@pytest.mark.parametrize("ranks,algs,hows", [(2, "shm,mpi,ring", "exit,finalize,raise"),
                                             (3, "shm,ring", "exit,finalize")])
def test_forked_child_that_exits_normally(ranks, algs, hows):
    """The even ranks fork a child while their Iallreduce (4 and 512 Ki doubles) is pending, and
    the child leaves by sys.exit, after calling MPI.Finalize itself, or by an uncaught exception
    (never os._exit): the parent's results are right (the peers' ops started before the fork,
    or after the child ended), the child ends with its own exit status, and the communicator
    goes on working.  MPI_Finalize in the child, which took the parent's messages from MPI's
    shared-memory queues and the parent's launcher connection, fails there at once."""
    out = launch(ranks, "fork", algs, hows, timeout=180)
    if "finalize" in hows:
        assert "child: MPI.Finalize raised" in out, out[-4000:]
        assert "child: MPI.Finalize returned" not in out, out[-4000:]


def test_free_during_another_threads_call():
    """Free() from the main thread while the owner thread is inside a blocking Allreduce (a
    late peer): al.Error, no crash (the segment is never unmapped under the op); the call
    completes right once the peer joins."""
    out = launch(2, "free", "shm,ring")
    assert "Free raised" in out, out[-4000:]
