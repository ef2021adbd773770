"""The shared-memory allreduce ("shm"): every op x dtype x count (0, 1, odd, larger than a slot)
x in place or not x blocking or not, on the default segment and on one with tiny slots (many
chunks of both protocols), checked against numpy on all ranks' inputs; its order among other
algorithms' nonblocking ops; its hang timeout; its error on a communicator of several nodes.
The kill test (nothing left in /dev/shm) is tests/test_shm_segment.py."""
import os
import threading

import numpy as np
import pytest

import aluminum_py as al
from aluminum_py.testing.internals import (STORES_CACHED, STORES_STREAMED, poll_yield,
                                           set_poll_yield, set_shm_slot_stores,
                                           set_shm_stream_bytes, set_wait_nap, set_wait_spin,
                                           shm_info)
from conftest import (DTYPES, WORLD, all_ranks_ok, every_rank, gather_all, make_input, ramp,
                      ramp_reference, reference, wait_for, differences)
from test_allreduce import matrix_failures, run_allreduce

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

# 65537: above the default symmetric limit (64 KiB) for every dtype, below the 1 MiB slot
SIZES = [0, 1, 7, 1001, 65537]
TINY = {"AL_SHM_SLOT_BYTES": "4096", "AL_SHM_SMALL_BYTES": "1024"}
TINY_SIZES = [5, 300, 1025, 9001]     # both protocols, up to 18 chunks of 4 KiB (8-byte dtypes)


def with_env(env, make):
    """`make()` with the environment variables `env` set (restored after)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    al.config.reload()
    try:
        return make()
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
        al.config.reload()


@pytest.fixture(scope="module")
def tiny():
    """A communicator whose segment has 4 KiB slots and a 1 KiB symmetric limit (both set on
    every rank; rank 0's are the ones used)."""
    c = with_env(TINY, al.Communicator)
    yield c
    c.Free()


def test_listed_and_a_candidate():
    assert "shm" in al.algorithms("allreduce", "host")
    assert "shm" not in al.algorithms("allreduce", "cuda")
    from aluminum_py.algorithms import HOST_CANDIDATES, ONE_NODE
    assert "shm" in HOST_CANDIDATES and ONE_NODE == ("shm",)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matrix(comm, dtype):
    failures = matrix_failures(comm, "shm", [dtype], SIZES)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64", "complex128"])
def test_matrix_tiny_slots(tiny, dtype):
    """Counts above the slot: many chunks, both protocols, uneven last chunks and blocks."""
    info = shm_info(tiny._state)
    if tiny.size > 1:
        assert (info["slot"], info["small"]) == (4096, 1024)
    failures = matrix_failures(tiny, "shm", [dtype], TINY_SIZES)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_rounds_of_rank_0s_chunk():
    """A split allreduce under the size from which recvbuf is streamed runs in rounds of rank
    0's AL_SHM_CHUNK_BYTES (the others set another), larger ones a slot per round; every rank
    makes the same rounds and gets the exact result, for every dtype, uneven last rounds and
    blocks on both sides of the limit."""
    env = {"AL_SHM_SLOT_BYTES": "16384", "AL_SHM_SMALL_BYTES": "1024",
           "AL_SHM_CHUNK_BYTES": "4096" if WORLD.rank == 0 else "8192"}
    set_shm_stream_bytes(32768)          # rank 0's at the setup is the limit
    try:
        c = with_env(env, al.Communicator)
    finally:
        set_shm_stream_bytes(al.config.shm_stream_bytes())
    try:
        if c.size < 2:
            pytest.skip("no segment at one rank")
        info = shm_info(c._state)
        failures = [] if (info["chunk"], info["chunk_upto"]) == (4096, 32768) else [
            f"chunk {info['chunk']}, up to {info['chunk_upto']}"]
        for count, rounds in ((4000, 4), (8191, 8), (8192, 2), (10001, 3)):   # float32
            x = np.full(count, c.rank + 1, np.float32)
            before = shm_info(c._state)["rounds"]
            c.Allreduce(x, algorithm="shm")
            got = shm_info(c._state)["rounds"] - before
            if got != rounds or not np.all(x == c.size * (c.size + 1) // 2):
                failures.append(f"{count} float32: {got} rounds (expected {rounds}), "
                                f"result {x[:3]}")
        failures += matrix_failures(c, "shm", ["int8", "float32", "complex128"],
                                    [300, 2049, 4095, 9001])
        assert all_ranks_ok(not failures), every_rank(failures)
    finally:
        c.Free()


@pytest.fixture
def streaming():
    """Every split-protocol allreduce of this process writes recvbuf with streaming stores
    (al_shm.h; AL_SHM_STREAM_BYTES=0) until the test ends."""
    set_shm_stream_bytes(0)
    yield
    set_shm_stream_bytes(al.config.shm_stream_bytes())


@pytest.mark.parametrize("dtype", DTYPES)
def test_streaming_matrix(tiny, streaming, dtype):
    """The streaming path, every dtype and op (AVG included) in place and not, blocking and
    not: many rounds of 4 KiB slots, uneven last chunks and blocks."""
    failures = matrix_failures(tiny, "shm", [dtype], [1025, 9001])
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("stores", [STORES_CACHED, STORES_STREAMED])
@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "complex128"])
def test_both_slot_stores_streamed_recvbuf(tiny, streaming, stores, dtype):
    """Slots written with ordinary or streaming stores, recvbuf streamed: every op, many rounds
    of 4 KiB slots, each reduced in 2 KiB tiles (AL_SHM_TILE), the last one short."""
    set_shm_slot_stores(stores)
    try:
        failures = matrix_failures(tiny, "shm", [dtype], [1025, 9001])
    finally:
        set_shm_slot_stores(al.config.shm_slot_stores())
    assert all_ranks_ok(not failures), every_rank(failures)


GUARD = 6                              # elements around each buffer that must stay untouched


def misaligned(dtype, n, offset, fill):
    """A view of n elements `offset` elements into a larger array filled with `fill`, and that
    array (to check the guard elements on both sides)."""
    base = np.full(n + 2 * GUARD, fill, dtype=dtype)
    return base[GUARD + offset - 3:][:n], base


@pytest.mark.parametrize("comm_name", ["default", "tiny"])
def test_streaming_unaligned(comm, tiny, streaming, comm_name):
    """Buffers at odd element offsets (sendbuf and recvbuf misaligned differently), counts that
    are no multiple of 16 or 64 bytes, in place and not: every element right, no byte written
    outside recvbuf (a wrong head or tail length in the streaming copy fails here)."""
    c = comm if comm_name == "default" else tiny
    failures = []
    counts = [70001, 65539] if comm_name == "default" else [1031, 4099]
    for dtype, op in (("int8", al.BXOR), ("float16", al.SUM), ("float32", al.AVG),
                      ("float64", al.MAX), ("complex128", al.PROD)):
        for n in counts:
            x = make_input(dtype, op, n, seed=n, rank=c.rank)
            expected = reference(op, gather_all(x), c.size)
            for soff, roff in ((4, 3), (3, 5), (5, 5)):
                what = f"{dtype} {op.name} n={n} offsets {soff - 3},{roff - 3}"
                src, sbase = misaligned(dtype, n, soff, 0)
                src[:] = x
                out, rbase = misaligned(dtype, n, roff, 0)
                before = rbase.copy()
                c.Allreduce(src, out, op=op, algorithm="shm")
                failures += differences(what, out, expected)
                rbase[GUARD + roff - 3:][:n] = before[GUARD + roff - 3:][:n]
                if not np.array_equal(rbase, before):
                    failures.append(f"{what}: wrote outside recvbuf")
                buf, base = misaligned(dtype, n, soff, 0)
                buf[:] = x
                c.Allreduce(buf, op=op, algorithm="shm")
                failures += differences(what + " in place", buf, expected)
                base[GUARD + soff - 3:][:n] = 0
                if base.any():
                    failures.append(f"{what} in place: wrote outside the buffer")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_streaming_threshold(comm):
    """Allreduces just below, at and above AL_SHM_STREAM_BYTES (256 KiB here): the ordinary and
    the streaming path side by side, in place and not."""
    set_shm_stream_bytes(256 << 10)
    failures = []
    try:
        for k, n in enumerate((65535, 65536, 65537)):
            x = ramp(n, k, comm.rank)
            for inplace in (False, True):
                got = run_allreduce(comm, x, al.SUM, "shm", inplace, not inplace, failures)
                failures += differences(f"n={n} inplace={inplace}", got,
                                        ramp_reference(n, k, comm.size))
    finally:
        set_shm_stream_bytes(al.config.shm_stream_bytes())
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("spin", [-1.0, 0.0, 5e-6])
def test_wait_policy_with_late_ranks(comm, spin):
    """Blocking shm allreduces of both protocols (and a ring one, an MPI wait) whose ranks
    arrive 20 ms apart, in turn: the waiting ranks spin (AL_WAIT_SPIN < 0), yield at once (0)
    or spin then yield (the default, 5 us) through wait_poll, and every result is right."""
    import time
    set_wait_spin(spin)
    failures = []
    try:
        for k, (n, algorithm) in enumerate(((300, "shm"), (300001, "shm"), (5000, "ring"))):
            x = ramp(n, k, comm.rank)
            WORLD.Barrier()
            if comm.rank == k % comm.size:
                time.sleep(0.02)
            comm.Allreduce(x, algorithm=algorithm)
            failures += differences(f"{algorithm} n={n} spin={spin}", x,
                                    ramp_reference(n, k, comm.size))
    finally:
        set_wait_spin(al.config.wait_spin())
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("n", [300, 300001])            # symmetric, split
def test_an_oversubscribed_wait_for_a_late_rank_sleeps(comm, n):
    """Where ranks outnumber cores (AL_ENGINE_YIELD's rule, forced here), a blocking shm
    allreduce whose last rank arrives late: the others wait on its flags, yielding for
    AL_WAIT_NAP (1 ms here), then sleeping between polls, so they leave the cores to the late
    rank and whatever else runs, and the result is right.  The evidence is the waiting
    thread's voluntary context switches in the call (getrusage): each nap is one; a wait that
    only yields makes none (3 and 4 ranks: about 1100 sleeping in 0.3 s, 0 yielding).  The
    late rank is held by what it waits for, not by a clock: it reads the waiting threads'
    counts (/proc) and joins once each has slept NAPS times in the call (or after a 60 s hang
    guard, and then the count fails)."""
    import resource
    if comm.size < 2:
        pytest.skip("no peer to wait for")
    late = comm.size - 1
    every = poll_yield()
    set_poll_yield(1)
    set_wait_nap(1e-3)
    failures = []
    try:
        x = ramp(n, 5, comm.rank)
        waiters = WORLD.allgather((os.getpid(), threading.get_native_id()))[:late]
        WORLD.Barrier()
        if comm.rank == late:
            first = [switches(*w) for w in waiters]
            wait_for(lambda: all(switches(*w) - f >= NAPS for w, f in zip(waiters, first)))
        naps = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
        comm.Allreduce(x, algorithm="shm")
        naps = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - naps
        failures += differences(f"n={n}", x, ramp_reference(n, 5, comm.size))
        if comm.rank != late and naps < NAPS:
            failures.append(f"rank {comm.rank} slept {naps} times waiting for rank {late} "
                            f"(expected {NAPS} or more)")
    finally:
        set_poll_yield(every)
        set_wait_nap(al.config.wait_nap())
    assert all_ranks_ok(not failures), every_rank(failures)


NAPS = 100      # the naps a waiting rank makes before the late rank joins


def switches(pid: int, tid: int) -> int:
    """The voluntary context switches of thread `tid` of process `pid` so far (what getrusage's
    ru_nvcsw reads in the thread itself)."""
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        return next(int(line.split()[1]) for line in f
                    if line.startswith("voluntary_ctxt_switches:"))


def test_streaming_starts_where_the_ranks_buffers_fill_the_cache(comm):
    """Unset AL_SHM_STREAM_BYTES: recvbuf is streamed from the size whose sendbufs and recvbufs
    on every rank (2 x ranks x bytes) fill the last-level cache (8 MiB at 2 ranks with a
    32 MiB L3); a value given is used as it is."""
    if comm.size < 2:
        pytest.skip("no segment at one rank")
    cache = al.config.last_level_cache_bytes()
    try:
        set_shm_stream_bytes(None, cache)
        got = shm_info(comm._state)["stream_from"]
        set_shm_stream_bytes(3 << 20)
        given = shm_info(comm._state)["stream_from"]
    finally:
        set_shm_stream_bytes(al.config.shm_stream_bytes())
    failures = [] if got == cache // (2 * comm.size) else [f"by the cache: {got}"]
    failures += [] if given == 3 << 20 else [f"given 3 MiB: {given}"]
    assert all_ranks_ok(not failures), every_rank(failures)


def test_large(comm):
    """4 Mi + 5 float32 (16 MiB: 16 chunks of the default 1 MiB slot), in place and out."""
    n = (4 << 20) + 5
    x = ramp(n, 3, comm.rank)
    failures = []
    for inplace in (False, True):
        got = run_allreduce(comm, x, al.SUM, "shm", inplace, not inplace, failures)
        failures += differences(f"inplace={inplace}", got, ramp_reference(n, 3, comm.size))
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("n", [1000, 100003])        # symmetric, split
def test_results_identical_on_all_ranks(comm, n):
    """Arbitrary floats (rounding differs with the order): every rank holds the same bits."""
    rng = np.random.default_rng(comm.rank + 17)
    x = rng.standard_normal(n)
    exact = np.sum(gather_all(x), axis=0)
    comm.Allreduce(x, algorithm="shm")
    stack = gather_all(x)
    failures = [f"rank {r} differs from rank 0 at {np.flatnonzero(s != stack[0])[:5]}"
                for r, s in enumerate(stack) if not np.array_equal(stack[0], s)]
    if not np.allclose(x, exact, rtol=1e-12, atol=1e-12):
        failures.append(f"rank {comm.rank}: not the sum")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_nonblocking_interleaved_with_other_algorithms(comm):
    """Nonblocking shm ops between other algorithms' on one communicator, sizes of both
    protocols, then a blocking shm call queued behind them: each lands in its own buffer."""
    algs = ["shm", "ring", "shm", "mpi", "shm", "recursive_doubling"]
    xs = [ramp((37 if i % 3 else 30011) + i, i, comm.rank) for i in range(24)]
    reqs = [comm.Iallreduce(x, algorithm=algs[i % len(algs)]) for i, x in enumerate(xs)]
    y = ramp(5000, 99, comm.rank)
    comm.Allreduce(y, algorithm="shm")
    al.Waitall(reqs, timeout=60)
    failures = differences("blocking shm behind them", y, ramp_reference(5000, 99, comm.size))
    for i, (x, req) in enumerate(zip(xs, reqs)):
        failures += differences(f"op {i} ({algs[i % len(algs)]})", x,
                                ramp_reference(x.size, i, comm.size))
        if req.algorithm != algs[i % len(algs)]:
            failures.append(f"op {i}: req.algorithm {req.algorithm!r}")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_blocking_after_nonblocking_keeps_order(comm):
    """Some ranks let their nonblocking shm op finish before the blocking one (it runs inline),
    others still have it pending (it queues in the engine): both orders match."""
    failures = []
    for it in range(20):
        x = ramp(3000 + 7 * it, 2 * it, comm.rank)
        y = ramp(11, 2 * it + 1, comm.rank)
        req = comm.Iallreduce(x, algorithm="shm")
        if (comm.rank + it) % 2:
            req.Wait(timeout=60)
        comm.Allreduce(y, algorithm="shm")
        req.Wait(timeout=60)
        failures += differences(f"it {it} nonblocking", x,
                                ramp_reference(x.size, 2 * it, comm.size))
        failures += differences(f"it {it} blocking", y, ramp_reference(11, 2 * it + 1, comm.size))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_two_communicators(comm, tiny):
    """Two segments progressed together by the engine (one of them chunked)."""
    a = ramp(20000, 5, comm.rank)
    b = ramp(3001, 6, comm.rank, np.float64)
    ra = comm.Iallreduce(a, algorithm="shm")
    rb = tiny.Iallreduce(b, algorithm="shm")
    rb.Wait(timeout=60)
    ra.Wait(timeout=60)
    failures = (differences("comm", a, ramp_reference(20000, 5, comm.size))
                + differences("tiny", b, ramp_reference(3001, 6, comm.size, np.float64)))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_segment_made_with_the_communicator_and_freed():
    c = al.Communicator()
    info = shm_info(c._state)
    failures = []
    if (info is None) != (c.size == 1) or (info and info["rounds"] != 0):
        failures.append(f"segment of a new communicator: {info}")
    x = ramp(100, 1, c.rank)
    c.Allreduce(x, algorithm="shm")
    info = shm_info(c._state)
    failures += differences("first op", x, ramp_reference(100, 1, c.size))
    if c.size > 1 and (info is None or info["rounds"] != 1):
        failures.append(f"segment after one op: {info}")
    c.Free()
    if shm_info(c._state) is not None:
        failures.append("segment still mapped after Free")
    assert all_ranks_ok(not failures), every_rank(failures)


def late_peers(c, call, name: str) -> list:
    """Rank 0 runs `call()` (an shm op named `name`) under a 0.3 s hang timeout, the other
    ranks join only after it gave up: failure messages unless rank 0 got the hang-timeout error
    naming the op and a rank it waits for, and the op then completed in the engine."""
    err = None
    if c.rank == 0:
        try:
            with_env({"AL_HANG_TIMEOUT": "0.3"}, call)
        except al.TimeoutError as e:
            err = str(e)
    WORLD.Barrier()
    if c.rank != 0:
        call()
    failures = []
    if c.rank == 0:
        if err is None or name not in err or "has not published" not in err:
            failures.append(f"timeout error: {err!r}")
        if not wait_for(lambda: c._state.pending == 0):
            failures.append("the timed-out op did not complete after the peers joined")
    return failures


def test_hang_timeout_names_the_missing_rank():
    """Rank 0 calls an shm allreduce the others join only later: it raises the hang-timeout
    error naming a rank it waits for; the op goes on in the engine and completes once they
    join."""
    if WORLD.Get_size() < 2:
        pytest.skip("needs a peer")
    c = al.Communicator()
    c.Allreduce(np.ones(4, np.float32), algorithm="shm")        # the segment exists
    x = ramp(1000, 7, c.rank)
    failures = late_peers(c, lambda: c.Allreduce(x, algorithm="shm"), "allreduce/shm")
    failures += differences("late op", x, ramp_reference(1000, 7, c.size))
    y = ramp(10, 8, c.rank)
    c.Allreduce(y, algorithm="shm")                              # the segment still works
    failures += differences("next op", y, ramp_reference(10, 8, c.size))
    c.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_opposite_orders_on_two_communicators():
    """Nonblocking shm ops on two communicators, issued in opposite orders on neighbouring
    ranks (each communicator's own order is the same everywhere): no rank waits for another."""
    c1, c2 = al.Communicator(), al.Communicator()
    r, p = c1.rank, c1.size
    a, b = ramp(999, 1, r), ramp(70001, 2, r)
    if r % 2 == 0:
        reqs = [c1.Iallreduce(a, algorithm="shm"), c2.Iallreduce(b, algorithm="shm")]
    else:
        reqs = [c2.Iallreduce(b, algorithm="shm"), c1.Iallreduce(a, algorithm="shm")]
    al.Waitall(reqs, timeout=60)
    failures = (differences("c1", a, ramp_reference(999, 1, p))
                + differences("c2", b, ramp_reference(70001, 2, p)))
    c1.Free()
    c2.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_disabled_is_a_clear_error():
    """AL_SHM_SLOT_BYTES=0: no segment; shm raises saying so, auto leaves it out."""
    c = with_env({"AL_SHM_SLOT_BYTES": "0"}, al.Communicator)
    try:
        if c.size > 1:
            with pytest.raises(al.UnavailableError, match=r"'shm'.*AL_SHM_SLOT_BYTES=0"):
                c.Allreduce(np.ones(3, np.float32), algorithm="shm")
            assert "shm" not in c._host.candidates
    finally:
        c.Free()


def test_several_nodes_is_a_clear_error():
    """On a communicator whose ranks span nodes (forced with AL_NODE_LAYOUT): shm raises
    UnavailableError saying why, on every rank, before any communication; auto never picks it."""
    p = WORLD.Get_size()
    if p < 2:
        pytest.skip("one rank is one node")
    layout = ",".join(str(r % 2) for r in range(p))
    c = with_env({"AL_NODE_LAYOUT": layout}, al.Communicator)
    try:
        with pytest.raises(al.UnavailableError, match=r"'shm'.*on 2 nodes.*one node"):
            c.Allreduce(np.ones(3, np.float32), algorithm="shm")
        assert "shm" not in c._host.candidates and "shm" not in c._host.chooser.usable
        x = ramp(50, 2, c.rank)
        c.Allreduce(x)                                           # still usable
        assert not differences("after", x, ramp_reference(50, 2, p))
    finally:
        c.Free()


def test_avg_is_divided_once(comm):
    """AVG of float32 at both protocols and at a chunked size: the sum over ranks / p."""
    failures = []
    for n in (3, 20000, 300001):
        x = make_input("float32", al.AVG, n, seed=n, rank=comm.rank)
        expected = reference(al.AVG, gather_all(x), comm.size)
        out = np.empty_like(x)
        comm.Allreduce(x, out, op=al.AVG, algorithm="shm")
        failures += differences(f"AVG n={n}", out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)
