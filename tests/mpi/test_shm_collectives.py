"""allgather, bcast, reduce_scatter and barrier over the shared-memory segment
(``algorithm="shm"``): every dtype for allgather and bcast (every root), reduce_scatter with every
op of several dtypes, counts 0, 1, odd and larger than a slot (the 4 KiB slots of test_shm's
`tiny` communicator), in place and not, blocking and nonblocking, interleaved with allreduce
ops; results against numpy from every rank's inputs and identical on every rank; the hang
timeout; the errors (bad name, no segment, GPU buffers)."""
import os
import time

import numpy as np
import pytest

import aluminum_py as al
from conftest import (DTYPES, WORLD, all_ranks_ok, differences, every_rank, gather_all,
                      make_input, ops_for, ramp, ramp_reference, reference)
from test_shm import late_peers, tiny, with_env  # noqa: F401  (tiny: the 4 KiB-slot communicator fixture)

pytestmark = pytest.mark.mpi

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
