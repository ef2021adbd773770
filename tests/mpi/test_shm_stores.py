"""How "shm" writes its slots (al_shm.h, "the slots' stores"): ordinary (cached) or streaming
stores, fixed (AL_SHM_SLOT_STORES) or by the size an op writes into a rank's slots (streamed
from 4 KiB).  Every kind, and ranks that use different kinds in the same call, must give
numpy's result from every rank's inputs.  (tests/test_mpi_suite.py also runs the whole shm
suites with every slot streamed.)"""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py.testing import at_page_offset
from aluminum_py.testing.internals import (STORES_BY_SIZE as AUTO, STORES_CACHED as CACHED,
                                           STORES_STREAMED as STREAMED, set_shm_slot_stores,
                                           shm_info)
from conftest import (WORLD, all_ranks_ok, every_rank, gather_all, make_input, reference,
                      differences)
from test_allreduce import matrix_failures
from test_shm import with_env

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

# below the 4 KiB from which the slots stream by size; at it; the symmetric protocol above it;
# both protocols; above one 1 MiB slot (several rounds, an uneven last one); above
# AL_SHM_STREAM_BYTES (recvbuf streamed as well)
COUNTS = [1000, 1024, 4001, 16383, 70001, 300007, (9 << 20) // 4 + 3]


@pytest.fixture
def stores():
    """Set this process's slot stores for the test (set_shm_slot_stores), then restore
    AL_SHM_SLOT_STORES's."""
    yield set_shm_slot_stores
    set_shm_slot_stores(al.config.shm_slot_stores())


def results_of(comm, counts, ops=((al.SUM, "float32"), (al.AVG, "float64"), (al.MAX, "int16"),
                                  (al.PROD, "complex64"))):
    """Allreduce each (op, dtype) at each count, in place and not: the differences from numpy."""
    failures = []
    for op, dtype in ops:
        for n in counts:
            x = make_input(dtype, op, n, seed=n, rank=comm.rank)
            expected = reference(op, gather_all(x), comm.size)
            out = np.empty_like(x)
            comm.Allreduce(x, out, op=op, algorithm="shm")
            failures += differences(f"{dtype} {op.name} n={n}", out, expected)
            buf = x.copy()
            comm.Allreduce(buf, op=op, algorithm="shm")
            failures += differences(f"{dtype} {op.name} n={n} in place", buf, expected)
    return failures


@pytest.mark.parametrize("mode", [AUTO, CACHED, STREAMED, "mixed"])
def test_every_kind_of_store_gives_the_result(comm, stores, mode):
    """Cached and streamed stores on every rank, and (mixed) even ranks streaming while odd
    ones do not: a reader never depends on how a peer wrote its slot."""
    stores(mode if mode != "mixed" else (STREAMED if comm.rank % 2 == 0 else CACHED))
    failures = results_of(comm, COUNTS)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("mode", [CACHED, STREAMED])
def test_every_kind_on_tiny_slots(stores, mode):
    """Many rounds of 4 KiB slots, both protocols, every dtype and op (AVG included)."""
    stores(mode)
    tiny = with_env({"AL_SHM_SLOT_BYTES": "4096", "AL_SHM_SMALL_BYTES": "1024"}, al.Communicator)
    try:
        failures = matrix_failures(tiny, "shm", ["int8", "float16", "float64", "complex128"],
                                   [5, 1025, 9001])
    finally:
        tiny.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def collectives_of(comm, n):
    """Allgather, Reduce_scatter, Alltoall, Allgatherv and Alltoallv over the segment with n
    elements per block (uneven per rank for the v forms): the differences from numpy."""
    p, me = comm.size, comm.rank
    failures = []
    x = make_input("float32", al.SUM, n, seed=n, rank=me)
    rows = gather_all(x)
    out = np.empty(n * p, np.float32)
    comm.Allgather(x, out, algorithm="shm")
    failures += differences(f"allgather n={n}", out, np.concatenate(rows))
    big = make_input("float32", al.SUM, n * p, seed=n + 1, rank=me)
    part = np.empty(n, np.float32)
    comm.Reduce_scatter(big, part, algorithm="shm")
    failures += differences(f"reduce_scatter n={n}", part,
                            reference(al.SUM, gather_all(big), p)[me * n:(me + 1) * n])
    a2a = np.empty(n * p, np.float32)
    comm.Alltoall(big, a2a, algorithm="shm")
    failures += differences(f"alltoall n={n}", a2a, np.concatenate(
        [r[me * n:(me + 1) * n] for r in gather_all(big)]))
    counts = [n - 7 * j if n > 7 * j else 1 for j in range(p)]
    mine = x[:counts[me]]
    outv = np.empty(sum(counts), np.float32)
    comm.Allgatherv(mine, [outv, counts], algorithm="shm")
    failures += differences(f"allgatherv n={n}", outv,
                            np.concatenate([r[:counts[j]] for j, r in enumerate(rows)]))
    # rank i sends (i + j) % 3 + n - 3 elements to rank j
    f = lambda i, j: (i + j) % 3 + n - 3                           # noqa: E731
    sc = [f(me, j) for j in range(p)]
    rc = [f(j, me) for j in range(p)]
    send = make_input("float32", al.SUM, sum(sc), seed=n + 2, rank=me)
    recv = np.empty(sum(rc), np.float32)
    comm.Alltoallv([send, sc], [recv, rc], algorithm="shm")
    sends = WORLD.allgather(send)
    expected = []
    for j in range(p):
        sdj = [f(j, k) for k in range(p)]
        start = sum(sdj[:me])
        expected.append(sends[j][start:start + sdj[me]])
    failures += differences(f"alltoallv n={n}", recv, np.concatenate(expected))
    return failures


@pytest.mark.parametrize("mode", [AUTO, CACHED, STREAMED, "mixed"])
def test_the_other_collectives(comm, stores, mode):
    """The collectives other than the allreduce, each kind of store and mixed kinds, below and
    above 4 KiB written and above one 1 MiB slot."""
    stores(mode if mode != "mixed" else (STREAMED if comm.rank % 2 == 0 else CACHED))
    failures = []
    for n in (1000, 9000, 300001):
        failures += collectives_of(comm, n)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("mode", [AUTO, CACHED, STREAMED])
def test_buffers_anywhere_in_a_cache_line(comm, stores, mode):
    """sendbuf and recvbuf at every 4-byte offset of a cache line (and in place): the copies
    between the slots and buffers placed differently in a line take 16-byte vectors
    (al_shm.h al_shm_copy_lines), with a head and a tail; the results are numpy's."""
    stores(mode)
    failures = []
    for n in (70001, 300007, (5 << 20) // 4 + 3):       # both protocols, several slot rounds
        x = make_input("float32", al.SUM, n, seed=n, rank=comm.rank)
        expected = reference(al.SUM, gather_all(x), comm.size)
        for s_off, r_off in ((16, 0), (0, 16), (4, 52), (16, 48), (60, 8), (32, 32), (12, 12)):
            send = at_page_offset(4 * n, s_off, np.float32)
            recv = at_page_offset(4 * n, r_off, np.float32)
            send[:] = x
            comm.Allreduce(send, recv, algorithm="shm")
            failures += differences(f"n={n} send+{s_off} recv+{r_off}", recv, expected)
            if not np.array_equal(send, x):
                failures.append(f"n={n} send+{s_off}: sendbuf changed")
            inplace = at_page_offset(4 * n, r_off, np.float32)
            inplace[:] = x
            comm.Allreduce(inplace, algorithm="shm")
            failures += differences(f"n={n} in place +{r_off}", inplace, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_the_size_rule_is_reported(comm, stores):
    """shm_info's "stream_slots_from": 4 KiB by size (the default), None cached, 0 streamed:
    what AL_SHM_SLOT_STORES sets is what the segment uses."""
    got = []
    for mode in (AUTO, CACHED, STREAMED):
        stores(mode)
        info = shm_info(comm._state)
        got.append(info and info["stream_slots_from"])
    ok = got == [4096, None, 0] or (comm.size == 1 and got == [None] * 3)
    assert all_ranks_ok(ok), every_rank([] if ok else [f"stream_slots_from per mode: {got}"])
