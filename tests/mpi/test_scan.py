"""Scan and Exscan (and Iscan / Iexscan) on host buffers against numpy's prefix reductions of
every rank's inputs: every op x several dtypes x counts (0, 1, odd) x in place / out of place x
blocking / nonblocking; AVG as documented (the sum over the ranks counted, divided by how many);
Exscan's rank 0 recvbuf (in place: its sendbuf) untouched; inputs of out-of-place calls
untouched; bad arguments refused before any communication."""
import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from conftest import DTYPES, all_ranks_ok, every_rank, gather_all, make_input, ops_for, reference

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

COUNTS = [0, 1, 7]
# every valid op on these (int, unsigned, half, float, complex); SUM and the last op elsewhere
ALL_OPS = [d for d in ("int32", "uint8", "float16", "float64", "complex64") if d in DTYPES]
FILL = 7


def expected_prefix(op, stack, upto: int) -> np.ndarray:
    """numpy's reduction of ranks 0..upto-1 (conftest.reference: AVG divides by `upto`)."""
    return reference(op, stack[:upto], upto)


def run(comm, name, blocking, *args, **kwargs):
    if blocking:
        assert getattr(comm, name)(*args, **kwargs) is None
        return
    req = getattr(comm, "I" + name.lower())(*args, **kwargs)
    assert isinstance(req, al.Request) and req.algorithm == "mpi"
    req.Wait(timeout=60)
    assert req.Test()


def differ(failures, what, got, expected):
    if got.dtype != expected.dtype or got.shape != expected.shape or not np.array_equal(got, expected):
        bad = np.flatnonzero(got != expected)[:4] if got.shape == expected.shape else []
        failures.append(f"{what}: at {bad} got {got[bad] if len(bad) else got} expected "
                        f"{expected[bad] if len(bad) else expected}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scan_exscan(comm, dtype):
    failures = []
    r = comm.rank
    ops = ops_for(dtype) if dtype in ALL_OPS else (al.SUM, ops_for(dtype)[-1])
    for op in ops:
        for count in COUNTS:
            x = make_input(dtype, op, count, seed=count + 31 * op.code, rank=r)
            stack = gather_all(x)
            inclusive = expected_prefix(op, stack, r + 1)
            exclusive = expected_prefix(op, stack, r) if r else np.full(count, FILL, dtype)
            for blocking in (True, False):
                what = f"{op.name} n={count} blocking={blocking}"
                for name, want in (("Scan", inclusive), ("Exscan", exclusive)):
                    src, out = x.copy(), np.full(count, FILL, dtype)
                    run(comm, name, blocking, src, out, op=op)
                    differ(failures, f"{name} {what}", out, want)
                    differ(failures, f"{name} {what} input", src, x)
                    for form in ("recvbuf=None", "IN_PLACE"):   # rank 0 of Exscan: input stays
                        buf = x.copy()
                        args = (buf, None) if form == "recvbuf=None" else (MPI.IN_PLACE, buf)
                        run(comm, name, blocking, *args, op=op)
                        differ(failures, f"{name} {what} in place ({form})", buf,
                               x if name == "Exscan" and r == 0 else want)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_avg_is_the_mean_of_the_ranks_counted(comm):
    """AVG: Scan's on rank r is the mean over ranks 0..r, Exscan's the mean over 0..r-1 (exact
    here: sums of small integers divided in float64)."""
    r = comm.rank
    x = np.array([r + 1.0, 10.0 * r, -r], dtype=np.float64)
    scan, exscan = np.zeros(3), np.full(3, -1.0)
    comm.Scan(x, scan, op=al.AVG)
    comm.Exscan(x, exscan, op=al.AVG)
    prefix = np.array([[k + 1.0, 10.0 * k, -k] for k in range(r + 1)])
    failures = []
    differ(failures, "Scan AVG", scan, prefix.sum(axis=0) / (r + 1))
    differ(failures, "Exscan AVG", exscan,
           prefix[:r].sum(axis=0) / r if r else np.full(3, -1.0))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_logical_results_are_0_1_on_every_rank(comm):
    """LAND/LOR/LXOR give 0/1 also where no reduction runs (Scan's rank 0, Exscan's rank 1:
    MPI copies an input there), as with Allreduce."""
    x = np.array([0, 2, 5, -3], dtype=np.int16)
    failures = []
    for op in (al.LAND, al.LOR, al.LXOR):
        out = np.full(4, FILL, np.int16)
        comm.Scan(x, out, op=op)
        differ(failures, f"Scan {op.name}", out, reference(op, np.stack([x] * (comm.rank + 1)),
                                                        comm.rank + 1))
        out = np.full(4, FILL, np.int16)
        comm.Exscan(x, out, op=op)
        if comm.rank:
            differ(failures, f"Exscan {op.name}", out,
                   reference(op, np.stack([x] * comm.rank), comm.rank))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_concurrent_nonblocking_scans(comm):
    """Several Iscan / Iexscan in flight at once, completed in reverse order: each lands in
    its own buffer."""
    r = comm.rank
    xs = [make_input("int64", al.SUM, 5 + k, seed=300 + k, rank=r) for k in range(6)]
    stacks = [gather_all(x) for x in xs]
    outs = [np.full(x.size, FILL, np.int64) for x in xs]
    reqs = [(comm.Iscan if k % 2 == 0 else comm.Iexscan)(x, o) for k, (x, o) in
            enumerate(zip(xs, outs))]
    for q in reversed(reqs):
        q.Wait(timeout=60)
    failures = []
    for k, (o, st) in enumerate(zip(outs, stacks)):
        if k % 2 == 0:
            differ(failures, f"Iscan {k}", o, st[:r + 1].sum(axis=0))
        elif r:
            differ(failures, f"Iexscan {k}", o, st[:r].sum(axis=0))
        else:
            differ(failures, f"Iexscan {k} rank 0", o, np.full(o.size, FILL, np.int64))
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.local
@pytest.mark.parametrize("name", ["Scan", "Exscan", "Iscan", "Iexscan"])
def test_bad_arguments(comm, name):
    """Refused before any communication (so every rank raises alone), naming the argument;
    buffers untouched."""
    f = getattr(comm, name)
    out = np.full(4, FILL, np.float32)
    with pytest.raises(TypeError, match="op: BAND is not defined"):
        f(np.ones(4, np.float32), out, op=al.BAND)
    with pytest.raises(TypeError, match="op: AVG is not defined"):
        f(np.ones(4, np.int32), np.zeros(4, np.int32), op=al.AVG)
    with pytest.raises(TypeError, match="recvbuf"):
        f(np.ones(4, np.float32), np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="recvbuf"):
        f(np.ones(4, np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="algorithm: .*'auto' or 'mpi'.*'ring'"):
        f(np.ones(4, np.float32), out, algorithm="ring")
    ro = np.ones(4, np.float32)
    ro.setflags(write=False)
    with pytest.raises(ValueError, match="recvbuf"):
        f(np.ones(4, np.float32), ro)
    with pytest.raises(ValueError, match="sendbuf"):
        f(ro)                                        # in place needs a writable buffer
    assert np.array_equal(out, np.full(4, FILL, np.float32))
