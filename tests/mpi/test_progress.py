"""The progress engine: background progress, timeouts, errors raised by Wait.

No assertion depends on elapsed time (these tests run with 4 ranks on 2 cores): ordering is
checked on state (a rank held back behind a gate, ops' phases and pending counts while it is
closed), never on how long something took.  Inputs differ per position, op and rank
(conftest.ramp), and every check goes through all_ranks_ok so all ranks fail together."""
import time

import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import config
from conftest import (WORLD, all_ranks_ok, differences, every_rank, phase, ramp, ramp_reference,
                      wait_for)

pytestmark = pytest.mark.mpi

BIG = 4 << 20   # float32 elements: 16 MiB


def test_progress_while_caller_sleeps(comm):
    """Without any library call, a 16 MiB Iallreduce completes while the caller sleeps."""
    failures = []
    for alg in ("ring", "rabenseifner", "mpi"):       # one op at a time: one input will do
        x = ramp(BIG, 0, comm.rank)
        WORLD.Barrier()
        req = comm.Iallreduce(x, algorithm=alg)
        if not wait_for(lambda: req.done):          # only reads the done flag, and sleeps
            failures.append(f"{alg}: no progress while the caller slept")
        req.Wait(timeout=60)
        failures += differences(alg, x, ramp_reference(BIG, 0, comm.size))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_progress_while_caller_holds_the_gil(comm):
    """A pure-Python busy loop (holding the GIL) does not stop the engine."""
    x = ramp(BIG, 0, comm.rank)
    WORLD.Barrier()
    req = comm.Iallreduce(x, algorithm="ring")
    t0 = time.monotonic()
    spins = 0
    while not req.done and time.monotonic() - t0 < 60:     # 60 s: a hang guard only
        for _ in range(1000):
            spins += 1
    failures = [] if req.done else ["no progress while the caller held the GIL"]
    req.Wait(timeout=60)
    failures += differences("ring", x, ramp_reference(BIG, 0, comm.size))
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("algorithm", ["mpi", "recursive_doubling", "ring"])
def test_wait_timeout_when_peer_never_joins(comm, algorithm):
    """The peers join only after rank 0's Wait timed out (they are held at a barrier), so the
    timeout is certain, not a matter of timing."""
    if comm.size == 1:
        pytest.skip("needs a peer")
    x = ramp(1000, 0, comm.rank, np.float64)
    failures = []
    wait_for(lambda: comm._state.pending == 0)      # ops an earlier test left (none expected)
    WORLD.Barrier()
    if comm.rank == 0:
        req = comm.Iallreduce(x, algorithm=algorithm)
        try:
            req.Wait(timeout=0.3)
            failures.append("Wait returned although no peer had joined")
        except al.TimeoutError as e:
            if "allreduce" not in str(e):
                failures.append(f"TimeoutError does not name the op: {e}")
        if req.Test() or req.done:
            failures.append("complete although no peer had joined")
        if comm._state.pending != 1:
            failures.append(f"pending {comm._state.pending}, expected 1 (the timed-out op)")
    WORLD.Barrier()
    if comm.rank != 0:
        req = comm.Iallreduce(x, algorithm=algorithm)
    req.Wait(timeout=60)            # the timed-out op stayed pending and now completes
    failures += differences("result", x, ramp_reference(1000, 0, comm.size, np.float64))
    if comm._state.pending != 0:
        failures.append(f"pending {comm._state.pending} after completion")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_recv_timeout_then_message_arrives(comm):
    if comm.size == 1:
        pytest.skip("needs a peer")
    buf = np.zeros(10, dtype=np.int32)
    failures = []
    wait_for(lambda: comm._state.pending == 0)      # ops an earlier test left (none expected)
    WORLD.Barrier()
    if comm.rank == 1:
        req = comm.Irecv(buf, source=0, tag=3)
        try:
            req.Wait(timeout=0.2)           # rank 0 sends only after the barrier below
            failures.append("Wait returned before the message was sent")
        except al.TimeoutError:
            pass
        if req.Test() or comm._state.pending != 1 or buf.any():
            failures.append(f"Test {req.Test()}, pending {comm._state.pending}, buf {buf} "
                            f"before the message was sent")
    WORLD.Barrier()
    if comm.rank == 0:
        comm.Send(np.arange(10, dtype=np.int32), dest=1, tag=3)
    if comm.rank == 1:
        req.Wait(timeout=60)
        failures += differences("received", buf, np.arange(10, dtype=np.int32))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_request_times(comm):
    """Request.times: None while pending; then (started, completed) on time.monotonic's clock,
    inside the caller's window, started in call order.  (These compare timestamps the
    library took with each other and with the caller's, in causal order; no check depends on
    how long anything took.)"""
    xs = [ramp(1000 * (k + 1), k, comm.rank) for k in range(4)]
    t0 = time.monotonic()
    reqs = [comm.Iallreduce(x, algorithm=alg)
            for x, alg in zip(xs, ("ring", "mpi", "recursive_doubling", "rabenseifner"))]
    al.Waitall(reqs, timeout=60)
    t1 = time.monotonic()
    failures = []
    for k, (x, r) in enumerate(zip(xs, reqs)):
        failures += differences(f"op {k}", x, ramp_reference(x.size, k, comm.size))
        started, completed = r.times
        if not t0 <= started <= completed <= t1:
            failures.append(f"op {k}: times {r.times} outside the call window ({t0}, {t1})")
    starts = [r.times[0] for r in reqs]
    if starts != sorted(starts):
        failures.append(f"ops started out of call order: {starts}")
    if comm.size > 1:
        buf = np.zeros(4, dtype=np.int32)
        if comm.rank == 1:
            req = comm.Irecv(buf, source=0, tag=5)
            if req.times is not None:       # rank 0 sends only after the barrier
                failures.append(f"times {req.times} while pending")
        WORLD.Barrier()
        if comm.rank == 0:
            comm.Send(np.arange(4, dtype=np.int32), dest=1, tag=5)
        if comm.rank == 1:
            req.Wait(timeout=60)
            if req.times is None:
                failures.append("times None after completion")
            failures += differences("received", buf, np.arange(4, dtype=np.int32))
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("serial", [0, 1 << 20])
def test_large_allreduces_run_one_at_a_time(comm, serial):
    """AL_ENGINE_SERIAL_BYTES: large all-reduces on one communicator start only when the
    previous large one completed, in call order; small ones and other communicators are not
    held back; every result equals numpy's sum over ranks.

    Checked on state, not on time: rank 0 is held at a gate (a barrier on MPI.COMM_WORLD) and
    issues its ops only after the other ranks looked at theirs, so on those ranks no op can
    complete meanwhile (every all-reduce needs rank 0's data).  There, once the engine has
    started the last small op and the other communicator's op (so it has gone past the large
    ones queued before them), each op's phase says what was held back: with serial set, the
    first large op runs and the later large ones are still queued ("new"); without, all run;
    the small ones and the other communicator's run either way."""
    from aluminum_py import _core
    other = al.Communicator(WORLD)
    big = (1 << 20) // 4                          # float32 elements: exactly 1 MiB
    algs = ("ring", "mpi", "rabenseifner", "ring")
    p, gated = comm.size, comm.rank > 0
    failures = []
    try:
        _core.set_serial_bytes(serial)
        xs = [ramp(big * (1 + k % 2), k, comm.rank) for k in range(4)]
        small = [ramp(100, 4 + k, comm.rank, np.float64) for k in range(3)]
        side = ramp(big, 7, comm.rank)
        wait_for(lambda: comm._state.pending == 0)  # ops an earlier test left (none expected)
        WORLD.Barrier()
        if comm.rank == 0:
            WORLD.Barrier()     # the gate: opens when the other ranks have checked their state
        reqs, smalls = [], []
        for k, (x, alg) in enumerate(zip(xs, algs)):
            reqs.append(comm.Iallreduce(x, algorithm=alg))
            if k < len(small):
                smalls.append(comm.Iallreduce(small[k], algorithm="recursive_doubling"))
        side_req = other.Iallreduce(side, algorithm="ring")
        if gated:
            if not wait_for(lambda: all(phase(r) != "new" for r in smalls + [side_req])):
                failures.append("small or other-communicator ops held back behind large ones: "
                                f"{[phase(r) for r in smalls]}, other {phase(side_req)}")
            want = ["running"] + (["new"] * 3 if serial else ["running"] * 3)
            got = [phase(r) for r in reqs]
            if got != want:
                failures.append(f"serial={serial}: large ops {got} while rank 0 held back, "
                                f"expected {want}")
            if (comm._state.pending, other._state.pending) != (7, 1):
                failures.append(f"pending {comm._state.pending}, {other._state.pending} while "
                                f"rank 0 held back, expected 7, 1")
            WORLD.Barrier()     # open the gate
        al.Waitall(reqs + smalls + [side_req], timeout=120)
        for k, x in enumerate(xs):
            failures += differences(f"large {k}", x, ramp_reference(x.size, k, p))
        for k, y in enumerate(small):
            failures += differences(f"small {k}", y, ramp_reference(100, 4 + k, p, np.float64))
        failures += differences("other communicator", side, ramp_reference(big, 7, p))
        if serial:      # causal order of the engine's own timestamps, not a duration
            for k, (a, b) in enumerate(zip(reqs, reqs[1:])):
                if b.times[0] < a.times[1]:
                    failures.append(f"large {k + 1} started before large {k} completed")
    finally:
        _core.set_serial_bytes(config.engine_serial_bytes())
        other.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_large_allreduces_keep_call_order_behind_a_held_mpi_one(comm):
    """A large MPI all-reduce held back behind an ht_mpi op (rank 0's stream is blocked on a
    gate, so its host part cannot start there) must still start before a later large
    all-reduce on the same communicator: else rank 0 runs the ring first and waits for the MPI
    one to finish, while the other ranks run the MPI one first and wait for the ring (a
    deadlock).  Checked on state while the gate is closed: a small probe issued after both
    completes (so rank 0's engine has gone past them), and both large ones are still queued."""
    from aluminum_py import _core
    from aluminum_py import host_transfer as ht
    if comm.size == 1:
        pytest.skip("needs peers")
    other = al.Communicator(WORLD)
    device = ht.CpuDevice()
    stream = device.stream()
    gate = np.zeros(1, dtype=np.uint32)
    big = (1 << 20) // 4                      # float32 elements: exactly 1 MiB
    p = comm.size
    ok = False
    failures = []
    try:
        _core.set_serial_bytes(1 << 20)
        h = ramp(100, 0, comm.rank, np.float64)
        xs = [ramp(big, 1 + k, comm.rank) for k in range(2)]
        probe_in = ramp(10, 3, comm.rank, np.float64)
        WORLD.Barrier()
        if comm.rank == 0:
            stream.wait_value32(_core.addr(gate), 1)    # busy until the test opens the gate
        reqs = [ht.allreduce(other, device, stream, h, algorithm="ht_mpi")]
        reqs.append(other.Iallreduce(xs[0], algorithm="mpi"))
        reqs.append(other.Iallreduce(xs[1], algorithm="ring"))
        probe = other.Iallreduce(probe_in, algorithm="recursive_doubling")  # small: not held
        if comm.rank == 0:
            if not wait_for(lambda: probe.done, 20):
                failures.append("gate closed: the small probe was held back")
            got = [phase(r) for r in reqs]
            if got != ["running", "new", "new"] or other._state.pending != 3:
                failures.append(f"gate closed: ht, mpi, ring ops {got} (expected running, "
                                f"new, new), pending {other._state.pending} (expected 3)")
            gate[0] = 1
        try:
            al.Waitall(reqs + [probe], timeout=20)
            if not stream.synchronize(timeout=20):
                failures.append("the stream did not finish")
        except al.TimeoutError as e:
            failures.append(f"hang: {e}")
        failures += differences("ht_mpi", h, ramp_reference(100, 0, p, np.float64))
        failures += [d for k in range(2)
                     for d in differences(f"large {k}", xs[k], ramp_reference(big, 1 + k, p))]
        failures += differences("probe", probe_in, ramp_reference(10, 3, p, np.float64))
        ok = all_ranks_ok(not failures)
        assert ok, every_rank(failures)
    finally:
        gate[0] = 1
        _core.set_serial_bytes(config.engine_serial_bytes())
        if ok:
            other.Free()


def test_scratch_buffers_are_reused(comm):
    """In-place all-reduces take their scratch from the cache once it holds a buffer of the
    size class: a second round of blocking calls allocates nothing.  Many nonblocking ones in
    flight at once stay correct, and AL_SCRATCH_CACHE=0 frees the cache."""
    from aluminum_py import _core
    if comm.size == 1:
        pytest.skip("one rank needs no scratch")
    xs = [np.zeros(20000 * (1 + k % 6), dtype=np.float64) for k in range(24)]
    failures = []

    def fill(step):         # op k of round `step` has its own input (conftest.ramp)
        for k, x in enumerate(xs):
            x[...] = ramp(x.size, k + 24 * step, comm.rank, np.float64)

    def correct(step):
        bad = [d for k, x in enumerate(xs)
               for d in differences(f"round {step} op {k}", x, ramp_reference(
                   x.size, k + 24 * step, comm.size, np.float64))]
        failures.extend(bad)
        return not bad

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
        assert all_ranks_ok(ok), every_rank(failures + [f"scratch stats {_core.scratch_stats()}"])
    finally:
        _core.set_scratch_cache(config.scratch_cache())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_stream_of_ops_on_two_communicators(comm, seed):
    """A random stream (the same on every rank) of large and small all-reduces of every
    algorithm, AVG and SUM, blocking and nonblocking, on two communicators, with the engine
    holding large ones back: every result equals numpy's, nothing hangs."""
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
            x = ramp(n, k, comm.rank)        # every op's input differs from every other's
            if rng.random() < 0.25:
                c.Allreduce(x, op=op, algorithm=alg)
            else:
                reqs.append(c.Iallreduce(x, op=op, algorithm=alg))
            ops.append((x, k, op, alg))
        al.Waitall(reqs, timeout=120)
        failures = [d for x, k, op, alg in ops
                    for d in differences(f"op {k} {op.name} {alg} n={x.size}", x,
                                         ramp_reference(x.size, k, comm.size, np.float32, op))]
        assert all_ranks_ok(not failures), every_rank(failures)
    finally:
        other.Free()


def test_hang_timeout_on_blocking_call(comm, monkeypatch):
    """AL_HANG_TIMEOUT turns a blocking call whose peers never come into an error; the op stays
    pending in the engine and the communicator keeps call order afterwards."""
    if comm.size == 1:
        pytest.skip("needs a peer")
    x = ramp(100, 0, comm.rank, np.int64)
    failures = []
    wait_for(lambda: comm._state.pending == 0)      # ops an earlier test left (none expected)
    WORLD.Barrier()
    if comm.rank == 0:
        monkeypatch.setenv("AL_HANG_TIMEOUT", "0.3")
        config.reload()
        try:
            comm.Allreduce(x, algorithm="ring")     # the peers come only after the barrier
            failures.append("Allreduce returned although no peer had joined")
        except al.TimeoutError as e:
            if "AL_HANG_TIMEOUT" not in str(e):
                failures.append(f"TimeoutError does not name AL_HANG_TIMEOUT: {e}")
        finally:
            monkeypatch.delenv("AL_HANG_TIMEOUT")
            config.reload()
        if comm._state.pending != 1:
            failures.append(f"pending {comm._state.pending} after the timeout, expected 1 "
                            "(the op stays in the engine)")
    WORLD.Barrier()
    if comm.rank != 0:
        comm.Allreduce(x, algorithm="ring")
    y = ramp(5, 1, comm.rank, np.int64)
    comm.Allreduce(y)                # rank 0: queued behind the adopted op
    if not wait_for(lambda: comm._state.pending == 0):
        failures.append(f"pending {comm._state.pending} after the blocking call behind it")
    failures += differences("second call", y, ramp_reference(5, 1, comm.size, np.int64))
    failures += differences("timed-out call", x, ramp_reference(100, 0, comm.size, np.int64))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_engine_error_is_raised_by_wait(comm):
    """A truncated receive fails inside MPI; Wait raises MPIError; the communicator goes on."""
    if comm.size == 1:
        pytest.skip("needs a peer")
    failures = []
    if comm.rank == 0:
        comm.Send(np.arange(10, dtype=np.int32), dest=1, tag=9)
    elif comm.rank == 1:
        small = np.zeros(5, dtype=np.int32)
        req = comm.Irecv(small, source=0, tag=9)
        try:
            req.Wait(timeout=60)
            failures.append("Wait returned although the message was truncated")
        except al.MPIError as e:
            if "recv" not in str(e):
                failures.append(f"MPIError does not name the receive: {e}")
    x = ramp(3, 0, comm.rank, np.float64)
    comm.Allreduce(x)
    failures += differences("next allreduce", x, ramp_reference(3, 0, comm.size, np.float64))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_dropped_request_keeps_buffers_alive(comm):
    """A Request dropped before completion must not free buffers the engine still writes."""
    import gc
    for k in range(5):      # no reference to the buffers is kept, so no result can be checked
        comm.Iallreduce(ramp(200000, k, comm.rank, np.float64), algorithm="ring")
    gc.collect()
    x = ramp(7, 5, comm.rank, np.float64)
    comm.Allreduce(x)
    failures = differences("next allreduce", x, ramp_reference(7, 5, comm.size, np.float64))
    assert all_ranks_ok(not failures), every_rank(failures)
