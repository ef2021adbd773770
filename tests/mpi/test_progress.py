"""The progress engine: background progress, timeouts, errors raised by Wait."""
import os
import time

import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import config
from conftest import WORLD

pytestmark = pytest.mark.mpi

BIG = 4 << 20   # float32 elements: 16 MiB


def test_progress_while_caller_sleeps(comm):
    """Without any library call, a 16 MiB Iallreduce completes while the caller sleeps."""
    for alg in ("ring", "rabenseifner", "mpi"):
        x = np.full(BIG, comm.rank + 1, dtype=np.float32)
        WORLD.Barrier()
        req = comm.Iallreduce(x, algorithm=alg)
        deadline = time.monotonic() + 60
        while not req.done and time.monotonic() < deadline:
            time.sleep(0.005)
        assert req.done, f"{alg}: no progress while the caller slept"
        req.Wait(timeout=1)
        assert np.all(x == sum(range(1, comm.size + 1)))


def test_progress_while_caller_holds_the_gil(comm):
    """A pure-Python busy loop (holding the GIL) does not stop the engine."""
    x = np.full(BIG, 1.0, dtype=np.float32)
    WORLD.Barrier()
    req = comm.Iallreduce(x, algorithm="ring")
    t0 = time.monotonic()
    spins = 0
    while not req.done and time.monotonic() - t0 < 60:
        for _ in range(1000):
            spins += 1
    assert req.done
    req.Wait(timeout=1)
    assert np.all(x == comm.size)


@pytest.mark.parametrize("algorithm", ["mpi", "recursive_doubling", "ring"])
def test_wait_timeout_when_peer_never_joins(comm, algorithm):
    if comm.size == 1:
        pytest.skip("needs a peer")
    x = np.full(1000, comm.rank + 1.0)
    if comm.rank == 0:
        req = comm.Iallreduce(x, algorithm=algorithm)
        with pytest.raises(al.TimeoutError, match="allreduce"):
            req.Wait(timeout=0.3)
        assert not req.Test()
    WORLD.Barrier()
    if comm.rank != 0:
        req = comm.Iallreduce(x, algorithm=algorithm)
    req.Wait(timeout=60)            # the timed-out op stayed pending and now completes
    assert np.all(x == sum(range(1, comm.size + 1)))


def test_recv_timeout_then_message_arrives(comm):
    if comm.size == 1:
        pytest.skip("needs a peer")
    buf = np.zeros(10, dtype=np.int32)
    if comm.rank == 1:
        req = comm.Irecv(buf, source=0, tag=3)
        with pytest.raises(al.TimeoutError):
            req.Wait(timeout=0.2)
    WORLD.Barrier()
    if comm.rank == 0:
        comm.Send(np.arange(10, dtype=np.int32), dest=1, tag=3)
    if comm.rank == 1:
        req.Wait(timeout=60)
        assert np.array_equal(buf, np.arange(10))


def test_request_times(comm):
    """Request.times: None while pending; then (started, completed) on time.monotonic's clock,
    inside the caller's window, started in call order."""
    xs = [np.full(1000 * (k + 1), comm.rank + k, dtype=np.float32) for k in range(4)]
    t0 = time.monotonic()
    reqs = [comm.Iallreduce(x, algorithm=alg)
            for x, alg in zip(xs, ("ring", "mpi", "recursive_doubling", "rabenseifner"))]
    al.Waitall(reqs, timeout=60)
    t1 = time.monotonic()
    for k, (x, r) in enumerate(zip(xs, reqs)):
        assert np.all(x == sum(rank + k for rank in range(comm.size)))
        started, completed = r.times
        assert t0 <= started <= completed <= t1
    starts = [r.times[0] for r in reqs]
    assert starts == sorted(starts)
    if comm.size > 1:
        buf = np.zeros(4, dtype=np.int32)
        if comm.rank == 1:
            req = comm.Irecv(buf, source=0, tag=5)
            assert req.times is None
        WORLD.Barrier()
        if comm.rank == 0:
            comm.Send(np.arange(4, dtype=np.int32), dest=1, tag=5)
        if comm.rank == 1:
            req.Wait(timeout=60)
            assert req.times is not None and np.array_equal(buf, np.arange(4))


@pytest.mark.parametrize("serial", [0, 1 << 20])
def test_large_allreduces_run_one_at_a_time(comm, serial):
    """AL_ENGINE_SERIAL_BYTES: large all-reduces on one communicator start only when the
    previous large one completed, in call order; small ones and other communicators are not
    held back; every result equals numpy's sum over ranks."""
    from aluminum_py import _core
    other = al.Communicator(WORLD)
    big = (1 << 20) // 4                          # float32 elements: exactly 1 MiB
    algs = ("ring", "mpi", "rabenseifner", "ring")
    try:
        _core.set_serial_bytes(serial)
        xs = [np.full(big * (1 + k % 2), comm.rank + k, dtype=np.float32) for k in range(4)]
        small = [np.full(100, comm.rank * 3 + k, dtype=np.float64) for k in range(3)]
        side = np.full(big, comm.rank + 10, dtype=np.float32)
        WORLD.Barrier()
        if comm.rank == 0:
            time.sleep(0.3)     # the other ranks' first large all-reduce cannot complete yet
        reqs, smalls = [], []
        for k, (x, alg) in enumerate(zip(xs, algs)):
            reqs.append(comm.Iallreduce(x, algorithm=alg))
            if k < len(small):
                smalls.append(comm.Iallreduce(small[k], algorithm="recursive_doubling"))
        side_req = other.Iallreduce(side, algorithm="ring")
        al.Waitall(reqs + smalls + [side_req], timeout=120)
        for k, x in enumerate(xs):
            assert np.all(x == sum(r + k for r in range(comm.size)))
        for k, y in enumerate(small):
            assert np.all(y == sum(r * 3 + k for r in range(comm.size)))
        assert np.all(side == sum(r + 10 for r in range(comm.size)))
        if serial:
            for a, b in zip(reqs, reqs[1:]):
                assert b.times[0] >= a.times[1], "a large all-reduce started before the previous one completed"
        if serial and comm.rank > 0:
            # the small one was not held back behind the large ones
            assert smalls[0].times[0] < reqs[0].times[1]
    finally:
        _core.set_serial_bytes(config.engine_serial_bytes())
        other.Free()


def test_large_allreduces_keep_call_order_behind_a_held_mpi_one(comm):
    """A large MPI all-reduce held back behind an ht_mpi op (rank 0's stream is busy, so its
    host part starts late there) must still start before a later large all-reduce on the same
    communicator: else rank 0 runs the ring first and waits for the MPI one to finish, while
    the other ranks run the MPI one first and wait for the ring (a deadlock)."""
    from conftest import all_ranks_ok
    from aluminum_py import _core
    from aluminum_py import host_transfer as ht
    if comm.size == 1:
        pytest.skip("needs peers")
    other = al.Communicator(WORLD)
    device = ht.CpuDevice()
    stream = device.stream()
    big = (1 << 20) // 4                      # float32 elements: exactly 1 MiB
    ok = False
    try:
        _core.set_serial_bytes(1 << 20)
        h = np.full(100, comm.rank + 1.0)
        xs = [np.full(big, comm.rank + k, dtype=np.float32) for k in range(2)]
        WORLD.Barrier()
        if comm.rank == 0:
            stream.delay(1.0)
        reqs = [ht.allreduce(other, device, stream, h, algorithm="ht_mpi")]
        if comm.rank > 0:
            time.sleep(0.3)     # here the ht op's MPI all-reduce has started
        reqs.append(other.Iallreduce(xs[0], algorithm="mpi"))
        reqs.append(other.Iallreduce(xs[1], algorithm="ring"))
        try:
            al.Waitall(reqs, timeout=20)
            ok = (stream.synchronize(timeout=20) and np.all(h == sum(r + 1.0 for r in range(comm.size)))
                  and all(np.all(x == sum(r + k for r in range(comm.size))) for k, x in enumerate(xs)))
        except al.TimeoutError:
            ok = False
        assert all_ranks_ok(ok)
    finally:
        _core.set_serial_bytes(config.engine_serial_bytes())
        if ok:
            other.Free()


def test_scratch_buffers_are_reused(comm):
    """In-place all-reduces take their scratch from the cache once it holds a buffer of the
    size class: a second round of blocking calls allocates nothing.  Many nonblocking ones in
    flight at once stay correct, and AL_SCRATCH_CACHE=0 frees the cache."""
    from conftest import all_ranks_ok
    from aluminum_py import _core
    if comm.size == 1:
        pytest.skip("one rank needs no scratch")
    xs = [np.zeros(20000 * (1 + k % 6), dtype=np.float64) for k in range(24)]

    def fill(step):
        for k, x in enumerate(xs):
            x[...] = comm.rank + k + step

    def correct(step):
        return all(np.all(x == sum(r + k + step for r in range(comm.size)))
                   for k, x in enumerate(xs))

    try:
        # 24 buffers of one class held at once, twice: the second time all come from the cache
        _core._scratch_roundtrip([300000] * 24)
        before = _core.scratch_stats()
        _core._scratch_roundtrip([300000] * 24)
        ok = _core.scratch_stats()["allocs"] == before["allocs"]
        fill(0)
        for x in xs:
            comm.Allreduce(x, algorithm="ring")
        ok = ok and correct(0)
        before = _core.scratch_stats()
        fill(1)
        for x in xs:
            comm.Allreduce(x, algorithm="ring")
        after = _core.scratch_stats()
        ok = ok and correct(1) and after["allocs"] == before["allocs"] \
            and after["reuses"] >= before["reuses"] + len(xs)
        fill(2)
        al.Waitall([comm.Iallreduce(x, algorithm="ring") for x in xs], timeout=60)
        ok = ok and correct(2)
        _core.set_scratch_cache(0)
        ok = ok and _core.scratch_stats()["cached"] == 0
        fill(3)
        al.Waitall([comm.Iallreduce(x, algorithm="ring") for x in xs], timeout=60)
        ok = ok and correct(3) and _core.scratch_stats()["cached"] == 0
        assert all_ranks_ok(ok)
    finally:
        _core.set_scratch_cache(config.scratch_cache())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_stream_of_ops_on_two_communicators(comm, seed):
    """A random stream (the same on every rank) of large and small all-reduces of every
    algorithm, AVG and SUM, blocking and nonblocking, on two communicators, with the engine
    holding large ones back: every result equals numpy's, nothing hangs."""
    from conftest import all_ranks_ok
    other = al.Communicator(WORLD)
    rng = np.random.default_rng(seed)
    comms = (comm, other)
    ops, reqs = [], []
    try:
        for k in range(40):
            n = int(rng.choice([7, 1000, (1 << 20) // 4, (3 << 20) // 8]))
            alg = str(rng.choice(["mpi", "ring", "rabenseifner", "recursive_doubling", "auto"]))
            op = al.AVG if rng.random() < 0.5 else al.SUM
            c = comms[int(rng.integers(2))]
            x = np.full(n, float(comm.rank + k % 5), dtype=np.float32)
            if rng.random() < 0.25:
                c.Allreduce(x, op=op, algorithm=alg)
            else:
                reqs.append(c.Iallreduce(x, op=op, algorithm=alg))
            ops.append((x, k, op))
        al.Waitall(reqs, timeout=120)
        ok = True
        for x, k, op in ops:
            total = sum(r + k % 5 for r in range(comm.size))
            ok = ok and bool(np.all(x == np.float32(total) / np.float32(comm.size if op is al.AVG else 1)))
        assert all_ranks_ok(ok)
    finally:
        other.Free()


def test_hang_timeout_on_blocking_call(comm, monkeypatch):
    """AL_HANG_TIMEOUT turns a blocking call whose peers never come into an error; the op stays
    pending in the engine and the communicator keeps call order afterwards."""
    if comm.size == 1:
        pytest.skip("needs a peer")
    x = np.full(100, comm.rank + 1, dtype=np.int64)
    if comm.rank == 0:
        monkeypatch.setenv("AL_HANG_TIMEOUT", "0.3")
        config.reload()
        try:
            with pytest.raises(al.TimeoutError, match="AL_HANG_TIMEOUT"):
                comm.Allreduce(x, algorithm="ring")
        finally:
            monkeypatch.delenv("AL_HANG_TIMEOUT")
            config.reload()
    WORLD.Barrier()
    if comm.rank != 0:
        comm.Allreduce(x, algorithm="ring")
    y = np.full(5, 1, dtype=np.int64)
    comm.Allreduce(y)                # rank 0: queued behind the adopted op
    assert np.all(y == comm.size)
    assert np.all(x == sum(range(1, comm.size + 1)))


def test_engine_error_is_raised_by_wait(comm):
    """A truncated receive fails inside MPI; Wait raises MPIError; the communicator goes on."""
    if comm.size == 1:
        pytest.skip("needs a peer")
    if comm.rank == 0:
        comm.Send(np.arange(10, dtype=np.int32), dest=1, tag=9)
    elif comm.rank == 1:
        small = np.zeros(5, dtype=np.int32)
        req = comm.Irecv(small, source=0, tag=9)
        with pytest.raises(al.MPIError) as info:
            req.Wait(timeout=60)
        assert "recv" in str(info.value)
    x = np.ones(3)
    comm.Allreduce(x)
    assert np.all(x == comm.size)


def test_dropped_request_keeps_buffers_alive(comm):
    """A Request dropped before completion must not free buffers the engine still writes."""
    import gc
    for _ in range(5):
        comm.Iallreduce(np.ones(200000, dtype=np.float64), algorithm="ring")
    gc.collect()
    x = np.ones(7)
    comm.Allreduce(x)
    assert np.all(x == comm.size)
