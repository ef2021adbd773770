"""Allreduce: every algorithm x op x dtype x {in place, out of place} x {blocking, nonblocking}
over sizes 0, 1, 2, 3, 7, odd and large, checked against numpy on all ranks' inputs."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import aluminum_py as al
from aluminum_py.testing import at_page_offset
from conftest import (DTYPES, all_ranks_ok, differences, every_rank, gather_all, make_input,
                      ops_for, ramp, ramp_reference, reference)

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

ALGORITHMS = ["mpi", "recursive_doubling", "rabenseifner", "ring", "auto"]
SIZES = [0, 1, 2, 3, 7, 64, 1001, 65537]


_AUTO_CHOICE = {}


def expected_algorithm(comm, x, algorithm):
    """The algorithm that must run: auto's choice for this message (Communicator.explain), else
    the one asked for."""
    if algorithm != "auto":
        return algorithm
    key = (id(comm), x.nbytes, x.dtype.str)
    if key not in _AUTO_CHOICE:
        _AUTO_CHOICE[key] = comm.explain(x.nbytes, x.dtype).algorithm
    return _AUTO_CHOICE[key]


def run_allreduce(comm, x, op, algorithm, inplace, blocking, failures):
    """Returns the result array. Appends to `failures` (asserted by the caller with
    all_ranks_ok) if the input was modified out of place, or if a nonblocking call reports an
    algorithm other than the requested one (auto: the one Communicator.explain names).  The
    blocking call does not say which algorithm ran."""
    def what():
        return f"{op.name} {x.dtype} n={x.size} {algorithm} inplace={inplace} blocking={blocking}"
    req = None
    if inplace:
        buf = x.copy()
        if blocking:
            comm.Allreduce(buf, op=op, algorithm=algorithm)
        else:
            req = comm.Iallreduce(buf, op=op, algorithm=algorithm)
            req.Wait(timeout=60)
        out = buf
    else:
        src = x.copy()
        out = np.full_like(x, 7)
        if blocking:
            comm.Allreduce(src, out, op=op, algorithm=algorithm)
        else:
            req = comm.Iallreduce(src, out, op=op, algorithm=algorithm)
            req.Wait(timeout=60)
        if not np.array_equal(src, x, equal_nan=True):
            failures.append(f"{what()}: out-of-place input was modified")
    if req is not None and req.algorithm != expected_algorithm(comm, x, algorithm):
        failures.append(f"{what()}: req.algorithm is {req.algorithm!r}, expected one of "
                        f"{expected_algorithm(comm, x, algorithm)!r} "
                        f"(auto: {comm.explain(x.nbytes, x.dtype)})")
    return out


def matrix_failures(comm, algorithm, dtypes, sizes) -> list:
    """Failures (strings) of `algorithm` over dtypes x their ops x sizes x in place or not x
    blocking or not, each result checked against numpy on every rank's inputs."""
    failures = []
    for dtype in dtypes:
        for op in ops_for(dtype):
            for count in sizes:
                x = make_input(dtype, op, count, seed=count + 31 * op.code, rank=comm.rank)
                expected = reference(op, gather_all(x), comm.size)
                for inplace in (False, True):
                    for blocking in (True, False):
                        got = run_allreduce(comm, x, op, algorithm, inplace, blocking, failures)
                        failures += differences(f"{dtype} {op.name} n={count} "
                                                f"inplace={inplace} blocking={blocking}",
                                                got, expected)
    return failures


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_matrix(comm, algorithm, dtype):
    failures = matrix_failures(comm, algorithm, [dtype], SIZES)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_large(comm, algorithm):
    """4 Mi float32 elements (16 MiB), a count not divisible by 3 or 4."""
    n = (4 << 20) + 5
    x = make_input("float32", al.SUM, n, seed=5, rank=comm.rank)
    expected = reference(al.SUM, gather_all(x), comm.size)
    failures = []
    for inplace in (False, True):
        got = run_allreduce(comm, x, al.SUM, algorithm, inplace, inplace, failures)
        failures += differences(f"inplace={inplace}", got, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_results_identical_on_all_ranks(comm, algorithm):
    """Arbitrary floats (not exact): every rank must hold bit-identical results."""
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(10007).astype(np.float64)
    exact = np.sum(gather_all(x), axis=0)
    comm.Allreduce(x, algorithm=algorithm)
    stack = gather_all(x)
    failures = [f"rank {r} differs from rank 0 at {np.flatnonzero(s != stack[0])[:5]}"
                for r, s in enumerate(stack) if not np.array_equal(stack[0], s)]
    if not np.allclose(x, exact, rtol=1e-12, atol=1e-12):
        bad = np.flatnonzero(~np.isclose(x, exact, rtol=1e-12, atol=1e-12))[:5]
        failures.append(f"rank {comm.rank}: at {bad} got {x[bad]} expected about {exact[bad]}")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_buffer_protocol_objects(comm):
    """bytearray, array.array and memoryview work like numpy arrays."""
    import array
    p, r = comm.size, comm.rank
    failures = []
    a = array.array("d", ramp(5, 0, r, np.float64))
    comm.Allreduce(a, algorithm="ring")
    failures += differences("array.array SUM", np.array(a), ramp_reference(5, 0, p, np.float64))

    def bvals(q):                                        # distinct per position and rank
        return np.array([1 + 3 * i + 40 * q for i in range(3)], dtype=np.uint8)
    b = bytearray(bvals(r).tobytes())
    out = bytearray(3)
    comm.Allreduce(b, out, op=al.MAX)
    failures += differences("bytearray MAX", np.frombuffer(out, np.uint8),
                            np.max([bvals(q) for q in range(p)], axis=0))
    m = memoryview(ramp(4, 2, r, np.int32))
    comm.Allreduce(m, op=al.MIN, algorithm="rabenseifner")
    failures += differences("memoryview MIN", np.asarray(m),
                            np.min([ramp(4, 2, q, np.int32) for q in range(p)], axis=0))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_many_in_flight(comm):
    """Many concurrent nonblocking ops of different algorithms on one communicator."""
    algs = ["recursive_doubling", "rabenseifner", "ring", "mpi"]
    # position-, rank- and op-dependent inputs: a misplaced block or two ops' data mixed up shows
    xs = [ramp(1000 + 37 * i, i, comm.rank, np.int64) for i in range(40)]
    reqs = [comm.Iallreduce(x, algorithm=algs[i % 4]) for i, x in enumerate(xs)]
    al.Waitall(reqs, timeout=60)
    failures = []
    for i, (x, req) in enumerate(zip(xs, reqs)):
        failures += differences(f"op {i} ({algs[i % 4]})", x,
                                ramp_reference(x.size, i, comm.size, np.int64))
        if req.algorithm != algs[i % 4]:
            failures.append(f"op {i}: req.algorithm {req.algorithm!r}, expected {algs[i % 4]!r}")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_two_communicators_progress_concurrently(comm):
    other = al.Communicator()
    n = 100000
    a = ramp(n, 0, comm.rank, np.float64)
    b = ramp(n, 1, comm.rank, np.float64)     # same size, different data: a swap shows
    ra = comm.Iallreduce(a, algorithm="ring")
    rb = other.Iallreduce(b, algorithm="rabenseifner")
    rb.Wait(timeout=60)
    ra.Wait(timeout=60)
    p = comm.size
    failures = (differences("ring on comm", a, ramp_reference(n, 0, p, np.float64))
                + differences("rabenseifner on other", b, ramp_reference(n, 1, p, np.float64)))
    other.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_blocking_after_nonblocking_keeps_order(comm):
    """A blocking op issued while nonblocking ops are pending is ordered behind them, and it
    matches the peers' blocking op whether this rank still had ops pending or not (some ranks
    are made to finish their nonblocking op first: every rank has issued its Iallreduce before
    its Allreduce, so waiting for it here cannot deadlock, and this rank's Allreduce then runs
    inline with nothing pending, while the others' may queue behind theirs)."""
    failures = []
    p = comm.size
    for it in range(30):
        for j, alg in enumerate(("mpi", "ring")):
            k = 4 * it + 2 * j
            x = ramp(5000, k, comm.rank)
            y = ramp(10, k + 1, comm.rank)      # not x's first 10 elements: a mix-up shows
            req = comm.Iallreduce(x, algorithm=alg)
            if (comm.rank + it) % 2:
                req.Wait(timeout=60)            # nothing pending: the Allreduce runs inline
            comm.Allreduce(y, algorithm=alg)
            req.Wait(timeout=60)
            failures += differences(f"it {it} {alg} nonblocking", x, ramp_reference(5000, k, p))
            failures += differences(f"it {it} {alg} blocking", y, ramp_reference(10, k + 1, p))
    assert all_ranks_ok(not failures), every_rank(failures)


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
    failures = []
    got = run_allreduce(comm, x, op, algorithm, inplace, blocking, failures)
    failures += differences(f"{dtype} n={count} {algorithm} inplace={inplace} blocking={blocking}",
                            got, expected)
    assert all_ranks_ok(not failures), every_rank(failures)


@settings(max_examples=25, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=64), min_size=0, max_size=300),
       algorithm=st.sampled_from(ALGORITHMS[:-1]), op=st.sampled_from([al.SUM, al.MIN, al.MAX, al.AVG]))
def test_allreduce_hypothesis_values(comm, values, algorithm, op):
    """Random float values (rank-shifted): close to numpy's result, identical on all ranks."""
    x = np.array(values, dtype=np.float64) * (comm.rank + 1)
    stack = gather_all(x)
    expected = reference(op, stack, comm.size)
    failures = []
    got = run_allreduce(comm, x, op, algorithm, False, True, failures)
    same = gather_all(got)
    if not np.allclose(got, expected, rtol=1e-12, atol=1e-6):
        failures.append(f"{op.name} {algorithm}: got {got[:5]} expected about {expected[:5]}")
    if not all(np.array_equal(same[0], s) for s in same):
        failures.append(f"{op.name} {algorithm}: results differ between ranks")
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "rabenseifner", "ring"])
@pytest.mark.parametrize("op", [al.MIN, al.MAX], ids=["MIN", "MAX"])
def test_min_max_nan_and_signed_zero(comm, algorithm, op):
    """NaN propagates, and every rank holds the same bits even for NaN and +-0 inputs."""
    vals = [np.nan, 1.0, 0.0, -0.0, -1.0]
    x = np.array([vals[(i + comm.rank) % 5] for i in range(50)], dtype=np.float64)
    stack_in = gather_all(x)
    comm.Allreduce(x, op=op, algorithm=algorithm)
    stack = gather_all(x)
    failures = [f"rank {r}'s bits differ from rank 0's" for r, s in enumerate(stack)
                if s.tobytes() != stack[0].tobytes()]
    failures += differences("NaN positions", np.isnan(x), np.isnan(stack_in).any(axis=0))
    with np.errstate(invalid="ignore"), __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore", RuntimeWarning)   # all-NaN columns
        ref = (np.nanmin if op is al.MIN else np.nanmax)(stack_in, axis=0)
    finite = ~np.isnan(x)
    failures += differences("non-NaN values", x[finite], ref[finite])
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "rabenseifner", "ring",
                                       "hierarchical", "hierarchical_p2p"])
def test_recvbuf_just_ahead_of_sendbuf(comm, algorithm):
    """A recvbuf 4-60 bytes after the sendbuf's page offset (the schedules then receive into
    a placed scratch, ext/core/schedule.pxi) or just behind it: exact results, the input
    untouched, for blocks above and below the 16 KiB where that starts; and with the ranks'
    placements different (the even ranks receive into scratch, the odd ranks into recvbuf)."""
    mixed = (16, 32) if comm.rank % 2 == 0 else (2048, 0)
    failures = []
    for dtype, op in (("float32", al.SUM), ("float64", al.AVG), ("int32", al.MAX)):
        for count in (3, 5000, 65537, 300001):
            x = make_input(dtype, op, count, seed=count, rank=comm.rank)
            expected = reference(op, gather_all(x), comm.size)
            esize = np.dtype(dtype).itemsize
            for send_off, recv_off in ((16, 32), (0, 8), (16, 64 - esize), (48, 16), mixed):
                send = at_page_offset(count * esize, send_off, dtype)
                send[:] = x
                out = at_page_offset(count * esize, recv_off, dtype)
                for blocking in (True, False):
                    out[:] = 7
                    if blocking:
                        comm.Allreduce(send, out, op=op, algorithm=algorithm)
                    else:
                        comm.Iallreduce(send, out, op=op, algorithm=algorithm).Wait(timeout=60)
                    what = f"{dtype} {op.name} n={count} at {send_off}->{recv_off} {blocking=}"
                    failures += differences(what, out, expected)
                    if not np.array_equal(send, x):
                        failures.append(f"{what}: the sendbuf changed")
    assert all_ranks_ok(not failures), every_rank(failures)
