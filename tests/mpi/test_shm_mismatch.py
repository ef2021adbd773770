"""Erroneous programs over the shared-memory segment: ranks whose calls of one collective differ
in the root or the counts.  Every rank of the call must raise aluminum_py.Error in that call
(not only the rank that reads the other's data, and never a silent return): the shm rounds
fingerprint the root and the counts of every collective (ext/shm/protocol.h), and Alltoallv's
round 0 carries every rank's send and receive counts (ext/shm/vcollectives.h).  Each case runs
on a communicator of its own (a mismatch breaks it) with a hang timeout, so that a rank left
waiting shows as a TimeoutError instead of hanging the suite."""
import numpy as np
import pytest

import aluminum_py as al
from conftest import WORLD, all_ranks_ok, every_rank
from test_shm import with_env

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

HANG = {"AL_HANG_TIMEOUT": "30"}        # a rank left waiting: TimeoutError, not a hang


def outcome(call):
    """What `call(comm)` did on this rank, on a communicator of its own: "error" (al.Error, not
    a timeout), "timeout", or "returned"; with the message."""
    comm = with_env(HANG, al.Communicator)
    try:
        if comm.size == 1:
            return "error", "(one rank: nothing differs)"
        call(comm)
        return "returned", ""
    except al.TimeoutError as e:
        return "timeout", str(e)
    except al.Error as e:
        return "error", str(e)
    finally:
        comm.Free()


def every_rank_raises(call):
    got, why = outcome(call)
    ok = all_ranks_ok(got == "error")
    assert ok, every_rank([] if got == "error" else [f"{got}: {why}"])


def differing_root(rank: int, size: int) -> int:
    """2 ranks: roots 0 and 1 (each believes it is the root); 3 ranks and more: 0, 0, ..., and
    the last rank believes it is the root."""
    return rank if rank == size - 1 else 0


@pytest.mark.parametrize("count", [4, 300007])      # inline / several 1 MiB slot rounds
@pytest.mark.parametrize("blocking", [True, False])
def test_bcast_with_differing_roots(count, blocking):
    def call(comm):
        x = np.full(count, comm.rank + 1, np.float32)
        root = differing_root(comm.rank, comm.size)
        if blocking:
            comm.Bcast(x, root=root, algorithm="shm")
        else:
            comm.Ibcast(x, root=root, algorithm="shm").Wait()
    every_rank_raises(call)


@pytest.mark.parametrize("count", [4, 300007])
def test_bcast_with_differing_counts(count):
    """The root's count differs from the others': the root reads nothing, and must fail too."""
    def call(comm):
        x = np.ones(count + (comm.rank == 0), np.float32)
        comm.Bcast(x, root=0, algorithm="shm")
    every_rank_raises(call)


@pytest.mark.parametrize("more", [1, -1])
def test_alltoallv_with_differing_counts(more):
    """Rank 0 sends rank 1 one element more (or less) than rank 1 expects; every other count
    agrees.  Rank 0, which receives what it expects, and the ranks outside the pair fail as
    well as rank 1."""
    def call(comm):
        p, me = comm.size, comm.rank
        sc = [2] * p
        rc = [2] * p
        if me == 0:
            sc[1] += more
        send = np.arange(sum(sc), dtype=np.float32)
        recv = np.zeros(sum(rc), np.float32)
        comm.Alltoallv([send, sc], [recv, rc], algorithm="shm")
    every_rank_raises(call)


@pytest.mark.parametrize("what", ["Allreduce", "Bcast", "Allgather"])
def test_a_count_of_zero_against_a_count(what):
    """Rank 0 passes no elements, the others 4: rank 0 must not return alone."""
    def call(comm):
        n = 0 if comm.rank == 0 else 4
        x = np.ones(n, np.float32)
        if what == "Allreduce":
            comm.Allreduce(x, np.empty_like(x), algorithm="shm")
        elif what == "Bcast":
            comm.Bcast(x, root=0, algorithm="shm")
        else:
            comm.Allgather(x, np.empty(n * comm.size, np.float32), algorithm="shm")
    every_rank_raises(call)


def test_agreeing_calls_still_work():
    """The same calls with roots and counts that agree: the right values on every rank."""
    comm = with_env(HANG, al.Communicator)
    try:
        p, me = comm.size, comm.rank
        x = np.full(300007, me + 1.0, np.float32)
        comm.Bcast(x, root=p - 1, algorithm="shm")
        ok = bool(np.all(x == p))
        sc = [j + 1 for j in range(p)]            # rank me sends j + 1 elements to rank j
        rc = [me + 1] * p
        send = np.concatenate([np.full(j + 1, 10 * me + j, np.float32) for j in range(p)])
        recv = np.zeros(sum(rc), np.float32)
        comm.Alltoallv([send, sc], [recv, rc], algorithm="shm")
        expected = np.concatenate([np.full(me + 1, 10 * j + me, np.float32) for j in range(p)])
        ok = ok and np.array_equal(recv, expected)
        z = np.ones(0, np.float32)
        comm.Allreduce(z, np.empty_like(z), algorithm="shm")
        comm.Bcast(z, root=0, algorithm="shm")
    finally:
        comm.Free()
    assert all_ranks_ok(ok)


def test_the_world_is_still_in_step():
    """After the failed calls above, the ranks still agree on what comes next."""
    assert WORLD.allreduce(1) == WORLD.size
