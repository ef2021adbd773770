"""Allreduce: every algorithm x op x dtype x {in place, out of place} x {blocking, nonblocking}
over sizes 0, 1, 2, 3, 7, odd and large, checked against numpy on all ranks' inputs."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import aluminum_py as al
from conftest import DTYPES, WORLD, all_ranks_ok, gather_all, make_input, ops_for, reference

pytestmark = pytest.mark.mpi

ALGORITHMS = ["mpi", "recursive_doubling", "rabenseifner", "ring", "auto"]
SIZES = [0, 1, 2, 3, 7, 64, 1001, 65537]


def run_allreduce(comm, x, op, algorithm, inplace, blocking):
    """Returns the result array; checks the input was not modified out of place."""
    if inplace:
        buf = x.copy()
        if blocking:
            comm.Allreduce(buf, op=op, algorithm=algorithm)
        else:
            req = comm.Iallreduce(buf, op=op, algorithm=algorithm)
            req.Wait(timeout=60)
        return buf
    src = x.copy()
    out = np.full_like(x, 7)
    if blocking:
        comm.Allreduce(src, out, op=op, algorithm=algorithm)
    else:
        req = comm.Iallreduce(src, out, op=op, algorithm=algorithm)
        assert req.algorithm in al.algorithms("allreduce", "host")
        req.Wait(timeout=60)
    assert np.array_equal(src, x, equal_nan=True), "out-of-place input was modified"
    return out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_matrix(comm, algorithm, dtype):
    failures = []
    for op in ops_for(dtype):
        for count in SIZES:
            x = make_input(dtype, op, count, seed=count + 31 * op.code, rank=comm.rank)
            expected = reference(op, gather_all(x), comm.size)
            for inplace in (False, True):
                for blocking in (True, False):
                    got = run_allreduce(comm, x, op, algorithm, inplace, blocking)
                    if not np.array_equal(got, expected):
                        bad = np.flatnonzero(got != expected)[:5]
                        failures.append(f"{op.name} n={count} inplace={inplace} "
                                        f"blocking={blocking}: at {bad} got {got[bad]} "
                                        f"expected {expected[bad]}")
    assert all_ranks_ok(not failures), failures[:10]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_large(comm, algorithm):
    """4 Mi float32 elements (16 MiB), a count not divisible by 3 or 4."""
    n = (4 << 20) + 5
    x = make_input("float32", al.SUM, n, seed=5, rank=comm.rank)
    expected = reference(al.SUM, gather_all(x), comm.size)
    for inplace in (False, True):
        got = run_allreduce(comm, x, al.SUM, algorithm, inplace, blocking=inplace)
        assert np.array_equal(got, expected)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_results_identical_on_all_ranks(comm, algorithm):
    """Arbitrary floats (not exact): every rank must hold bit-identical results."""
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(10007).astype(np.float64)
    comm.Allreduce(x, algorithm=algorithm)
    stack = gather_all(x)
    assert all(np.array_equal(stack[0], s) for s in stack)
    exact = np.sum(np.stack(WORLD.allgather(np.random.default_rng(comm.rank).standard_normal(10007))),
                   axis=0)
    np.testing.assert_allclose(x, exact, rtol=1e-12, atol=1e-12)


def test_buffer_protocol_objects(comm):
    """bytearray, array.array and memoryview work like numpy arrays."""
    import array
    a = array.array("d", [float(comm.rank)] * 5)
    comm.Allreduce(a, algorithm="ring")
    assert list(a) == [float(sum(range(comm.size)))] * 5
    b = bytearray([comm.rank + 1] * 3)
    out = bytearray(3)
    comm.Allreduce(b, out, op=al.MAX)
    assert list(out) == [comm.size] * 3
    m = memoryview(np.full(4, comm.rank, dtype=np.int32))
    comm.Allreduce(m, op=al.MIN, algorithm="rabenseifner")
    assert np.array_equal(np.asarray(m), np.zeros(4, np.int32))


def test_many_in_flight(comm):
    """Many concurrent nonblocking ops of different algorithms on one communicator."""
    algs = ["recursive_doubling", "rabenseifner", "ring", "mpi"]
    xs = [np.full(1000 + 37 * i, comm.rank + i, dtype=np.int64) for i in range(40)]
    reqs = [comm.Iallreduce(x, algorithm=algs[i % 4]) for i, x in enumerate(xs)]
    al.Waitall(reqs, timeout=60)
    for i, x in enumerate(xs):
        assert np.all(x == sum(r + i for r in range(comm.size)))


def test_two_communicators_progress_concurrently(comm):
    other = al.Communicator()
    a = np.full(100000, comm.rank, dtype=np.float64)
    b = np.full(100000, 2 * comm.rank, dtype=np.float64)
    ra = comm.Iallreduce(a, algorithm="ring")
    rb = other.Iallreduce(b, algorithm="rabenseifner")
    rb.Wait(timeout=60)
    ra.Wait(timeout=60)
    s = sum(range(comm.size))
    assert np.all(a == s) and np.all(b == 2 * s)
    other.Free()


def test_blocking_after_nonblocking_keeps_order(comm):
    """A blocking op issued while nonblocking ops are pending is ordered behind them, and it
    matches the peers' blocking op whether this rank still had ops pending or not (some ranks
    are made to finish their nonblocking op first)."""
    import time
    s = sum(range(comm.size))
    for it in range(30):
        for alg in ("mpi", "ring"):
            x = np.full(5000, comm.rank, dtype=np.float32)
            y = np.full(10, comm.rank, dtype=np.float32)
            req = comm.Iallreduce(x, algorithm=alg)
            if (comm.rank + it) % 2:
                time.sleep(0.002)       # this rank's Iallreduce likely done: runs inline
            comm.Allreduce(y, algorithm=alg)
            req.Wait(timeout=60)
            assert np.all(x == s) and np.all(y == s)


@settings(max_examples=40, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(count=st.integers(0, 5000), seed=st.integers(0, 2**31 - 1),
       algorithm=st.sampled_from(ALGORITHMS[:-1]),
       dtype=st.sampled_from(["int32", "float64", "uint8", "float16"]),
       inplace=st.booleans(), blocking=st.booleans())
def test_allreduce_hypothesis(comm, count, seed, algorithm, dtype, inplace, blocking):
    op = al.SUM
    x = make_input(dtype, op, count, seed=seed, rank=comm.rank)
    expected = reference(op, gather_all(x), comm.size)
    got = run_allreduce(comm, x, op, algorithm, inplace, blocking)
    assert all_ranks_ok(np.array_equal(got, expected))


@settings(max_examples=25, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=64), min_size=0, max_size=300),
       algorithm=st.sampled_from(ALGORITHMS[:-1]), op=st.sampled_from([al.SUM, al.MIN, al.MAX, al.AVG]))
def test_allreduce_hypothesis_values(comm, values, algorithm, op):
    """Random float values (rank-shifted): close to numpy's result, identical on all ranks."""
    x = np.array(values, dtype=np.float64) * (comm.rank + 1)
    stack = gather_all(x)
    expected = reference(op, stack, comm.size)
    got = run_allreduce(comm, x, op, algorithm, inplace=False, blocking=True)
    same = gather_all(got)
    ok = np.allclose(got, expected, rtol=1e-12, atol=1e-6) and all(np.array_equal(same[0], s) for s in same)
    assert all_ranks_ok(ok)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "rabenseifner", "ring"])
@pytest.mark.parametrize("op", [al.MIN, al.MAX], ids=["MIN", "MAX"])
def test_min_max_nan_and_signed_zero(comm, algorithm, op):
    """NaN propagates, and every rank holds the same bits even for NaN and +-0 inputs."""
    vals = [np.nan, 1.0, 0.0, -0.0, -1.0]
    x = np.array([vals[(i + comm.rank) % 5] for i in range(50)], dtype=np.float64)
    stack_in = gather_all(x)
    comm.Allreduce(x, op=op, algorithm=algorithm)
    stack = gather_all(x)
    assert all(s.tobytes() == stack[0].tobytes() for s in stack)
    assert np.array_equal(np.isnan(x), np.isnan(stack_in).any(axis=0))
    with np.errstate(invalid="ignore"), __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore", RuntimeWarning)   # all-NaN columns
        ref = (np.nanmin if op is al.MIN else np.nanmax)(stack_in, axis=0)
    finite = ~np.isnan(x)
    assert np.array_equal(x[finite], ref[finite])
