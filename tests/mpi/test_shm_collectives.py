"""allgather, bcast, reduce_scatter and barrier over the shared-memory segment
(``algorithm="shm"``): every dtype for allgather and bcast (every root), reduce_scatter with every
op of several dtypes, counts 0, 1, odd and larger than a slot (the 4 KiB slots of test_shm's
`tiny` communicator), in place and not, blocking and nonblocking, interleaved with allreduce
ops; results against numpy from every rank's inputs and identical on every rank; the hang
timeout; the errors (bad name, no segment, GPU buffers; every bad argument of
test_bad_input.py raises what the "mpi" path raises); data at the edge of the flag line's
inline area; bcast's lazy arrive (a root that runs ahead of late peers, back to back, with
roots and counts that change); the GIL released by a blocking call that waits."""
import os
import threading
import time

import numpy as np
import pytest

import aluminum_py as al
from conftest import (DTYPES, WORLD, all_ranks_ok, differences, every_rank, gather_all,
                      make_input, ops_for, ramp, ramp_reference, reference, wait_for)
from test_bad_input import CASES, FakeGPUArray
from test_shm import late_peers, tiny, with_env  # noqa: F401  (tiny: the 4 KiB-slot communicator fixture)

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

COUNTS = [0, 1, 7, 1001]
TINY_COUNTS = [1, 5, 1025, 9001]     # 9001 int8 .. complex128: 3 .. 36 chunks of a 4 KiB slot


def comms_and_counts(comm, tiny):
    return [("default", comm, COUNTS), ("tiny", tiny, TINY_COUNTS)]


def same_everywhere(what, x) -> list:
    """[] if `x` is bit for bit the same on every rank."""
    rows = gather_all(x).view(np.uint8)
    return [] if all(np.array_equal(rows[0], r) for r in rows) else [f"{what}: ranks differ"]


def finish(req, blocking):
    if not blocking:
        req.Wait(timeout=60)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather(comm, tiny, dtype):
    failures = []
    for label, c, counts in comms_and_counts(comm, tiny):
        for n in counts:
            x = make_input(dtype, al.SUM, n, seed=11, rank=c.rank)
            expected = gather_all(x).reshape(-1)
            for inplace in (False, True):
                for blocking in (True, False):
                    what = f"{label} n={n} inplace={inplace} blocking={blocking}"
                    if inplace:
                        out = np.zeros(n * c.size, x.dtype)
                        out[c.rank * n:(c.rank + 1) * n] = x
                        args = (out,)
                    else:
                        out = np.zeros(n * c.size, x.dtype)
                        args = (x, out)
                    f = c.Allgather if blocking else c.Iallgather
                    finish(f(*args, algorithm="shm"), blocking)
                    failures += differences(what, out, expected)
                    failures += same_everywhere(what, out)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bcast_every_root(comm, tiny, dtype):
    failures = []
    for label, c, counts in comms_and_counts(comm, tiny):
        for n in counts:
            for root in range(c.size):
                for blocking in (True, False):
                    x = make_input(dtype, al.SUM, n, seed=root, rank=c.rank)
                    expected = gather_all(x)[root]
                    finish((c.Bcast if blocking else c.Ibcast)(x, root, algorithm="shm"),
                           blocking)
                    what = f"{label} n={n} root={root} blocking={blocking}"
                    failures += differences(what, x, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int32", "int64", "float16", "bfloat16",
                                   "float32", "float64", "complex64", "complex128"])
def test_reduce_scatter(comm, tiny, dtype):
    """Every op of the dtype (AVG included where defined); per-rank counts 0, 1, odd, and up to
    many rounds of the tiny slot (a round takes slot / size / itemsize elements per block)."""
    failures = []
    for label, c, counts in comms_and_counts(comm, tiny):
        p = c.size
        for op in ops_for(dtype):
            for n in counts:
                x = make_input(dtype, op, n * p, seed=op.code, rank=c.rank)
                expected = reference(op, gather_all(x), p)[c.rank * n:(c.rank + 1) * n]
                for inplace, blocking in ((False, True), (True, False), (True, True)):
                    what = f"{label} {op.name} n={n} inplace={inplace} blocking={blocking}"
                    buf = x.copy()
                    out = None if inplace else np.zeros(n, x.dtype)
                    f = c.Reduce_scatter if blocking else c.Ireduce_scatter
                    finish(f(buf, out, op, algorithm="shm"), blocking)
                    failures += differences(what, buf[:n] if inplace else out, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_barrier(comm, tmp_path_factory):
    """Each rank creates a file just before the barrier (one of them late); after its barrier
    returns, every rank sees every rank's file: nobody left before everybody arrived."""
    where = WORLD.bcast(str(tmp_path_factory.mktemp("barrier")) if WORLD.rank == 0 else None)
    failures = []
    for it, blocking in enumerate((True, False, True, False)):
        if comm.rank == it % comm.size:
            time.sleep(0.05)
        open(f"{where}/{it}.{comm.rank}", "w").close()
        finish(comm.Barrier(algorithm="shm") if blocking else comm.Ibarrier(algorithm="shm"),
               blocking)
        missing = [r for r in range(comm.size) if not os.path.exists(f"{where}/{it}.{r}")]
        if missing:
            failures.append(f"it {it}: files of ranks {missing} missing after the barrier")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_interleaved_with_allreduce(comm, tiny):
    """Nonblocking shm allgather / bcast / reduce_scatter / barrier between shm and ring
    allreduces, then blocking ones queued behind them: every op lands in its own buffer."""
    failures = []
    for label, c in (("default", comm), ("tiny", tiny)):
        p, r = c.size, c.rank
        reqs, checks = [], []
        for i in range(12):
            n = 3 + 401 * i
            kind = i % 5
            if kind == 0:
                x = ramp(n, i, r)
                out = np.zeros(n * p, np.float32)
                reqs.append(c.Iallgather(x, out, algorithm="shm"))
                checks.append((f"allgather {i}", out,
                               np.concatenate([ramp(n, i, q) for q in range(p)])))
            elif kind == 1:
                x = ramp(n, i, r)
                reqs.append(c.Ibcast(x, i % p, algorithm="shm"))
                checks.append((f"bcast {i}", x, ramp(n, i, i % p)))
            elif kind == 2:
                x = ramp(n * p, i, r)
                out = np.zeros(n, np.float32)
                reqs.append(c.Ireduce_scatter(x, out, algorithm="shm"))
                checks.append((f"reduce_scatter {i}", out,
                               ramp_reference(n * p, i, p)[r * n:(r + 1) * n]))
            elif kind == 3:
                reqs.append(c.Ibarrier(algorithm="shm"))
            else:
                x = ramp(n, i, r)
                reqs.append(c.Iallreduce(x, algorithm="shm" if i % 2 else "ring"))
                checks.append((f"allreduce {i}", x, ramp_reference(n, i, p)))
        y = ramp(999, 50, r)
        c.Bcast(y, p - 1, algorithm="shm")            # blocking, behind the pending ops
        z = ramp(77, 51, r)
        c.Allreduce(z, algorithm="shm")
        c.Barrier(algorithm="shm")
        al.Waitall(reqs, timeout=60)
        checks += [("blocking bcast", y, ramp(999, 50, p - 1)),
                   ("blocking allreduce", z, ramp_reference(77, 51, p))]
        for what, got, expected in checks:
            failures += differences(f"{label} {what}", got, expected)
        if any(req.algorithm != "shm" for req in reqs[:4]):
            failures.append(f"{label}: algorithms {[q.algorithm for q in reqs[:4]]}")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_blocking_after_nonblocking_keeps_order(comm):
    """Some ranks let their nonblocking shm op finish before the blocking one (inline), others
    still have it pending (queued in the engine): both orders match."""
    failures = []
    p, r = comm.size, comm.rank
    for it in range(12):
        x = ramp(2000 + 3 * it, it, r)
        out = np.zeros(x.size * p, np.float32)
        req = comm.Iallgather(x, out, algorithm="shm")
        if (r + it) % 2:
            req.Wait(timeout=60)
        y = ramp(9 * p, 100 + it, r)
        comm.Reduce_scatter(y, op=al.SUM, algorithm="shm")
        req.Wait(timeout=60)
        failures += differences(f"it {it} allgather", out,
                                np.concatenate([ramp(x.size, it, q) for q in range(p)]))
        failures += differences(f"it {it} reduce_scatter", y[:9],
                                ramp_reference(9 * p, 100 + it, p)[r * 9:(r + 1) * 9])
    assert all_ranks_ok(not failures), every_rank(failures)


def test_hang_timeout_names_the_missing_rank():
    """Rank 0 enters an shm barrier the others join only later: it raises the hang-timeout
    error naming the op and a rank it waits for; the op completes in the engine once they
    join, and the segment still works."""
    if WORLD.Get_size() < 2:
        pytest.skip("needs a peer")
    c = al.Communicator()
    failures = late_peers(c, lambda: c.Barrier(algorithm="shm"), "barrier/shm")
    x = ramp(10, 3, c.rank)
    c.Bcast(x, 1, algorithm="shm")
    failures += differences("next op", x, ramp(10, 3, 1))
    c.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_bad_algorithm_names_the_choices(comm):
    x = np.ones(comm.size, np.float32)
    for call in (lambda: comm.Allgather(x[:1], x, algorithm="ring"),
                 lambda: comm.Ibcast(x, algorithm="auto"),
                 lambda: comm.Reduce_scatter(x, algorithm="rabenseifner"),
                 lambda: comm.Ibarrier(algorithm="nccl")):
        with pytest.raises(ValueError, match=r"algorithm: \w+ takes 'mpi' or 'shm', got"):
            call()
    with pytest.raises(TypeError, match="algorithm: expected a str"):
        comm.Barrier(algorithm=3)
    assert comm._state.pending == 0
    comm.Barrier(algorithm="mpi")                     # nothing was started anywhere


def test_no_segment_is_the_allreduce_error():
    """Without a segment (AL_SHM_SLOT_BYTES=0, or ranks on two nodes) each collective raises
    the UnavailableError of the shm allreduce, before any communication."""
    p = WORLD.Get_size()
    if p < 2:
        pytest.skip("one rank needs no segment")
    layout = ",".join(str(r % 2) for r in range(p))
    for env, pattern in (({"AL_SHM_SLOT_BYTES": "0"}, r"'shm'.*AL_SHM_SLOT_BYTES=0"),
                         ({"AL_NODE_LAYOUT": layout}, r"'shm'.*on 2 nodes.*one node")):
        c = with_env(env, al.Communicator)
        try:
            x = np.ones(p, np.float32)
            with pytest.raises(al.UnavailableError) as allreduce_error:
                c.Allreduce(x, algorithm="shm")
            for call in (lambda: c.Allgather(x[:1], x, algorithm="shm"),
                         lambda: c.Bcast(x, algorithm="shm"),
                         lambda: c.Ireduce_scatter(x, algorithm="shm"),
                         lambda: c.Barrier(algorithm="shm")):
                with pytest.raises(al.UnavailableError, match=pattern) as e:
                    call()
                assert str(e.value) == str(allreduce_error.value)
            c.Barrier()                                   # still usable with "mpi"
        finally:
            c.Free()


# ---------------------------------------------------------------------------- the native path
def outcome(call):
    """(exception type, message) of `call()`, or None if it returned."""
    try:
        call()
    except Exception as e:
        return type(e), str(e)
    return None


def gpu_case(case) -> bool:
    """The case passes a GPU buffer ("shm" has its own error for those)."""
    args, kwargs = case.values[3](2, 0)
    return any(isinstance(a, FakeGPUArray) for a in list(args) + list(kwargs.values()))


SHM_CASES = [c for c in CASES
             if c.values[2] in ("Allgather", "Bcast", "Reduce_scatter") and not gpu_case(c)
             and not c.id.startswith("reduce_scatterv")]      # the per-rank-count form: "mpi"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
def test_errors_are_those_of_the_mpi_path(comm, blocking):
    """Every bad argument of test_bad_input.py's allgather, bcast and reduce_scatter cases
    raises, with algorithm="shm" (checked in Cython, launcher.pxi), the exception and the very
    message it raises with algorithm="mpi" (the host backend's Python checks), and writes
    nothing; the communicator's shm ops work afterwards."""
    p, r = comm.size, comm.rank
    failures = []

    def run_cases():             # a missing check: a TimeoutError, not a hung run
        for case in SHM_CASES:
            exc, match, method, build, min_size = case.values
            if p < min_size:
                continue
            name = method if blocking else "I" + method[0].lower() + method[1:]
            got = {}
            for alg in ("mpi", "shm"):
                args, kwargs = build(p, r)
                before = [a.tobytes() for a in args if isinstance(a, np.ndarray)]
                got[alg] = outcome(lambda: getattr(comm, name)(*args, algorithm=alg, **kwargs))
                if [a.tobytes() for a in args if isinstance(a, np.ndarray)] != before:
                    failures.append(f"{case.id} {alg}: wrote into its arguments")
            if got["mpi"] is None or got["mpi"][0] is not exc:
                failures.append(f"{case.id}: the mpi path gave {got['mpi']}")
            if got["shm"] != got["mpi"]:
                failures.append(f"{case.id}: shm {got['shm']} != mpi {got['mpi']}")

    with_env({"AL_HANG_TIMEOUT": "20"}, run_cases)
    x = ramp(10, 1, r)
    out = np.zeros(10 * p, np.float32)
    comm.Allgather(x, out, algorithm="shm")
    failures += differences("allgather after the errors", out,
                            np.concatenate([ramp(10, 1, q) for q in range(p)]))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_root_and_op_errors(comm):
    """Bcast's root and Reduce_scatter's op through the native path: the Communicator's
    messages; a numpy integer root works."""
    p = comm.size
    x = np.ones(2 * p, np.float32)
    failures = []
    for root, exc, pattern in ((p, ValueError, rf"^root: rank {p} is out of range"),
                               (-1, ValueError, "^root: rank -1 is out of range"),
                               (2**70, ValueError, "^root: rank 1180591620717411303424 is out"),
                               ("0", TypeError, "^root: expected an int rank, got str")):
        for call in (comm.Bcast, comm.Ibcast):
            try:
                with pytest.raises(exc, match=pattern):
                    call(x, root, algorithm="shm")
            except (Exception, pytest.fail.Exception) as e:
                failures.append(f"root {root!r}: {e}")
    for op, pattern in ((al.BAND, "^op: BAND is not defined"), ("bogus", "^op: ")):
        try:
            with pytest.raises(TypeError, match=pattern):
                comm.Reduce_scatter(x, algorithm="shm", op=op)
        except (Exception, pytest.fail.Exception) as e:
            failures.append(f"op {op!r}: {e}")
    y = ramp(5, 2, comm.rank)
    comm.Bcast(y, np.int64(p - 1), algorithm="shm")
    failures += differences("numpy root", y, ramp(5, 2, p - 1))
    assert all_ranks_ok(not failures), every_rank(failures)


INLINE_BYTES = 16          # al_shm.h's AL_SHM_INLINE: a round's data per rank in the flag's line


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64", "complex128"])
def test_at_the_edge_of_the_inline_area(comm, dtype):
    """Counts whose bytes per rank are just inside and just outside the flag line's inline
    area, for the allreduce and the three collectives, ten back-to-back calls each with data
    that changes every call (a reader of the other buffer's area, or of last round's, sees the
    wrong values).  float16 inputs stay below 2048 / size (every partial sum exact): the ramp's
    values reach thousands, whose float16 sums round at each step, and the segment's kernel
    may round where numpy's sequential sum does not (at 6 ranks 3 of 40 sums were 1-2 ulps
    apart; every rank had the same bits)."""
    p, r = comm.size, comm.rank
    isz = np.dtype(dtype).itemsize
    edge = INLINE_BYTES // isz
    exact = dtype != "float16"

    def inputs(n, k, q):
        if exact:
            return ramp(n, k, q, dtype)
        return (ramp(n, k, q, "int64") % (2048 // p)).astype(dtype)

    def summed(n, k):
        if exact:
            return ramp_reference(n, k, p, dtype)
        return sum(inputs(n, k, q).astype(np.float64) for q in range(p)).astype(dtype)
    failures = []
    for n in sorted({1, max(edge - 1, 1), edge, edge + 1}):
        for k in range(10):
            what = f"n={n} call {k}"
            x = inputs(n, k, r)
            comm.Allreduce(x, algorithm="shm")
            failures += differences(f"allreduce {what}", x, summed(n, k))
            out = np.zeros(n * p, dtype)
            comm.Allgather(inputs(n, k, r), out, algorithm="shm")
            failures += differences(f"allgather {what}", out,
                                    np.concatenate([inputs(n, k, q) for q in range(p)]))
            b = inputs(n, k, r)
            comm.Bcast(b, k % p, algorithm="shm")
            failures += differences(f"bcast {what}", b, inputs(n, k, k % p))
            m = max(n // p, 1)      # reduce_scatter: p * m elements per rank in a round
            out = np.zeros(m, dtype)
            comm.Reduce_scatter(inputs(m * p, k, r), out, algorithm="shm")
            failures += differences(f"reduce_scatter m={m} call {k}", out,
                                    summed(m * p, k)[r * m:(r + 1) * m])
    assert all_ranks_ok(not failures), every_rank(failures)


def test_bcast_root_runs_ahead(comm, tiny):
    """Back-to-back bcasts whose root returns without waiting for its peers (the lazy arrive):
    roots that change every few calls, counts inside the flag line, in one slot and over
    several slots of the tiny communicator, and peers that arrive late (a 2 ms sleep before
    some calls, on ranks that change), so that a root runs ahead; every 7th call is an
    allgather or an allreduce (ops that write after a lazy round).  A root that overwrote a
    buffer before its peers had read it (no settle before its write) makes the late peers
    read a later round's data."""
    failures = []
    for label, c in (("default", comm), ("tiny", tiny)):
        p, r = c.size, c.rank
        counts = [1, 6, 7, 300, 1025, 3000]            # float32: inline, inline, 1-3 slots
        for i in range(90):
            n = counts[i % len(counts)]
            root = (i // 3) % p
            if p > 1 and r == (i // 5) % p and r != root and i % 4 == 1:
                time.sleep(0.002)
            if i % 7 == 6:
                x = ramp(n, i, r)
                if i % 2:
                    c.Allreduce(x, algorithm="shm")
                    failures += differences(f"{label} {i} allreduce", x, ramp_reference(n, i, p))
                else:
                    out = np.zeros(n * p, np.float32)
                    c.Allgather(x, out, algorithm="shm")
                    failures += differences(f"{label} {i} allgather", out,
                                            np.concatenate([ramp(n, i, q) for q in range(p)]))
                continue
            b = ramp(n, i, r)
            if i % 5 == 4:
                c.Ibcast(b, root, algorithm="shm").Wait(timeout=60)
            else:
                c.Bcast(b, root, algorithm="shm")
            failures += differences(f"{label} {i} bcast n={n} root={root}", b, ramp(n, i, root))
        c.Barrier(algorithm="shm")
    assert all_ranks_ok(not failures), every_rank(failures)


GIL_GATE = 4344        # tag of rank 0's message (on MPI.COMM_WORLD) that lets its peers in
COUNTED = 1000         # what rank 0's other thread counts while its call waits


def test_waiting_call_releases_the_gil(comm):
    """A blocking shm call that waits for a late peer lets this process's other threads run
    (it polls with the GIL held only briefly): rank 0's other thread, which runs only if it
    gets the GIL, is what lets the others into the barrier, once it has seen rank 0's main
    thread inside the call (CommState.busy: the GIL is released from there on) and counted
    on meanwhile.  A call that kept the GIL would hold the gate shut until the 60 s guard."""
    if comm.size < 2:
        pytest.skip("needs a peer")
    counts, stop = [0], threading.Event()
    peers = range(1, comm.size)

    def count():
        """Count; once rank 0's call is seen waiting (and COUNTED counts later), open the gate
        for the peers (always opened, at the latest when the call is over)."""
        seen = None
        while not stop.is_set() and (seen is None or counts[0] - seen < COUNTED):
            counts[0] += 1
            if seen is None and comm._state.busy:
                seen = counts[0]
        for r in peers:
            WORLD.send(seen is not None, dest=r, tag=GIL_GATE)

    failures = []
    if comm.rank == 0:
        t = threading.Thread(target=count)
        WORLD.Barrier()
        t.start()
        comm.Barrier(algorithm="shm")
        stop.set()
        t.join()
    else:
        WORLD.Barrier()
        gate, opened = WORLD.irecv(source=0, tag=GIL_GATE), []

        def arrived():
            done, seen = gate.test()
            if done:
                opened.append(seen)
            return done

        wait_for(arrived)
        comm.Barrier(algorithm="shm")
        if not (opened or [gate.wait()])[0]:
            failures.append("rank 0's other thread did not run while its call waited")
    assert all_ranks_ok(not failures), every_rank(failures)
