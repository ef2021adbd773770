"""How "shm" writes its slots (al_shm.h, "the slots' stores"): ordinary (cached) or streaming
stores, fixed (AL_SHM_SLOT_STORES) or chosen by each rank per collective and size class from
what it measures.  Every kind, and ranks that use different kinds in the same call, must give
numpy's result from every rank's inputs; the choice must follow its documented schedule.
(tests/test_mpi_suite.py also runs the whole shm suites with every slot streamed.)"""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.testing import at_page_offset
from conftest import (WORLD, all_ranks_ok, every_rank, gather_all, make_input, reference,
                      differences)
from test_allreduce import matrix_failures
from test_shm import with_env

pytestmark = pytest.mark.mpi

AUTO, CACHED, STREAMED = 0, 1, 2           # config.SHM_SLOT_STORES's indices
# below the 4 KiB of the first measured class; at it; in a class of the symmetric protocol; both
# protocols; above one 1 MiB slot (several rounds, an uneven last one); above
# AL_SHM_STREAM_BYTES (recvbuf streamed as well)
COUNTS = [1000, 1024, 4001, 16383, 70001, 300007, (9 << 20) // 4 + 3]


@pytest.fixture
def stores():
    """Set this process's slot stores for the test (_core.set_shm_slot_stores), then restore
    AL_SHM_SLOT_STORES's."""
    yield _core.set_shm_slot_stores
    _core.set_shm_slot_stores(al.config.shm_slot_stores())


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


@pytest.mark.parametrize("mode", [CACHED, STREAMED, "mixed"])
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


def test_measured_choice_follows_its_schedule(stores):
    """AL_SHM_SLOT_STORES=auto: per size class (powers of two from 4 KiB), a new class's first 3
    calls try the kind the segment's latest verdict did not choose (on a new segment: what the
    placement probe found, its "prefer"), the next ones use the verdict's until both kinds
    have two measurements each (from call 6), then every call uses the kind rank 0 measured cheaper,
    except the last 3 of every 32 (calls 29-31, 61-63), which try the other, and every half
    second.  The other ranks use rank 0's kind, up to a call late.  So after 6 calls 3 of
    the other kind and both kinds have a cost on rank 0; after 32 and 64 calls at least
    the first 3, and both kinds have a cost on every rank.  Messages below 4 KiB are not
    measured.  Every result is right meanwhile."""
    stores(AUTO)
    comm = al.Communicator()            # a segment of its own: no calls counted before
    try:
        if comm.size == 1:
            assert _core.shm_info(comm._state) is None
            return
        failures = []
        seen = []
        first_kind = _core.shm_info(comm._state)["prefer"]

        def others(d):
            """Calls of the kind the class did not start with."""
            return d["streamed"] if first_kind == "cached" else d["calls"] - d["streamed"]

        for n, calls in ((1000, 64), (24 << 10, 6), (24 << 10, 26), (24 << 10, 32)):  # 96 KiB
            x = np.arange(n, dtype=np.float32) + comm.rank
            expected = sum(np.arange(n, dtype=np.float32) + r for r in range(comm.size))
            for k in range(calls):
                out = np.empty_like(x)
                comm.Allreduce(x, out, algorithm="shm")
                failures += differences(f"n={n} call {k}", out, expected)
            seen.append(_core.shm_info(comm._state)["stores"].get("allreduce", {}))
        if seen[0] != {}:
            failures.append(f"4000 B measured: {seen[0]}")
        first, trial, last = (seen[i].get(64 << 10) for i in (1, 2, 3))
        # the other ranks use rank 0's kind, and may begin a call before rank 0 has chosen
        # it: theirs lags rank 0's by up to a call at each switch
        lag = 0 if comm.rank == 0 else 1
        if (list(seen[3]) != [64 << 10] or first["calls"] != 6
                or not 3 - lag <= others(first) <= 3 + lag
                or (comm.rank == 0 and not all(cost > 0 for cost in first["cost"]))):
            failures.append(f"after 6 calls of 96 KiB, starting {first_kind}: {seen[1]}")
        elif trial["calls"] != 32 or not 3 - lag <= others(trial) <= 32:
            failures.append(f"after 32 calls of 96 KiB: {trial}")
        elif last["calls"] != 64 or not 3 - lag <= others(last) <= 64:
            failures.append(f"after 64 calls of 96 KiB: {last}")
        elif not all(cost > 0 for cost in last["cost"]):
            failures.append(f"a kind without a measured cost: {last}")
        elif [len(r) for r in last["recent"]] != [4, 4] or any(
                cost != min(t for t in recent if t > 0)
                for cost, recent in zip(last["cost"], last["recent"])):
            failures.append(f"each kind's cost is not the least of its recent ones: {last}")
        # a rank a call behind rank 0 at a trial's start or end gains or loses one call of
        # the other kind: up to one per trial of rank 0's (AL_SHM_TRIAL calls each; a slow
        # run has more of them, from the half-second rule), and 2 besides
        kinds = WORLD.allgather(others(last) if last else None)
        if last and any(k is None or abs(k - kinds[0]) > 2 + kinds[0] // 3 for k in kinds):
            failures.append(f"calls of the other kind per rank {kinds}: not rank 0's")
    finally:
        comm.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_trials_within_a_call_on_every_rank(stores):
    """An allreduce of 10 rounds or more (here 16 rounds of 4 KiB slots) tries the other kind
    within the call: rank 0 decides, and the other ranks switch at the same rounds (they read
    rank 0's kind of the call and its trial word at round 2; al_shm.h al_shm_part_boundary).
    A new class's first two calls are such trials in the segment's verdict's kind: after them
    every rank holds two measurements of each kind (a rank that missed rank 0's trial word
    would hold those of one kind alone) and no call ran in the other kind as a whole.  After
    18 more, each rank's calls per kind, and its measurements of each, are rank 0's.  Every
    result is right meanwhile, though the kinds change within the calls."""
    stores(AUTO)
    comm = with_env({"AL_SHM_SLOT_BYTES": "4096", "AL_SHM_SMALL_BYTES": "1024"},
                    al.Communicator)
    try:
        if comm.size == 1:
            return
        n = (64 << 10) // 4                     # 64 KiB: 16 rounds of 4 KiB
        x = make_input("float32", al.SUM, n, seed=3, rank=comm.rank)
        expected = reference(al.SUM, gather_all(x), comm.size)
        failures, seen = [], []
        first_kind = _core.shm_info(comm._state)["prefer"]
        for calls in (2, 18):
            for k in range(calls):
                out = np.empty_like(x)
                comm.Allreduce(x, out, algorithm="shm")
                failures += differences(f"call {k}", out, expected)
            cls = _core.shm_info(comm._state)["stores"]["allreduce"][64 << 10]
            seen.append((cls["calls"], cls["streamed"],
                         tuple(sum(t > 0 for t in recent) for recent in cls["recent"])))
        if seen[0] != (2, 0 if first_kind == "cached" else 2, (2, 2)):
            failures.append(f"after 2 calls, starting {first_kind}: {seen[0]}")
        every = WORLD.allgather(seen[1])
        if len(set(every)) != 1:
            failures.append(f"after 20 calls, per rank (calls, streamed, measurements of each "
                            f"kind): {every}")
    finally:
        comm.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_the_benches_find_a_size_in_its_class(stores):
    """aluminum_py.bench.timing.shm_stores_class (what bench/peers.py and the shm benches read)
    finds the class al_shm.h counted an allreduce's calls in: 3 calls of 6000 bytes and 5 of
    8192 land in the 4 KiB and 8 KiB classes, a size of no class yet has None."""
    from aluminum_py.bench.timing import shm_stores_class
    stores(AUTO)
    c = al.Communicator()                   # a new segment: no class has calls yet
    try:
        if _core.shm_info(c._state) is None:
            return
        for nbytes, calls in ((6000, 3), (8192, 5)):
            x = np.ones(nbytes // 4, np.float32)
            for _ in range(calls):
                c.Allreduce(x, np.empty_like(x), algorithm="shm")
        info = _core.shm_info(c._state)
        got = [(shm_stores_class(info, n) or {}).get("calls") for n in (6000, 4096, 8192, 12000)]
        got.append(shm_stores_class(info, 1 << 20))
        got.append(shm_stores_class(info, 6000, "allgather"))
        got.append(shm_stores_class(None, 6000))
    finally:
        c.Free()
    ok = got == [3, 3, 5, 5, None, None, None]
    assert all_ranks_ok(ok), every_rank([] if ok else [f"calls found per size: {got}"])


def probe_results(env=None):
    """Every rank's (round_trip_ns, prefer) of a new communicator's segment (made with the
    environment variables `env`), None without a segment."""
    comm = with_env(env or {}, al.Communicator)
    try:
        info = _core.shm_info(comm._state)
    finally:
        comm.Free()
    return None if info is None else WORLD.allgather((info["round_trip_ns"], info["prefer"]))


def oversubscribed() -> bool:
    import os
    return WORLD.size > len(os.sched_getaffinity(0))


def test_the_placement_probe_chooses_the_first_kind():
    """At setup ranks 0 and 1 time a cache line's round trip (al_shm_round_trip): every rank
    gets rank 0's figure, and a new segment's classes start streamed above 200 ns (no cache
    shared), cached below; where ranks outnumber cores no probe (a waiting rank yields to the
    others: the round trip says nothing about the caches), and streamed (the better worst
    case)."""
    every = probe_results()
    if every is None:
        return
    rt, first = every[0]
    ok = (len(set(every)) == 1 and (rt > 0) != oversubscribed()
          and first == ("streamed" if rt > 200 or oversubscribed() else "cached"))
    assert all_ranks_ok(ok), every


def test_the_probe_waits_for_a_late_rank_1():
    """Rank 1 20 ms late to the probe (AL_SHM_TEST_LATE_PROBE), four times the probe's 5 ms:
    rank 0 waits for its first answer and times the round trip from there, so every rank still
    gets a figure (before, no batch completed and the probe said nothing)."""
    if oversubscribed():
        pytest.skip("no probe where ranks outnumber cores")
    every = probe_results({"AL_SHM_TEST_LATE_PROBE": "1"})
    if every is None:
        return
    assert all_ranks_ok(len(set(every)) == 1 and every[0][0] > 0), every


def test_fixed_kinds_are_not_measured(stores):
    """A fixed kind (cached or streamed) leaves the measurements alone."""
    comm = al.Communicator()
    try:
        x = np.ones(1 << 16, np.float32)
        for mode in (CACHED, STREAMED):
            stores(mode)
            for _ in range(4):
                comm.Allreduce(x, np.empty_like(x), algorithm="shm")
        info = _core.shm_info(comm._state)
        assert info is None or info["stores"] == {}
    finally:
        comm.Free()


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
    above 4 KiB written and above one 1 MiB slot; with auto, each measured collective's
    calls are counted."""
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
