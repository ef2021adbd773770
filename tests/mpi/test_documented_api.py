"""Documented API (docs/api.md) that the other multi-rank files do not reach:

* ops given by name in any case ("max", "Sum") and as mpi4py ops (MPI.MAX ...) for every
  reducing collective (Allreduce with every host algorithm, Reduce, Reduce_scatter; blocking
  and nonblocking), and any other op value raising TypeError;
* the 2**31-1 elements-per-operation limit (ValueError, on every rank, before communicating);
* ``al.Communicator(other_al_communicator)``;
* ``al.Waitall(timeout=)`` raising al.TimeoutError and leaving the rest pending, and
  ``al.Waitall`` waiting for every other request before raising the first failure;
* ``Request.Test()`` raising the failure of a failed operation;
* ``aluminum_py.ops.supported_dtypes()`` and an Allreduce SUM on each of those dtypes.

Results are checked against numpy computed from every rank's inputs; every per-rank check is
asserted through ``all_ranks_ok`` so that all ranks pass or fail a test together. The file uses
its own Communicator (freed at the end), so a failure here cannot disturb other modules.
(The MPI_THREAD_MULTIPLE requirement is tests/test_thread_level.py: it needs MPI initialised
at a lower level, in a subprocess.)"""
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import ops as al_ops
from conftest import WORLD, all_ranks_ok, gather_all, make_input, reference

pytestmark = pytest.mark.mpi

WAIT = 60.0          # seconds: the bound on every wait that is expected to complete
HOST_ALGORITHMS = ("auto", "mpi", "recursive_doubling", "rabenseifner", "ring", "hierarchical", "shm",
                   "hierarchical_p2p")


@pytest.fixture(scope="module")
def c():
    comm = al.Communicator()
    yield comm
    comm.Free()


def mismatch(what, got, expected):
    """None if equal (dtype, shape and values), else a description."""
    got = np.asarray(got)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return f"{what}: got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"
    if not np.array_equal(got, expected):
        bad = np.flatnonzero(got != expected)[:5]
        return f"{what}: at {bad} got {got[bad]} expected {expected[bad]}"
    return None


def ring_peers(comm):
    return (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


# ---------------------------------------------------------------------------- ops by name / MPI op
# (op as given, the al.Op it means, the dtype it is checked on): each op on a dtype it is defined
# for, so that every al.Op is reached both by a name in a different case and by its mpi4py op.
OP_SPECS = [
    ("max", al.MAX, "int32"), ("Sum", al.SUM, "float64"), ("MIN", al.MIN, "float32"),
    ("pRoD", al.PROD, "int64"), ("avg", al.AVG, "float64"), ("Avg", al.AVG, "float32"),
    ("land", al.LAND, "uint8"), ("Lor", al.LOR, "int16"), ("lXor", al.LXOR, "int32"),
    ("band", al.BAND, "uint32"), ("BOR", al.BOR, "int64"), ("bXOR", al.BXOR, "uint16"),
    (MPI.MAX, al.MAX, "float64"), (MPI.SUM, al.SUM, "int32"), (MPI.MIN, al.MIN, "int64"),
    (MPI.PROD, al.PROD, "float64"), (MPI.LAND, al.LAND, "int32"), (MPI.LOR, al.LOR, "uint8"),
    (MPI.LXOR, al.LXOR, "uint16"), (MPI.BAND, al.BAND, "int16"), (MPI.BOR, al.BOR, "uint32"),
    (MPI.BXOR, al.BXOR, "int8"),
]


def spec_id(spec):
    given, op, dtype = spec
    name = f"str:{given}" if isinstance(given, str) else f"MPI.{op.name}"
    return f"{name}-{dtype}"


def run_reductions(comm, given, op, dtype, seed):
    """Every reducing collective with `given` as its op, each result against numpy's reduction
    (by `op`) of every rank's input. Returns the list of mismatches (empty: all correct)."""
    p, r = comm.size, comm.rank
    failures = []
    count = 1001                                  # not a multiple of any size: uneven ring blocks
    x = make_input(dtype, op, count, seed=seed, rank=r)
    expected = reference(op, gather_all(x), p)
    for alg in HOST_ALGORITHMS:
        for blocking in (True, False):
            src, out = x.copy(), np.zeros_like(x)
            if blocking:
                comm.Allreduce(src, out, op=given, algorithm=alg)
            else:
                comm.Iallreduce(src, out, op=given, algorithm=alg).Wait(timeout=WAIT)
            failures.append(mismatch(f"{'A' if blocking else 'Ia'}llreduce/{alg}", out, expected))
            failures.append(mismatch(f"allreduce/{alg} sendbuf", src, x))
        inplace = x.copy()                        # in place too (recvbuf=None)
        comm.Iallreduce(inplace, op=given, algorithm=alg).Wait(timeout=WAIT)
        failures.append(mismatch(f"Iallreduce/{alg} in place", inplace, expected))
    root = p - 1
    for blocking in (True, False):
        out = np.zeros_like(x)
        if blocking:
            comm.Reduce(x, out, op=given, root=root)
        else:
            comm.Ireduce(x, out, op=given, root=root).Wait(timeout=WAIT)
        if r == root:
            failures.append(mismatch(f"{'R' if blocking else 'Ir'}educe", out, expected))
    n = 7
    y = make_input(dtype, op, n * p, seed=seed + 1, rank=r)
    block = reference(op, gather_all(y), p)[r * n:(r + 1) * n]
    for blocking in (True, False):
        out = np.zeros(n, dtype=y.dtype)
        if blocking:
            comm.Reduce_scatter(y, out, op=given)
        else:
            comm.Ireduce_scatter(y, out, op=given).Wait(timeout=WAIT)
        failures.append(mismatch(f"{'R' if blocking else 'Ir'}educe_scatter", out, block))
    return [f for f in failures if f]


@pytest.mark.parametrize("spec", OP_SPECS, ids=spec_id)
def test_op_by_name_or_mpi_op(c, spec):
    """docs/api.md "Reduction ops": wherever an op is accepted, its name in any case or the
    matching mpi4py op means the same as the al.Op."""
    given, op, dtype = spec
    failures = run_reductions(c, given, op, dtype, seed=op.code * 31 + len(str(given)))
    assert all_ranks_ok(not failures), failures[:8]


@pytest.mark.local
def test_every_op_has_a_name_and_an_mpi_op():
    """Every al.Op but AVG has an mpi4py twin (AVG is not an MPI op), and both spellings are
    covered above."""
    names = {op.name for given, op, _ in OP_SPECS if isinstance(given, str)}
    mpi_ops = {op.name for given, op, _ in OP_SPECS if not isinstance(given, str)}
    assert names == {o.name for o in al.OPS}
    assert mpi_ops == {o.name for o in al.OPS} - {"AVG"}


BAD_OPS = [pytest.param(v, id=i) for v, i in (
    ("maxx", "str-maxx"), ("", "str-empty"), (" max", "str-space"), ("max_", "str-max_"),
    (b"max", "bytes-max"), (3, "int-3"), (0, "int-0"), (al.MAX.code, "al.MAX.code"),
    (3.0, "float"), (MPI.MAXLOC, "MPI.MAXLOC"), (MPI.MINLOC, "MPI.MINLOC"),
    (MPI.OP_NULL, "MPI.OP_NULL"), (MPI.NO_OP, "MPI.NO_OP"), ((al.SUM,), "tuple"),
    (np.add, "np.add"))]


@pytest.mark.parametrize("bad", BAD_OPS)
def test_invalid_op_raises_type_error(c, bad):
    """"Any other value raises TypeError", before any communication and without writing the
    output, from every reducing collective, blocking and nonblocking."""
    p = c.size
    failures = []
    calls = [("Allreduce", lambda s, o: c.Allreduce(s, o, op=bad, algorithm="ring")),
             ("Allreduce/mpi", lambda s, o: c.Allreduce(s, o, op=bad, algorithm="mpi")),
             ("Iallreduce", lambda s, o: c.Iallreduce(s, o, op=bad)),
             ("Allreduce in place", lambda s, o: c.Allreduce(s, op=bad)),
             ("Reduce", lambda s, o: c.Reduce(s, o, op=bad, root=0)),
             ("Ireduce", lambda s, o: c.Ireduce(s, o, op=bad, root=p - 1)),
             ("Reduce_scatter", lambda s, o: c.Reduce_scatter(s, o[:2], op=bad)),
             ("Ireduce_scatter", lambda s, o: c.Ireduce_scatter(s, o[:2], op=bad))]
    for name, call in calls:
        s = np.arange(2 * p, dtype=np.float64) + c.rank
        o = np.full(2 * p, -1.0)
        s0 = s.copy()
        try:
            with pytest.raises(TypeError, match=r"^op\b"):
                call(s, o)
        except (Exception, pytest.fail.Exception) as e:
            failures.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if not (np.all(o == -1.0) and np.array_equal(s, s0)):
            failures.append(f"{name}: raised, but wrote into its buffers")
    assert all_ranks_ok(not failures), failures
    # nothing was started: a correct collective follows on every rank
    x = np.arange(10, dtype=np.int64) * (c.rank + 1)
    c.Allreduce(x, op="Max")
    assert all_ranks_ok(np.array_equal(x, np.arange(10, dtype=np.int64) * p))


# ---------------------------------------------------------------------------- the count limit
LIMIT_MSG = r"2147483648 elements exceeds the limit of 2\*\*31-1"


def test_count_limit_raises_value_error_on_every_rank(c):
    """"more than 2**31-1 elements in one operation: ValueError". The count is the array's
    element count after the contiguity check, so only a real C-contiguous buffer of 2**31
    elements reaches it: uint8 arrays from np.empty, whose pages are never touched (no memory
    is used). Every operation that takes a count raises on every rank before communicating,
    and the communicator goes on working."""
    p, r = c.size, c.rank
    n = 2 ** 31
    big = np.empty(n, dtype=np.uint8)               # 2 GiB of address space, never touched
    other = np.empty(n, dtype=np.uint8)
    blocks = np.empty(p * n, dtype=np.uint8)        # size blocks of 2**31 elements each
    small = np.zeros(8, dtype=np.uint8)
    me, nxt = r, (r + 1) % p
    # (call, argument named in the message); algorithm="mpi" everywhere an algorithm is taken
    calls = [
        ("Allreduce in place", lambda: c.Allreduce(big, algorithm="mpi"), "sendbuf"),
        ("Allreduce", lambda: c.Allreduce(big, other, algorithm="mpi"), "sendbuf"),
        ("Iallreduce", lambda: c.Iallreduce(big, algorithm="mpi"), "sendbuf"),
        ("Allreduce op=max", lambda: c.Allreduce(big, other, op="max", algorithm="mpi"), "sendbuf"),
        ("Reduce at root", lambda: c.Reduce(big, None, root=me), "sendbuf"),
        ("Ireduce off root", lambda: c.Ireduce(big, None, root=nxt), "sendbuf"),
        ("Reduce_scatter", lambda: c.Reduce_scatter(blocks), "recvbuf"),
        ("Ireduce_scatter", lambda: c.Ireduce_scatter(blocks, big), "recvbuf"),
        ("Bcast", lambda: c.Bcast(big, root=0), "buf"),
        ("Ibcast", lambda: c.Ibcast(big, root=p - 1), "buf"),
        ("Allgather in place", lambda: c.Allgather(blocks), "count"),
        ("Alltoall in place", lambda: c.Ialltoall(blocks), "count"),
        ("Gather at root", lambda: c.Gather(blocks, None, root=me), "count"),
        ("Igather to a peer", lambda: c.Igather(big, None, root=nxt), "count"),
        ("Scatter at root", lambda: c.Scatter(blocks, None, root=me), "count"),
        ("Send", lambda: c.Send(big, dest=me, tag=1), "buf"),
        ("Isend", lambda: c.Isend(big, dest=nxt, tag=1), "buf"),
        ("Recv", lambda: c.Recv(big, source=me, tag=1), "buf"),
        ("Irecv", lambda: c.Irecv(big, source=MPI.ANY_SOURCE, tag=1), "buf"),
        ("Sendrecv", lambda: c.Sendrecv(big, me, small, me, tag=1), "sendbuf"),
        ("Isendrecv", lambda: c.Isendrecv(small, me, big, me, tag=1), "recvbuf"),
    ]
    if p == 1:   # "Igather to a peer" / "Ireduce off root" are the root forms at one rank
        calls = [cl for cl in calls if "peer" not in cl[0] and "off root" not in cl[0]]
    failures = []
    for name, call, arg in calls:
        try:
            with pytest.raises(ValueError, match=rf"^{arg}: {LIMIT_MSG}"):
                call()
        except (Exception, pytest.fail.Exception) as e:
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    del big, other, blocks
    assert all_ranks_ok(not failures), failures
    assert all_ranks_ok(c._state.pending == 0)
    x = np.arange(1000, dtype=np.uint8) + r         # wraps around, as numpy's sum does
    expected = reference(al.SUM, gather_all(x), p)
    c.Allreduce(x, algorithm="ring")
    assert all_ranks_ok(np.array_equal(x, expected))


# ---------------------------------------------------------------------------- Communicator(al comm)
def test_communicator_from_an_al_communicator():
    """al.Communicator(other al.Communicator): same ranks and size, its own MPI communicators
    (congruent, not identical), traffic that never matches the other's, and either one usable
    after the other is freed."""
    p, r = WORLD.size, WORLD.rank
    c1 = al.Communicator()
    c2 = al.Communicator(c1)
    assert all_ranks_ok((c2.size, c2.rank, c1.size, c1.rank) == (p, r, p, r))
    assert all_ranks_ok(MPI.Comm.Compare(c2.mpi_comm, c1.mpi_comm) == MPI.CONGRUENT)
    assert all_ranks_ok(c2.local_size == c1.local_size and c2.local_rank == c1.local_rank)

    # The same collectives (same count, dtype, algorithm: the same tags) on both, started in
    # opposite orders on neighbouring ranks: if the two shared MPI communicators, the
    # messages would cross over and the results would be swapped.
    failures = []
    for alg in HOST_ALGORITHMS:
        a = make_input("int64", al.SUM, 999, seed=1, rank=r)
        b = make_input("int64", al.SUM, 999, seed=2, rank=r) * 100
        ea, eb = reference(al.SUM, gather_all(a), p), reference(al.SUM, gather_all(b), p)
        if r % 2 == 0:
            reqs = [c1.Iallreduce(a, algorithm=alg), c2.Iallreduce(b, algorithm=alg)]
        else:
            reqs = [c2.Iallreduce(b, algorithm=alg), c1.Iallreduce(a, algorithm=alg)]
        al.Waitall(reqs, timeout=WAIT)
        failures += [mismatch(f"{alg} on the original", a, ea), mismatch(f"{alg} on the copy", b, eb)]
    # point to point on both, same tag, receives posted in opposite orders
    right, left = ring_peers(c1)
    ra, rb = np.zeros(5, np.int32), np.zeros(5, np.int32)
    sa = c1.Isend(np.arange(5, dtype=np.int32) + 10 * r, right, tag=7)
    sb = c2.Isend(np.arange(5, dtype=np.int32) - 10 * r, right, tag=7)
    if r % 2:
        reqs = [c2.Irecv(rb, left, tag=7), c1.Irecv(ra, left, tag=7)]
    else:
        reqs = [c1.Irecv(ra, left, tag=7), c2.Irecv(rb, left, tag=7)]
    al.Waitall(reqs + [sa, sb], timeout=WAIT)
    failures += [mismatch("p2p on the original", ra, np.arange(5, dtype=np.int32) + 10 * left),
                 mismatch("p2p on the copy", rb, np.arange(5, dtype=np.int32) - 10 * left)]
    failures = [f for f in failures if f]
    assert all_ranks_ok(not failures), failures

    # freeing the original leaves the copy working, and a copy of the copy as well
    c1.Free()
    with pytest.raises(al.Error):
        c1.Allreduce(np.ones(3))
    c3 = al.Communicator(c2)
    c3.Free()
    x = make_input("float64", al.MAX, 501, seed=3, rank=r)
    e = reference(al.MAX, gather_all(x), p)
    out = np.zeros_like(x)
    c2.Allreduce(x, out, op=al.MAX, algorithm="rabenseifner")
    y = np.arange(6, dtype=np.int16) * (r + 1)
    c2.Bcast(y, root=p - 1)
    ok = mismatch("copy after the original was freed", out, e) is None and \
        np.array_equal(y, np.arange(6, dtype=np.int16) * p)
    assert all_ranks_ok(ok)
    c2.Free()


# ---------------------------------------------------------------------------- Waitall / Test
def test_waitall_timeout_raises_and_leaves_the_rest_pending(c):
    """Waitall(timeout=): al.TimeoutError (also a builtins.TimeoutError) when a request cannot
    complete in time, with the remaining requests still pending; they complete afterwards."""
    r = c.rank
    right, left = ring_peers(c)
    done_req = c.Iallreduce(np.ones(4))
    done_req.Wait(timeout=WAIT)
    b1, b2 = np.zeros(6, np.float32), np.zeros(3, np.int64)
    recv1 = c.Irecv(b1, left, tag=21)            # nobody sends these yet
    recv2 = c.Irecv(b2, left, tag=22)
    outcome = None
    try:
        al.Waitall([done_req, recv1, recv2], timeout=0.3)
        outcome = "Waitall returned"
    except al.TimeoutError as e:
        if not isinstance(e, TimeoutError):
            outcome = "not a builtins.TimeoutError"
    except Exception as e:           # pragma: no cover - reported below
        outcome = f"{type(e).__name__}: {e}"
    still_pending = not recv1.done and not recv2.done and not recv1.Test() and not recv2.Test()
    WORLD.Barrier()                  # every rank has timed out before any message is sent
    sends = [c.Isend(np.arange(6, dtype=np.float32) * (r + 1), right, tag=21),
             c.Isend(np.arange(3, dtype=np.int64) - r, right, tag=22)]
    al.Waitall([recv1, recv2] + sends, timeout=WAIT)
    ok = (np.array_equal(b1, np.arange(6, dtype=np.float32) * (left + 1))
          and np.array_equal(b2, np.arange(3, dtype=np.int64) - left))
    assert all_ranks_ok(outcome is None), outcome
    assert all_ranks_ok(still_pending)
    assert all_ranks_ok(ok)


def test_waitall_waits_for_the_others_then_raises_the_first_failure(c):
    """A failed operation (a truncated receive, al.MPIError) does not stop Waitall: it waits
    for every other request, whose results are then in place, and raises the first failure
    in the list's order."""
    p, r = c.size, c.rank
    right, left = ring_peers(c)
    ten = lambda k: np.arange(10, dtype=np.int32) * (k + 1)   # noqa: E731
    sends = [c.Isend(ten(r), right, tag=31), c.Isend(ten(r), right, tag=32)]
    WORLD.Barrier()
    short1, short2 = np.zeros(5, np.int32), np.zeros(3, np.int32)
    x = make_input("float64", al.SUM, 777, seed=5, rank=r)
    ex = reference(al.SUM, gather_all(x), p)
    y = make_input("int32", al.BXOR, 300, seed=6, rank=r)
    ey = reference(al.BXOR, gather_all(y), p)
    late = np.zeros(4, np.float64)
    fail1 = c.Irecv(short1, left, tag=31)
    good1 = c.Iallreduce(x, algorithm="ring")
    fail2 = c.Irecv(short2, left, tag=32)
    good2 = c.Iallreduce(y, op="bxor", algorithm="recursive_doubling")
    good3 = c.Irecv(late, left, tag=33)          # its message is sent 0.5 s from now
    late_send = []
    timer = threading.Timer(0.5, lambda: (c.bind_thread(), late_send.append(   # hand-over
        c.Isend(np.arange(4, dtype=np.float64) + r, right, tag=33))))
    timer.start()
    raised = None
    try:
        al.Waitall([fail1, good1, fail2, good2, good3], timeout=WAIT)
    except al.MPIError as e:
        raised = e
    except Exception as e:           # pragma: no cover - reported below
        raised = e
    others_done = [q.done for q in (good1, good2, good3)]
    timer.join()
    c.bind_thread()                              # and back
    al.Waitall(late_send + sends, timeout=WAIT)
    errors = {}
    for name, q in (("fail1", fail1), ("fail2", fail2)):
        try:
            q.Wait(timeout=WAIT)
        except al.MPIError as e:
            errors[name] = (str(e), e.code)
    problems, untold = [], []
    if not isinstance(raised, al.MPIError):
        problems.append(f"Waitall raised {raised!r}")
    if set(errors) != {"fail1", "fail2"}:
        problems.append(f"failed requests' own errors: {errors}")
    elif isinstance(raised, al.MPIError):
        if (str(raised), raised.code) != errors["fail1"]:
            problems.append(f"raised {raised!r}, not the first failure {errors['fail1']}")
        if MPI.Get_error_class(raised.code) != MPI.ERR_TRUNCATE:
            problems.append(f"error class {MPI.Get_error_class(raised.code)}, not ERR_TRUNCATE")
        if errors["fail1"][0] == errors["fail2"][0]:
            untold.append("the two failures cannot be told apart")
    if not all(others_done):
        problems.append(f"Waitall raised before the others completed: done={others_done}")
    for what, got, exp in (("allreduce", x, ex), ("bxor", y, ey),
                           ("late recv", late, np.arange(4, dtype=np.float64) + left)):
        m = mismatch(what, got, exp)
        if m:
            problems.append(m)
    assert all_ranks_ok(not problems), problems
    # MPICH's truncation message gives the sizes (5 vs 3 elements here), so "the first failure"
    # is checked by its text; Open MPI's is the same for both ("MPI_ERR_TRUNCATE: message
    # truncated"): there, every other check has passed and only that one cannot be made
    if not all_ranks_ok(not untold) and "MPICH" not in MPI.Get_library_version():
        pytest.skip(f"{MPI.Get_library_version().split(',')[0].strip()}: the two truncation "
                    f"errors have the same message, so which one Waitall raised cannot be told")
    assert all_ranks_ok(not untold), untold


def test_request_test_raises_when_the_operation_failed(c):
    """Request.Test(): False while pending, True once complete, and al.MPIError for an
    operation that failed; `done` never raises; Wait raises the same error."""
    r = c.rank
    right, left = ring_peers(c)
    problems = []
    buf = np.zeros(4, np.int64)
    failing = c.Irecv(buf, left, tag=41)           # the message will be 8 elements
    pending_ok = failing.Test() is False and failing.done is False
    WORLD.Barrier()
    send = c.Isend(np.arange(8, dtype=np.int64) + r, right, tag=41)
    deadline = time.monotonic() + WAIT
    while not failing.done and time.monotonic() < deadline:
        time.sleep(0.001)
    if not failing.done:
        problems.append("the truncated receive never completed")
    else:
        for attempt in (1, 2):                      # raises every time it is asked
            try:
                got = failing.Test()
                problems.append(f"Test() #{attempt} returned {got!r} for a failed receive")
            except al.MPIError as e:
                if MPI.Get_error_class(e.code) != MPI.ERR_TRUNCATE or not str(e).startswith("recv"):
                    problems.append(f"Test() #{attempt}: {e!r} (code {e.code})")
        try:
            done = failing.done
            if done is not True:
                problems.append(f"done is {done!r}")
        except Exception as e:                      # pragma: no cover - reported
            problems.append(f"done raised {e!r}")
        try:
            failing.Wait(timeout=1)
            problems.append("Wait did not raise")
        except al.MPIError:
            pass
    send.Wait(timeout=WAIT)
    good = c.Iallreduce(np.arange(5.0) + r, algorithm="mpi")
    good.Wait(timeout=WAIT)
    if good.Test() is not True:
        problems.append("Test() of a completed operation is not True")
    assert all_ranks_ok(pending_ok), "Test() or done of a pending receive"
    assert all_ranks_ok(not problems), problems


# ---------------------------------------------------------------------------- supported dtypes
DOCUMENTED_DTYPES = ("int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 bfloat16 float32 "
                     "float64 complex64 complex128").split()


def ml_dtypes_importable() -> bool:
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.local
def test_supported_dtypes_is_the_documented_list():
    expected = [d for d in DOCUMENTED_DTYPES if d != "bfloat16" or ml_dtypes_importable()]
    got = al_ops.supported_dtypes()
    assert isinstance(got, list) and all(isinstance(d, str) for d in got)
    assert len(got) == len(set(got))
    assert sorted(got) == sorted(expected)


@pytest.mark.parametrize("dtype", al_ops.supported_dtypes())
def test_every_supported_dtype_allreduces(c, dtype):
    """Each dtype supported_dtypes() lists takes an Allreduce SUM (every host algorithm,
    blocking and nonblocking, given as a numpy array and as a memoryview) equal to numpy's."""
    p, r = c.size, c.rank
    x = make_input(dtype, al.SUM, 333, seed=9, rank=r)
    expected = reference(al.SUM, gather_all(x), p)
    failures = []
    for alg in HOST_ALGORITHMS:
        out = np.zeros_like(x)
        c.Allreduce(x, out, algorithm=alg)
        failures.append(mismatch(f"Allreduce/{alg}", out, expected))
        y = x.copy()
        c.Iallreduce(y, op="sum", algorithm=alg).Wait(timeout=WAIT)
        failures.append(mismatch(f"Iallreduce/{alg} in place", y, expected))
    if dtype != "bfloat16":          # memoryview has no format for ml_dtypes' bfloat16
        out = np.zeros_like(x)
        c.Allreduce(memoryview(x), memoryview(out), op=MPI.SUM)
        failures.append(mismatch("Allreduce on memoryviews", out, expected))
    failures = [f for f in failures if f]
    assert all_ranks_ok(not failures), failures
