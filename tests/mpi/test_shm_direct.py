"""The direct protocol of "shm" allreduces (al_shm.h, "the direct protocol"): above
AL_SHM_DIRECT_BYTES each rank reduces its block from its peers' sendbufs, read once with Linux's
cross-memory attach, and copies their reduced blocks from their recvbufs, instead of copying
through the segment's slots twice.  Every result must be numpy's from every rank's inputs, in
place or not, blocking or not, mixed with the segment's other ops; the setup's probe must turn
it off on every rank when one rank cannot read its peers; calls that differ must raise on every
rank before any read."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import _core
from conftest import (WORLD, all_ranks_ok, every_rank, gather_all, make_input, ops_for,
                      reference, differences)
from test_shm import with_env
from test_shm_stores import results_of

pytestmark = pytest.mark.mpi

# in elements of 4 bytes, with AL_SHM_DIRECT_BYTES=4096: the symmetric protocol, the split one,
# the direct one at its edge, blocks of unequal sizes, empty blocks on some ranks at 3-4 ranks
# (blocks are whole cache lines), several slots' worth, above AL_SHM_STREAM_BYTES
COUNTS = [1000, 1024, 1025, 4099, 70001, 300007, (9 << 20) // 4 + 3]


def communicator(direct, **env):
    """A communicator whose segment's allreduces above `direct` bytes use the direct protocol
    (if every rank can read its peers' memory here: else the test skips on every rank)."""
    comm = with_env({"AL_SHM_DIRECT_BYTES": str(direct), **env}, al.Communicator)
    info = _core.shm_info(comm._state)
    if info is None:
        comm.Free()
        pytest.skip("one rank: no segment")
    if env.get("AL_SHM_TEST_UNREADABLE") is None and info["direct"] != direct:
        why = info["direct_unavailable"]
        comm.Free()
        pytest.skip(f"the direct protocol is not available here: {why}")
    return comm


@pytest.fixture
def direct():
    comm = communicator(4096)
    yield comm
    comm.Free()


def test_the_setup_enables_it_on_every_rank(direct):
    info = _core.shm_info(direct._state)
    assert info["direct"] == 4096 and info["direct_unavailable"] is None
    assert all_ranks_ok(True)


def test_results_of_every_size(direct):
    """SUM float32, AVG float64, MAX int16, PROD complex64, in place and not, at every count."""
    failures = results_of(direct, COUNTS)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("dtype", ["int8", "float16", "float64", "complex128"])
def test_results_of_every_op(direct, dtype):
    failures = []
    for op in ops_for(dtype):
        for n in (5000, 33333):
            x = make_input(dtype, op, n, seed=n, rank=direct.rank)
            expected = reference(op, gather_all(x), direct.size)
            out = np.empty_like(x)
            direct.Allreduce(x, out, op=op, algorithm="shm")
            failures += differences(f"{dtype} {op.name} n={n}", out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_nonblocking_calls_in_flight_and_other_ops_between(direct):
    """Several Iallreduce in flight (direct, split and symmetric sizes), then a blocking
    allgather and bcast over the segment and a direct allreduce again: the rounds and flags stay
    in step whatever protocol each op used."""
    failures = []
    xs = [make_input("float32", al.SUM, n, seed=n, rank=direct.rank)
          for n in (70001, 500, 3000, 300007)]
    expected = [reference(al.SUM, gather_all(x), direct.size) for x in xs]
    requests = [direct.Iallreduce(x, algorithm="shm") for x in xs]
    for r in requests:
        r.Wait(timeout=60)
    for x, e in zip(xs, expected):
        failures += differences(f"Iallreduce n={len(x)}", x, e)
    mine = np.full(5000, direct.rank, dtype=np.float64)
    every = np.empty(5000 * direct.size)
    direct.Allgather(mine, every, algorithm="shm")
    failures += differences("allgather", every, np.repeat(np.arange(direct.size, dtype=float),
                                                          5000))
    b = np.arange(9000.0) if direct.rank == 0 else np.zeros(9000)
    direct.Bcast(b, root=0, algorithm="shm")
    failures += differences("bcast", b, np.arange(9000.0))
    x = make_input("float64", al.SUM, 40000, seed=7, rank=direct.rank)
    e = reference(al.SUM, gather_all(x), direct.size)
    direct.Allreduce(x, algorithm="shm")
    failures += differences("allreduce after", x, e)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_a_rank_that_cannot_read_turns_it_off_everywhere():
    """AL_SHM_TEST_UNREADABLE=1: rank 1 reports that it may not read its peers' memory (as
    under a seccomp profile that forbids process_vm_readv): no rank uses the direct protocol,
    shm_info says why on every rank, and the results are right (the split protocol)."""
    if WORLD.size == 1:
        pytest.skip("one rank: no segment")
    comm = communicator(4096, AL_SHM_TEST_UNREADABLE="1")
    try:
        info = _core.shm_info(comm._state)
        ok = info["direct"] == 0 and "rank 1 could not read" in (info["direct_unavailable"] or "")
        failures = results_of(comm, [4099, 70001], ((al.SUM, "float32"),))
    finally:
        comm.Free()
    assert all_ranks_ok(ok and not failures), every_rank((info, failures))


def test_off_at_zero():
    if WORLD.size == 1:
        pytest.skip("one rank: no segment")
    comm = with_env({"AL_SHM_DIRECT_BYTES": "0"}, al.Communicator)
    try:
        info = _core.shm_info(comm._state)
        failures = results_of(comm, [70001], ((al.SUM, "float32"),))
    finally:
        comm.Free()
    assert all_ranks_ok(info["direct"] == 0 and "=0" in info["direct_unavailable"]
                        and not failures)


def test_calls_that_differ_raise_on_every_rank_before_any_read(direct):
    """Rank 0 allreduces 5000 floats, the others 5008: the fingerprints differ at the first
    arrive, before a rank reads a peer's buffer (a read of a longer buffer than the peer has
    would fail or read foreign memory); every rank raises, and so does every later call."""
    n = 5000 if direct.rank == 0 else 5008
    x = np.ones(n, dtype=np.float32)
    try:
        direct.Allreduce(x, algorithm="shm")
        raised = None
    except al.Error as e:
        raised = str(e)
    later = None
    try:
        direct.Allreduce(np.ones(4, np.float32), algorithm="shm")
    except al.Error as e:
        later = str(e)
    ok = raised is not None and "differ" in raised and later is not None and np.all(x == 1)
    assert all_ranks_ok(ok), every_rank((raised, later))
