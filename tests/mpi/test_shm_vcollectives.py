"""Allgatherv, Alltoall and Alltoallv over the shared-memory segment, through their native
entries (``shm_allgatherv`` / ``shm_alltoall`` / ``shm_alltoallv``, which the
Communicator's checked calls use): dtypes, counts that are zero, uneven, or all on one rank,
displacements with gaps and out of rank order, sizes crossing the slot (test_shm's `tiny`
communicator: 4 KiB slots), in place, blocking and nonblocking with several in flight; results
against numpy from every rank's inputs, and every element outside the receive blocks untouched.
Also: ranks whose counts differ fail (and the communicator with them), the hang timeout, and
the entries' own checks."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py.buffers import vlayout
from aluminum_py.testing.internals import shm_allgatherv, shm_alltoall, shm_alltoallv
from conftest import WORLD, all_ranks_ok, differences, every_rank
from test_shm import late_peers, tiny  # noqa: F401  (tiny: the 4 KiB-slot communicator fixture)

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

DTYPES = ["int8", "uint16", "float16", "int32", "float32", "float64", "complex128"]
SENTINEL = 99          # what recvbuf holds outside the receive blocks (must stay there)


def values(dtype, n, *key):
    """Input `key` (rank, op number, ...): n values that differ at every position and between
    ranks (as far as the dtype lets them)."""
    rng = np.random.default_rng(list(key) + [n])
    dt = np.dtype(dtype)
    v = rng.integers(0, 90, size=n)          # < SENTINEL: a stray sentinel shows
    if dt.kind == "c":
        return (v + 1j * rng.integers(0, 90, size=n)).astype(dt)
    return v.astype(dt)


def entry_args(c, blocking):
    return (c._host.launcher,), (blocking, 60.0)


def finish(req, blocking):
    if not blocking:
        assert req is not None
        req.Wait(timeout=60)
    else:
        assert req is None


# ---------------------------------------------------------------- layouts

def gappy_displs(counts, gap=3):
    """Blocks in reverse rank order with `gap` elements before each: (displs, length)."""
    displs, at = [0] * len(counts), gap
    for j in reversed(range(len(counts))):
        displs[j] = at
        at += counts[j] + gap
    return displs, at


def count_patterns(p, big):
    """(label, f(i, j)): the elements rank i sends rank j (Alltoallv) or, with j fixed, rank i's
    count (Allgatherv): all zero, uneven, one rank has everything, one pair only."""
    return [("zeros", lambda i, j: 0),
            ("uneven", lambda i, j: ((3 * i + 5 * j + 1) % 7) * big // 6),
            ("one rank has everything", lambda i, j: big if i == 0 else 0),
            ("one pair", lambda i, j: big + 1 if (i, j) == (p - 1, 0) else 0)]


TINY_DTYPES = ("int8", "float32", "complex128")     # elements of 1, 4, 16 bytes: the rounds' sums


def comms(comm, tiny, dtype="int8"):
    """(label, communicator, a size per block) for the default slots and, for TINY_DTYPES, the
    4 KiB ones (many rounds)."""
    return [("default", comm, 40)] + ([("tiny", tiny, 9001)] if dtype in TINY_DTYPES else [])


# ---------------------------------------------------------------- Allgatherv

def allgatherv_case(c, dtype, counts, gaps, inplace, blocking, key):
    p, me = c.size, c.rank
    displs, length = gappy_displs(counts) if gaps else (None, sum(counts))
    cnt, dsp = vlayout(counts, displs, p, "recvbuf", length)
    mine = values(dtype, counts[me], me, key)
    out = np.full(length, SENTINEL, dtype)
    expected = out.copy()
    for j, x in enumerate(WORLD.allgather(mine)):
        expected[dsp[j]:dsp[j] + cnt[j]] = x
    if inplace:
        out[dsp[me]:dsp[me] + cnt[me]] = mine
    head, tail = entry_args(c, blocking)
    finish(shm_allgatherv(*head, None if inplace else mine, out, cnt, dsp, *tail),
           blocking)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgatherv(comm, tiny, dtype):
    failures, key = [], 0
    for label, c, big in comms(comm, tiny, dtype):
        for pattern, f in count_patterns(c.size, big):
            counts = [f(i, 0) for i in range(c.size)]
            for gaps, inplace, blocking in ((False, False, True), (True, False, False),
                                            (True, True, True), (False, True, False)):
                key += 1
                out, expected = allgatherv_case(c, dtype, counts, gaps, inplace, blocking, key)
                what = (f"{label} {pattern} counts={counts} gaps={gaps} inplace={inplace} "
                        f"blocking={blocking}")
                failures += differences(what, out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17])
def test_allgatherv_at_the_edge_of_the_inline_area(comm, n):
    """Blocks of 1..17 bytes per rank: a round's data of at most 16 bytes rides in the flag's
    line, a longer one in the slot; ranks of both kinds in one round."""
    p = comm.size
    counts = [n + (j % 2) * (16 - n) for j in range(p)]     # n and 16: inline or not
    out, expected = allgatherv_case(comm, "int8", counts, True, False, True, 1000 + n)
    assert all_ranks_ok(not differences("", out, expected)), every_rank(
        differences(f"counts={counts}", out, expected))


# ---------------------------------------------------------------- Alltoall

@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall(comm, tiny, dtype):
    failures, key = [], 0
    for label, c, big in comms(comm, tiny, dtype):
        p, me = c.size, c.rank
        for n in (0, 1, 3, big):
            for inplace, blocking in ((False, True), (False, False), (True, True), (True, False)):
                key += 1
                x = values(dtype, p * n, me, key)
                rows = WORLD.allgather(x)
                expected = np.concatenate([rows[j][me * n:(me + 1) * n] for j in range(p)])
                out = x.copy() if inplace else np.full(p * n, SENTINEL, dtype)
                head, tail = entry_args(c, blocking)
                finish(shm_alltoall(*head, None if inplace else x, out, n, *tail),
                       blocking)
                failures += differences(f"{label} n={n} inplace={inplace} blocking={blocking}",
                                        out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


# ---------------------------------------------------------------- Alltoallv

def alltoallv_case(c, dtype, f, gaps, inplace, blocking, key):
    """Rank i sends f(i, j) elements to rank j (in place: f must be symmetric)."""
    p, me = c.size, c.rank
    scounts = [f(me, j) for j in range(p)]
    rcounts = [f(j, me) for j in range(p)]
    sd, slen = gappy_displs(scounts, 2) if gaps else (None, sum(scounts))
    rd, rlen = gappy_displs(rcounts, 5) if gaps else (None, sum(rcounts))
    rc, rdsp = vlayout(rcounts, rd, p, "recvbuf", rlen)
    out = np.full(rlen, SENTINEL, dtype)
    if inplace:
        sc, sdsp = rc, rdsp
        x = out.copy()
        for j in range(p):
            x[rdsp[j]:rdsp[j] + rc[j]] = values(dtype, int(rc[j]), me, j, key)
        out[:] = x
    else:
        sc, sdsp = vlayout(scounts, sd, p, "sendbuf", slen)
        x = values(dtype, slen, me, key)
    expected = np.full(rlen, SENTINEL, dtype)
    for j, (xj, scj, sdj) in enumerate(WORLD.allgather((x, sc, sdsp))):
        expected[rdsp[j]:rdsp[j] + rc[j]] = xj[sdj[me]:sdj[me] + scj[me]]
    head, tail = entry_args(c, blocking)
    finish(shm_alltoallv(*head, None if inplace else x, sc, sdsp, out, rc, rdsp, *tail),
           blocking)
    return out, expected


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoallv(comm, tiny, dtype):
    failures, key = [], 0
    for label, c, big in comms(comm, tiny, dtype):
        for pattern, f in count_patterns(c.size, big):
            for gaps, blocking in ((False, True), (True, False)):
                key += 1
                out, expected = alltoallv_case(c, dtype, f, gaps, False, blocking, key)
                failures += differences(f"{label} {pattern} gaps={gaps} blocking={blocking}",
                                        out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("dtype", ["int8", "float32", "complex128"])
def test_alltoallv_in_place(comm, tiny, dtype):
    """MPI_IN_PLACE: recvbuf's layout for both sides (the counts symmetric, as MPI requires);
    a rank overwrites its blocks while its peers still read the data they held (staged through
    the segment, round by round)."""
    failures, key = [], 0
    for label, c, big in comms(comm, tiny, dtype):
        for pattern, f in (("uneven", lambda i, j: ((i + j) * 5 + 1) * big // 10),
                           ("zeros", lambda i, j: 0),
                           ("one pair", lambda i, j: big if {i, j} == {0, c.size - 1} else 0)):
            for gaps, blocking in ((False, True), (True, False), (True, True)):
                key += 1
                out, expected = alltoallv_case(c, dtype, f, gaps, True, blocking, key)
                failures += differences(f"{label} {pattern} gaps={gaps} blocking={blocking}",
                                        out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


# ---------------------------------------------------------------- concurrency

def test_several_in_flight(comm, tiny):
    """Nonblocking Allgatherv / Alltoall / Alltoallv (and an shm allreduce between them) started
    back to back, then a blocking one queued behind them; each lands in its own buffer."""
    failures = []
    for label, c, big in comms(comm, tiny):
        p, me = c.size, c.rank
        head, tail = entry_args(c, False)
        reqs, checks = [], []
        for i in range(9):
            kind = i % 4
            n = big // (i + 1) + i
            if kind == 0:
                counts = [(n * (j + 1)) % (big + 1) for j in range(p)]
                cnt, dsp = vlayout(counts, None, p, "recvbuf", sum(counts))
                x = values("float32", counts[me], me, i)
                out = np.empty(sum(counts), np.float32)
                reqs.append(shm_allgatherv(*head, x, out, cnt, dsp, *tail))
                checks.append((f"allgatherv {i}", out, np.concatenate(WORLD.allgather(x))))
            elif kind == 1:
                x = values("int16", p * n, me, i)
                out = np.empty(p * n, np.int16)
                reqs.append(shm_alltoall(*head, x, out, n, *tail))
                rows = WORLD.allgather(x)
                checks.append((f"alltoall {i}", out,
                               np.concatenate([r[me * n:(me + 1) * n] for r in rows])))
            elif kind == 2:
                f = (lambda a, b, n=n: (a * 3 + b + n) % (n + 2))
                sc, sd = vlayout([f(me, j) for j in range(p)], None, p, "sendbuf",
                                 sum(f(me, j) for j in range(p)))
                rc, rd = vlayout([f(j, me) for j in range(p)], None, p, "recvbuf",
                                 sum(f(j, me) for j in range(p)))
                x = values("float64", int(sc.sum()), me, i)
                out = np.empty(int(rc.sum()), np.float64)
                reqs.append(shm_alltoallv(*head, x, sc, sd, out, rc, rd, *tail))
                rows = WORLD.allgather((x, sd))
                checks.append((f"alltoallv {i}", out, np.concatenate(
                    [xj[sdj[me]:sdj[me] + rc[j]] for j, (xj, sdj) in enumerate(rows)])))
            else:
                x = values("float32", n, me, i)
                out = np.empty(n, np.float32)
                reqs.append(c.Iallreduce(x, out, algorithm="shm"))
                checks.append((f"allreduce {i}", out,
                               np.add.reduce(np.stack(WORLD.allgather(x)), axis=0)))
        counts = [big % 97 + j for j in range(p)]
        cnt, dsp = vlayout(counts, None, p, "recvbuf", sum(counts))
        x = values("int8", counts[me], me, 77)
        last = np.empty(sum(counts), np.int8)
        shm_allgatherv(c._host.launcher, x, last, cnt, dsp, True, 60.0)
        checks.append(("blocking after them", last, np.concatenate(WORLD.allgather(x))))
        al.Waitall(reqs)
        failures += [m for what, got, want in checks
                     for m in differences(f"{label} {what}", got, want)]
    assert all_ranks_ok(not failures), every_rank(failures)


# ---------------------------------------------------------------- errors

def test_counts_that_differ_fail_the_communicator():
    """Rank 1 expects one element more from rank 0 than rank 0 sends: rank 1's Alltoallv fails
    naming both counts, and every rank's next call on that communicator fails (no wrong data
    passed on silently, no hang)."""
    if WORLD.size < 2:
        pytest.skip("needs a peer")
    c = al.Communicator()
    p, me = c.size, c.rank
    sc, sd = vlayout([2] * p, None, p, "sendbuf", 2 * p)
    rcounts = [3 if (me, j) == (1, 0) else 2 for j in range(p)]
    rc, rd = vlayout(rcounts, None, p, "recvbuf", sum(rcounts))
    x, out = np.ones(2 * p, np.float32), np.zeros(sum(rcounts), np.float32)
    failures = []
    try:
        shm_alltoallv(c._host.launcher, x, sc, sd, out, rc, rd, True, 60.0)
        if me == 1:
            failures.append("rank 1's Alltoallv did not fail")
    except al.Error as e:
        if me == 1 and "expects 3 elements from rank 0" not in str(e):
            failures.append(f"message: {e}")
    WORLD.Barrier()
    with pytest.raises(al.Error):
        shm_alltoall(c._host.launcher, x, np.zeros(2 * p, np.float32), 2, True, 60.0)
    c.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_allgatherv_counts_that_differ_fail():
    """Ranks whose Allgatherv counts differ fail at the first round (the fingerprint holds a
    hash of the counts): the ranks that compare them name both calls, the others the rank
    that broke the communicator."""
    if WORLD.size < 2:
        pytest.skip("needs a peer")
    c = al.Communicator()
    p, me = c.size, c.rank
    counts = [4] * p if me != 1 else [4] * (p - 1) + [5]
    cnt, dsp = vlayout(counts, None, p, "recvbuf", sum(counts))
    with pytest.raises(al.Error, match="calls.*differ"):
        shm_allgatherv(c._host.launcher, None, np.zeros(sum(counts), np.int32), cnt, dsp,
                             True, 60.0)
    c.Free()


def test_hang_timeout_names_the_missing_rank():
    """Rank 0 enters an shm Alltoallv its peers join only later: the hang-timeout error names
    the op; once they join it completes in the engine and the segment still works."""
    if WORLD.size < 2:
        pytest.skip("needs a peer")
    c = al.Communicator()
    p, me = c.size, c.rank
    cnt, dsp = vlayout([1] * p, None, p, "recvbuf", p)
    x, out = np.arange(p, dtype=np.float32), np.zeros(p, np.float32)
    failures = late_peers(c, lambda: shm_alltoallv(c._host.launcher, x, cnt, dsp, out,
                                                         cnt, dsp, True, 0.5),
                          "alltoallv/shm")
    y = np.zeros(p, np.float32)
    shm_alltoall(c._host.launcher, x * (me + 1), y, 1, True, 60.0)
    failures += differences("next op", y, np.arange(1, p + 1, dtype=np.float32) * me)
    c.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_entry_checks(comm):
    """What the entries check themselves (the Communicator checks the rest first): messages of
    buffers.py, nothing written."""
    p, me = comm.size, comm.rank
    L = comm._host.launcher
    out = np.full(2 * p, 7, np.float32)
    good = vlayout([2] * p, None, p, "recvbuf", 2 * p)
    with pytest.raises(ValueError, match="recvbuf: the block of rank"):
        shm_allgatherv(L, None, out[:-1], *good, True, 60.0)
    with pytest.raises(TypeError, match="dtype"):
        shm_allgatherv(L, np.zeros(2, np.int32), out, *good, True, 60.0)
    with pytest.raises(ValueError, match="sendbuf is too short"):
        shm_alltoall(L, np.zeros(p, np.float32), out, 2, True, 60.0)
    with pytest.raises(ValueError, match="overlap"):
        shm_alltoallv(L, out[1:], *vlayout([1] * p, None, p, "s", p), out, *good, True,
                            60.0)
    bad = vlayout([2 + (j == me) for j in range(p)], None, p, "sendbuf", 2 * p + 1)
    with pytest.raises(ValueError, match=rf"sendcounts\[{me}\] is 3 but recvcounts\[{me}\] is 2"):
        shm_alltoallv(L, np.zeros(2 * p + 1, np.float32), *bad, out, *good, True, 60.0)
    # counts as lists go through vlayout (converted)
    x = np.full(2, me, np.float32)
    shm_allgatherv(L, x, out, [2] * p, None, True, 60.0)
    assert all_ranks_ok(np.array_equal(out, np.repeat(np.arange(p, dtype=np.float32), 2)))
