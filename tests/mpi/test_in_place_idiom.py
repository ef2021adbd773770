"""mpi4py's in-place idiom on host buffers: ``MPI.IN_PLACE`` where mpi4py takes it (sendbuf of
Allreduce, Reduce at the root, block Reduce_scatter, Allgather, Alltoall, Gather at the root,
Scan, Exscan and the v-forms; recvbuf of Scatter and Scatterv at the root) runs the call in
place, with the data in the other buffer, as mpi4py and MPI do.  Every result is compared with
numpy built from every rank's inputs (each rank's input is a pure function of its rank), for
several dtypes, a 1-byte one included, blocking and nonblocking, with the "mpi" and "shm"
algorithms where the call has both.  mpi4py's other buffer-protocol constants (MPI.BOTTOM,
MPI.BUFFER_AUTOMATIC), and IN_PLACE where the call has no in-place form, are never read as data:
a TypeError naming the argument and the constant, on every rank, before any communication,
with the buffers untouched."""
import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from conftest import all_ranks_ok

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

DTYPES = ["uint8", "int32", "float32", "float64"]
N = 6                   # elements per block


@pytest.fixture(scope="module")
def comm():
    c = al.Communicator()
    yield c
    c.Free()


def inp(rank: int, n: int, dtype) -> np.ndarray:
    """Rank `rank`'s input: small values whose sums over 4 ranks stay exact in uint8."""
    return ((np.arange(n) * 5 + rank * 3 + 1) % 13).astype(dtype)


def icall(comm, blocking: bool, name: str, *args, **kw):
    """The blocking call `name`, or its I-form waited for."""
    if blocking:
        return getattr(comm, name)(*args, **kw)
    return getattr(comm, "I" + name[0].lower() + name[1:])(*args, **kw).Wait(timeout=60)


def algorithms(comm, shm: bool):
    """"mpi", and "shm" where the call has it and the communicator has a segment."""
    out = ["mpi"]
    if shm and comm._host._no_shm is None:
        out.append("shm")
    return out


BLOCKING = [True, False]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocking", BLOCKING)
def test_allreduce(comm, dtype, blocking):
    p, me = comm.size, comm.rank
    want = sum(inp(r, 2 * N + 1, dtype) for r in range(p)).astype(dtype)
    for algorithm in ["auto", "mpi", "ring"] + (["shm"] if comm._host._no_shm is None else []):
        x = inp(me, 2 * N + 1, dtype)
        if blocking:
            comm.Allreduce(MPI.IN_PLACE, x, algorithm=algorithm)
        else:
            comm.Iallreduce(MPI.IN_PLACE, x, algorithm=algorithm).Wait(timeout=60)
        assert all_ranks_ok(np.array_equal(x, want)), (algorithm, x, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocking", BLOCKING)
def test_reduce_at_the_root(comm, dtype, blocking):
    p, me = comm.size, comm.rank
    want = sum(inp(r, N, dtype) for r in range(p)).astype(dtype)
    for root in range(p):
        x = inp(me, N, dtype)
        args = (MPI.IN_PLACE, x) if me == root else (x, None)
        icall(comm, blocking, "Reduce", *args, op=al.SUM, root=root)
        ok = np.array_equal(x, want) if me == root else np.array_equal(x, inp(me, N, dtype))
        assert all_ranks_ok(ok), (root, x, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocking", BLOCKING)
def test_block_reduce_scatter(comm, dtype, blocking):
    p, me = comm.size, comm.rank
    total = sum(inp(r, p * N, dtype) for r in range(p)).astype(dtype)
    for algorithm in algorithms(comm, True):
        x = inp(me, p * N, dtype)
        icall(comm, blocking, "Reduce_scatter", MPI.IN_PLACE, x, algorithm=algorithm)
        assert all_ranks_ok(np.array_equal(x[:N], total[me * N:(me + 1) * N])), (algorithm, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocking", BLOCKING)
def test_allgather(comm, dtype, blocking):
    p, me = comm.size, comm.rank
    want = np.concatenate([inp(r, N, dtype) for r in range(p)])
    for algorithm in algorithms(comm, True):
        x = np.zeros(p * N, dtype)
        x[me * N:(me + 1) * N] = inp(me, N, dtype)
        icall(comm, blocking, "Allgather", MPI.IN_PLACE, x, algorithm=algorithm)
        assert all_ranks_ok(np.array_equal(x, want)), (algorithm, x, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocking", BLOCKING)
def test_alltoall(comm, dtype, blocking):
    p, me = comm.size, comm.rank
    want = np.concatenate([inp(r, p * N, dtype)[me * N:(me + 1) * N] for r in range(p)])
    for algorithm in algorithms(comm, True) + ["auto"]:
        x = inp(me, p * N, dtype)
        icall(comm, blocking, "Alltoall", MPI.IN_PLACE, x, algorithm=algorithm)
        assert all_ranks_ok(np.array_equal(x, want)), (algorithm, x, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocking", BLOCKING)
def test_gather_at_the_root(comm, dtype, blocking):
    p, me = comm.size, comm.rank
    want = np.concatenate([inp(r, N, dtype) for r in range(p)])
    for root in range(p):
        if me == root:
            x = np.zeros(p * N, dtype)
            x[me * N:(me + 1) * N] = inp(me, N, dtype)
            icall(comm, blocking, "Gather", MPI.IN_PLACE, x, root=root)
            ok = np.array_equal(x, want)
        else:
            x = inp(me, N, dtype)
            icall(comm, blocking, "Gather", x, None, root=root)
            ok = np.array_equal(x, inp(me, N, dtype))
        assert all_ranks_ok(ok), (root, x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocking", BLOCKING)
def test_scatter_at_the_root(comm, dtype, blocking):
    p, me = comm.size, comm.rank
    for root in range(p):
        src = inp(root, p * N, dtype)
        if me == root:
            x = src.copy()
            icall(comm, blocking, "Scatter", x, MPI.IN_PLACE, root=root)
            ok = np.array_equal(x, src)         # root's block stays where it is
        else:
            x = np.zeros(N, dtype)
            icall(comm, blocking, "Scatter", None, x, root=root)
            ok = np.array_equal(x, src[me * N:(me + 1) * N])
        assert all_ranks_ok(ok), (root, x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scans(comm, dtype):
    p, me = comm.size, comm.rank
    x = inp(me, N, dtype)
    comm.Scan(MPI.IN_PLACE, x)
    ok = np.array_equal(x, sum(inp(r, N, dtype) for r in range(me + 1)).astype(dtype))
    x = inp(me, N, dtype)
    comm.Exscan(MPI.IN_PLACE, x)
    want = inp(0, N, dtype) if me == 0 else sum(inp(r, N, dtype) for r in range(me))
    ok = ok and np.array_equal(x, np.asarray(want).astype(dtype))
    assert all_ranks_ok(ok)


@pytest.mark.parametrize("dtype", DTYPES)
def test_v_forms(comm, dtype):
    p, me = comm.size, comm.rank
    counts = [r % 3 + 1 for r in range(p)]
    displs = [sum(counts[:r]) for r in range(p)]
    whole = np.concatenate([inp(r, counts[r], dtype) for r in range(p)])
    x = np.zeros(sum(counts), dtype)
    x[displs[me]:displs[me] + counts[me]] = inp(me, counts[me], dtype)
    comm.Allgatherv(MPI.IN_PLACE, [x, counts])
    ok = np.array_equal(x, whole)
    x = np.zeros(sum(counts), dtype)
    x[displs[me]:displs[me] + counts[me]] = inp(me, counts[me], dtype)
    if me == 0:
        comm.Gatherv(MPI.IN_PLACE, [x, counts], root=0)
        ok = ok and np.array_equal(x, whole)
    else:
        comm.Gatherv(inp(me, counts[me], dtype), None, root=0)
    data = inp(7, sum(counts), dtype)
    if me == 0:
        y = data.copy()
        comm.Scatterv([y, counts], MPI.IN_PLACE, root=0)
        ok = ok and np.array_equal(y, data)
    else:
        y = np.zeros(counts[me], dtype)
        comm.Scatterv(None, y, root=0)
        ok = ok and np.array_equal(y, data[displs[me]:displs[me] + counts[me]])
    x = inp(me, sum(counts), dtype)
    comm.Reduce_scatter(MPI.IN_PLACE, [x, counts])
    total = sum(inp(r, sum(counts), dtype) for r in range(p)).astype(dtype)
    ok = ok and np.array_equal(x[:counts[me]], total[displs[me]:displs[me] + counts[me]])
    assert all_ranks_ok(ok)


# ---- the constants that are never data

def refused(comm):
    """Every call x every buffer slot where a constant may be given by mistake: (call, the
    argument named in the error, a function of the constant making the call)."""
    p, me = comm.size, comm.rank
    f = lambda n: np.ones(n, np.float32)            # noqa: E731
    return [
        ("Allreduce-recvbuf", "recvbuf", lambda c: comm.Allreduce(f(N), c)),
        ("Allreduce-sendbuf", "sendbuf", lambda c: comm.Allreduce(c, f(N))),
        ("Iallreduce-sendbuf", "sendbuf", lambda c: comm.Iallreduce(c, f(N))),
        ("Reduce-sendbuf", "sendbuf", lambda c: comm.Reduce(c, f(N), root=0)),
        ("Reduce_scatter-sendbuf", "sendbuf", lambda c: comm.Reduce_scatter(c, f(p * N))),
        ("Allgather-sendbuf", "sendbuf", lambda c: comm.Allgather(c, f(p * N))),
        ("Allgather-recvbuf", "recvbuf", lambda c: comm.Allgather(f(N), c)),
        ("Alltoall-sendbuf", "sendbuf", lambda c: comm.Alltoall(c, f(p * N))),
        ("Gather-sendbuf", "sendbuf", lambda c: comm.Gather(c, f(p * N), root=0)),
        ("Scatter-recvbuf", "recvbuf", lambda c: comm.Scatter(f(p * N), c, root=0)),
        ("Bcast", "buf", lambda c: comm.Bcast(c)),
        ("Send", "buf", lambda c: comm.Send(c, dest=me)),
        ("Isend", "buf", lambda c: comm.Isend(c, dest=me)),
        ("Recv", "buf", lambda c: comm.Recv(c, source=me)),
        ("Sendrecv", "sendbuf", lambda c: comm.Sendrecv(c, me, f(N), me)),
        ("Scan-recvbuf", "recvbuf", lambda c: comm.Scan(f(N), c)),
        ("Allgatherv-recvbuf", "recvbuf", lambda c: comm.Allgatherv(f(1), [c, [1] * p])),
        ("Alltoallv-recvbuf", "recvbuf", lambda c: comm.Alltoallv([f(p), [1] * p], c)),
    ]


@pytest.mark.parametrize("constant", ["BOTTOM", "BUFFER_AUTOMATIC", "IN_PLACE"])
def test_constants_are_never_data(comm, constant):
    """A buffer-protocol constant of mpi4py in a slot where it is not the in-place marker:
    TypeError naming the argument and the constant, raised on every rank (each calls it), and
    the communicator computes correctly afterwards."""
    c = getattr(MPI, constant)
    for name, arg, run in refused(comm):
        if constant == "IN_PLACE" and arg == "sendbuf" and not name.startswith(
                ("Sendrecv", "Reduce-", "Gather-")):
            continue                        # there it is the in-place form (tested above)
        if constant == "IN_PLACE" and name in ("Reduce-sendbuf", "Gather-sendbuf",
                                               "Scatter-recvbuf") and comm.rank == 0:
            continue                        # the root's in-place form
        with pytest.raises(TypeError, match=rf"^{arg}: MPI\.{constant} "):
            run(c)
    x = np.ones(4, np.uint8)
    comm.Allreduce(MPI.IN_PLACE, x)
    assert all_ranks_ok(np.all(x == comm.size))


def test_in_place_needs_the_other_buffer(comm):
    """sendbuf=MPI.IN_PLACE puts the data in recvbuf: recvbuf None is refused, naming it."""
    for run in (lambda: comm.Allreduce(MPI.IN_PLACE),
                lambda: comm.Allgather(MPI.IN_PLACE, None),
                lambda: comm.Alltoall(MPI.IN_PLACE),
                lambda: comm.Reduce_scatter(MPI.IN_PLACE)):
        with pytest.raises(TypeError, match=r"^recvbuf: required with sendbuf=MPI\.IN_PLACE"):
            run()
