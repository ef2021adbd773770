"""GPU collectives against numpy, under mpiexec (one device per rank, or ranks sharing one GPU
with their own NCCL_HOSTID: tests/gpu/run_one_gpu.sh). Skips without a GPU or without CuPy.

Every collective and point-to-point call, blocking and nonblocking (the I-variants), x every
NCCL op (SUM, PROD, MIN, MAX; AVG for floats) x every NCCL dtype (int8 ... float64, bfloat16
through ml_dtypes), against numpy results computed from every rank's host inputs, which are
gathered with mpi4py (``MPI.COMM_WORLD.allgather``), never from the library. Inputs keep the
reductions exact (small integers; products of +-1 and 2), so results are compared exactly;
AVG is compared with a tolerance (NCCL pre-multiplies by 1/nranks). Output buffers start with
values that differ from the expected result in every element, and out-of-place receive buffers
have a tail that must stay untouched, so a call that does nothing, or too much, fails.

The parametrization is built from constants (dtype and op names as strings): it is identical
on every rank (so the collectives match) and does not depend on CuPy or ml_dtypes being
importable. Anything a test skips on, it skips on every rank alike.
"""
import os

import numpy as np
import pytest

import aluminum_py as al

try:
    import cupy as cp
except Exception:           # not installed, or a CuPy that cannot load its CUDA libraries
    cp = None

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

WAIT = 60.0         # seconds: Wait(timeout=) / Waitall(timeout=) bound (host-transfer host parts)

GPU_ALGORITHMS = ["nccl", "ht_mpi", "ht_recursive_doubling", "ht_rabenseifner", "ht_ring", "auto"]
HT_ALGORITHMS = [a for a in GPU_ALGORITHMS if a.startswith("ht_")]
NCCL_DTYPES = ["int8", "uint8", "int32", "uint32", "int64", "uint64",
               "float16", "float32", "float64", "bfloat16"]
INT_DTYPES = NCCL_DTYPES[:6]
FLOAT_DTYPES = NCCL_DTYPES[6:]
UNSIGNED = {"uint8", "uint16", "uint32", "uint64"}
NCCL_OPS = ["SUM", "PROD", "MIN", "MAX", "AVG"]
OP_DTYPES = [(op, dt) for op in NCCL_OPS for dt in NCCL_DTYPES if op != "AVG" or dt in FLOAT_DTYPES]
SIZES = [1, 7, 1 << 16]
PLACES = ["inplace", "outofplace"]
EPS = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23, "float64": 2.0 ** -52}


# ----------------------------------------------------------------------------- helpers
def need_cupy():
    if cp is None:
        pytest.skip("CuPy is not installed")


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def gather_inputs(host: np.ndarray) -> np.ndarray:
    """Every rank's host array, stacked in rank order (mpi4py, not the library)."""
    return np.stack(world().allgather(host))


def cast(values, dt) -> np.ndarray:
    """Small integers (exact in every dtype used here) as `dt`."""
    return np.asarray(values, dtype=np.float64).astype(dt)


def comparable(a: np.ndarray) -> np.ndarray:
    """Floats (bfloat16 included: numpy kind 'V') as float64, for exact comparisons."""
    return a.astype(np.float64) if a.dtype.kind in "fV" else a


def garbage(exp: np.ndarray, dt=None) -> np.ndarray:
    """Initial contents of an output of dtype `dt` (default: exp's): differs from `exp` in
    every element."""
    return cast(np.where(comparable(exp) == 1, 2, 1), exp.dtype if dt is None else dt)


def tail(dt) -> np.ndarray:
    """Three sentinel elements after an output, which an operation must not write."""
    return cast([5, 6, 7], dt)


def with_tail(a: np.ndarray) -> np.ndarray:
    return np.concatenate([a, tail(a.dtype)])


def reduction_input(op: str, name: str, dt, rank: int, size: int, count: int) -> np.ndarray:
    """This rank's input for a reduction whose result is exact in `dt` (and in bfloat16)."""
    i = np.arange(count, dtype=np.int64)
    signed = name not in UNSIGNED
    if op == "PROD":            # +-1, 2, 3 (not 1 on at most 4 ranks): |product| <= 81
        v = np.where(rank < 4, 1 + (i + 2 * rank) % 3, 1)
        if signed:
            v = np.where((i + rank) % 5 == 1, -v, v)
    elif op in ("MIN", "MAX"):  # distinct over ranks in every element
        v = ((i + rank) % size) * 2 + i % 3 - (5 if signed else 0)
    elif op == "AVG":
        v = (3 * i + rank) % 7 + 1
    else:                       # SUM
        v = (3 * i + rank) % 7 - (3 if signed else 0)
    return cast(v, dt)


def payload(name: str, dt, rank: int, count: int) -> np.ndarray:
    """Data-movement input: distinct per rank and element; 64-bit integers use high bits."""
    i = np.arange(count, dtype=np.int64)
    v = (7 * i + 13 * rank) % 100 - (0 if name in UNSIGNED else 50)
    if name in ("int64", "uint64"):
        v = v + (1 << 40) * (rank + 1)
    return cast(v, dt)


def expected_reduction(op: str, stack: np.ndarray) -> np.ndarray:
    """numpy's reduction over ranks (axis 0) of the stacked inputs. Floats are reduced in
    float64 (exact for these inputs) and cast back, AVG stays float64; integers wrap as in
    the dtype."""
    dt = stack.dtype
    if dt.kind in "fV":
        f = stack.astype(np.float64)
        r = {"SUM": f.sum, "PROD": f.prod, "MIN": f.min, "MAX": f.max, "AVG": f.mean}[op](axis=0)
        return r if op == "AVG" else r.astype(dt)
    if op == "SUM":
        return stack.sum(axis=0, dtype=dt)
    if op == "PROD":
        return stack.prod(axis=0, dtype=dt)
    if op == "MIN":
        return stack.min(axis=0)
    if op == "MAX":
        return stack.max(axis=0)
    nz = stack != 0
    logical = {"LAND": lambda: nz.all(axis=0), "LOR": lambda: nz.any(axis=0),
               "LXOR": lambda: nz.sum(axis=0) % 2 == 1}
    if op in logical:
        return logical[op]().astype(dt)
    ufunc = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    return ufunc.reduce(stack, axis=0).astype(dt)


def assert_same(out: np.ndarray, exp: np.ndarray, what: str) -> None:
    assert out.dtype == exp.dtype, f"{what}: dtype {out.dtype}, expected {exp.dtype}"
    np.testing.assert_array_equal(comparable(out), comparable(exp), err_msg=what)


def assert_reduced(out, exp, op, name, size, scale, what) -> None:
    """Exact comparison; AVG within the rounding of NCCL's pre-multiplied sum (or of SUM then
    divide): (2 size + 2) ulps of the largest input."""
    if op == "AVG":
        atol = (2 * size + 2) * EPS[name] * max(scale, 1.0)
        np.testing.assert_allclose(out.astype(np.float64), exp, rtol=0, atol=atol, err_msg=what)
    else:
        assert_same(out, exp, what)


def result(stream, x, y, host, n, dt, what) -> np.ndarray:
    """The first `n` elements an operation wrote: into `y`, whose tail must be untouched, with
    `x` (the sendbuf) still equal to `host`; or, `y` None (in place), into `x`."""
    if y is None:
        (out,) = fetch(stream, x)
    else:
        out, sent = fetch(stream, y, x)
        assert_same(sent, host, what + ": sendbuf changed")
        assert_same(out[n:], tail(dt), what + ": wrote past the end")
    return out[:n]


def to_gpu(host: np.ndarray, stream):
    """A CuPy copy of `host`, made on `stream` (the communicator's)."""
    try:
        with stream:
            return cp.asarray(host)
    except (TypeError, ValueError) as e:
        if host.dtype.name == "bfloat16":       # CuPy < 14: every rank skips here alike
            pytest.skip(f"this CuPy has no bfloat16 arrays ({e})")
        raise


def fetch(stream, *arrays):
    """Device arrays as numpy arrays, copied in order on `stream` (which is synchronised)."""
    with stream:
        out = [cp.asnumpy(a, stream=stream) for a in arrays]
    stream.synchronize()
    return out


def check_request(req, algorithm: str) -> None:
    from aluminum_py.gpu import GpuRequest
    assert isinstance(req, GpuRequest)
    if algorithm == "auto":
        # no "cuda" tuning entry (conftest points AL_TUNING_FILE at a missing file): NCCL when
        # its library loads (the callers pass NCCL ops and dtypes only), else host transfer
        from aluminum_py import nccl
        assert req.algorithm == ("nccl" if nccl.available() else "ht_auto"), req.algorithm
    else:
        assert req.algorithm == algorithm


def run(blocking: bool, blocking_call, nonblocking_call, *args, **kwargs):
    """Call the blocking form (it returns None), or the nonblocking one, check its request and
    Wait (bounded for host-transfer requests)."""
    if blocking:
        assert blocking_call(*args, **kwargs) is None
        return
    req = nonblocking_call(*args, **kwargs)
    check_request(req, kwargs.get("algorithm", "nccl"))
    req.Wait(timeout=WAIT)


def label(blocking: bool, name: str) -> str:
    return name if blocking else "I" + name[0].lower() + name[1:]


@pytest.fixture(scope="module")
def comm(gpu_index):
    need_cupy()
    stream = cp.cuda.Stream(non_blocking=True)
    c = al.Communicator(stream=stream)
    yield c, stream
    stream.synchronize()
    c.Free()


def expected_sum(comm, host):
    return np.sum(gather_inputs(host), axis=0)


# ----------------------------------------------------------------------------- allreduce
@pytest.mark.parametrize("algorithm", GPU_ALGORITHMS)
@pytest.mark.parametrize("count", [1, 7, 1 << 20])
def test_allreduce_blocking_and_nonblocking(comm, algorithm, count):
    c, stream = comm
    host = np.arange(count, dtype=np.float32) % 17 + c.rank
    with stream:
        x = cp.asarray(host)
        c.Allreduce(x, algorithm=algorithm)
        y = cp.asarray(host)
        req = c.Iallreduce(y, algorithm=algorithm)
        req.Wait()
        out_x, out_y = cp.asnumpy(x, stream=stream), cp.asnumpy(y, stream=stream)
    stream.synchronize()
    exp = expected_sum(c, host)
    assert np.array_equal(out_x, exp) and np.array_equal(out_y, exp)


@pytest.mark.parametrize("algorithm", GPU_ALGORITHMS)
@pytest.mark.parametrize("op,dtype", OP_DTYPES)
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("place", PLACES)
def test_allreduce(comm, place, count, op, dtype, algorithm):
    """Allreduce and Iallreduce, in place or out of place, against numpy."""
    c, stream = comm
    dt = np_dtype(dtype)
    host = reduction_input(op, dtype, dt, c.rank, c.size, count)
    stack = gather_inputs(host)
    exp = expected_reduction(op, stack)
    scale = float(np.abs(stack.astype(np.float64)).max())
    for blocking in (True, False):
        what = f"{label(blocking, 'Allreduce')} {place} {algorithm} {op} {dtype} n={count} rank {c.rank}"
        x = to_gpu(host, stream)
        y = None if place == "inplace" else to_gpu(with_tail(garbage(exp, dt)), stream)
        with stream:
            run(blocking, c.Allreduce, c.Iallreduce, x, y, op=getattr(al, op),
                algorithm=algorithm)
        assert_reduced(result(stream, x, y, host, count, dt, what), exp, op, dtype, c.size,
                       scale, what)


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("algorithm", GPU_ALGORITHMS)
def test_allreduce_integer_avg_is_refused(comm, algorithm, dtype):
    """AVG is not defined for integers (the capability table); every GPU algorithm refuses it
    with TypeError before anything is enqueued, and the communicator keeps working."""
    c, stream = comm
    dt = np_dtype(dtype)
    host = cast(np.arange(7) % 5, dt)
    x, y = to_gpu(host, stream), to_gpu(host, stream)
    for call in (lambda: c.Allreduce(x, op=al.AVG, algorithm=algorithm),
                 lambda: c.Allreduce(x, y, op="avg", algorithm=algorithm),
                 lambda: c.Iallreduce(x, op=al.AVG, algorithm=algorithm),
                 lambda: c.Iallreduce(x, y, op=al.AVG, algorithm=algorithm)):
        with pytest.raises(TypeError, match=f"AVG is not defined for dtype {dtype}"):
            call()
    with stream:
        c.Allreduce(x, algorithm=algorithm)
    out, other = fetch(stream, x, y)
    assert_same(out, expected_reduction("SUM", gather_inputs(host)), "SUM after the refused AVG")
    assert_same(other, host, "recvbuf of a refused AVG")


@pytest.mark.parametrize("dtype", ["uint8", "int64"])
@pytest.mark.parametrize("op", ["LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR"])
@pytest.mark.parametrize("algorithm", HT_ALGORITHMS + ["auto"])
def test_allreduce_ops_nccl_lacks(comm, algorithm, op, dtype):
    """Logical and bitwise ops: host transfer runs them ("auto" falls back to it); "nccl"
    refuses them with TypeError."""
    c, stream = comm
    dt = np_dtype(dtype)
    i = np.arange(1000)
    if op.startswith("L"):
        v = np.where((5 * i + 3 * c.rank) % 4 == 0, 0, 1 + (i + c.rank) % 3)
    else:
        v = (37 * i + 101 * c.rank + 11) % 256
    host = cast(v, dt)
    exp = expected_reduction(op, gather_inputs(host))
    x = to_gpu(host, stream)
    with pytest.raises(TypeError, match=f"NCCL has no {op}"):
        c.Allreduce(x, op=getattr(al, op), algorithm="nccl")
    for blocking in (True, False):
        what = f"{label(blocking, 'Allreduce')} {algorithm} {op} {dtype} rank {c.rank}"
        x = to_gpu(host, stream)
        y = to_gpu(garbage(exp), stream)
        with stream:
            if blocking:
                c.Allreduce(x, y, op=getattr(al, op), algorithm=algorithm)
            else:
                req = c.Iallreduce(x, y, op=getattr(al, op), algorithm=algorithm)
                assert req.algorithm.startswith("ht_"), what
                req.Wait(timeout=WAIT)
        (out,) = fetch(stream, y)
        assert_same(out, exp, what)


def complex_input(op: str, dt, rank: int, count: int) -> np.ndarray:
    i = np.arange(count)
    if op == "PROD":
        unit = np.array([1, 1j, -1, -1j])[(i + rank) % 4]
        v = unit * np.where(((i + rank) % 3 == 0) & (rank < 6), 2, 1)
    else:
        v = ((3 * i + rank) % 7 - 3) + 1j * ((i + 2 * rank) % 5 - 2)
    return np.asarray(v, dtype=np.complex128).astype(dt)


@pytest.mark.parametrize("dtype", ["int16", "uint16", "complex64", "complex128"])
@pytest.mark.parametrize("op", ["SUM", "PROD"])
@pytest.mark.parametrize("algorithm", HT_ALGORITHMS + ["auto"])
def test_allreduce_dtypes_nccl_lacks(comm, algorithm, op, dtype):
    """int16, uint16 and complex: host transfer reduces them ("auto" falls back to it);
    "nccl" refuses them with TypeError."""
    c, stream = comm
    dt = np_dtype(dtype)
    if dt.kind == "c":
        host = complex_input(op, dt, c.rank, 1000)
    else:
        host = reduction_input(op, dtype, dt, c.rank, c.size, 1000)
    stack = gather_inputs(host)
    exp = (stack.sum(axis=0, dtype=dt) if op == "SUM" else stack.prod(axis=0, dtype=dt))
    x = to_gpu(host, stream)
    with pytest.raises(TypeError, match="not an NCCL datatype"):
        c.Allreduce(x, op=getattr(al, op), algorithm="nccl")
    for blocking in (True, False):
        what = f"{label(blocking, 'Allreduce')} {algorithm} {op} {dtype} rank {c.rank}"
        x = to_gpu(host, stream)
        with stream:
            if blocking:
                c.Allreduce(x, op=getattr(al, op), algorithm=algorithm)
            else:
                req = c.Iallreduce(x, op=getattr(al, op), algorithm=algorithm)
                assert req.algorithm.startswith("ht_"), what
                req.Wait(timeout=WAIT)
        (out,) = fetch(stream, x)
        assert_same(out, exp, what)


def test_max_ctas_pool(comm):
    c, stream = comm
    with stream:
        x = cp.ones(1 << 16, dtype=cp.float32)
        c.Allreduce(x, algorithm="nccl", max_ctas=2)
        c.Allreduce(x, algorithm="nccl", max_ctas=2)   # cached split communicator
        out = cp.asnumpy(x, stream=stream)
    stream.synchronize()
    assert np.all(out == c.size ** 2)


@pytest.mark.parametrize("min_ctas,max_ctas", [(None, 1), (2, None), (1, 4), (4, 4)])
def test_cta_limits(comm, min_ctas, max_ctas):
    """NCCL under CTA limits (split communicators), blocking and nonblocking; host-transfer
    algorithms accept and ignore the limits."""
    c, stream = comm
    host = np.arange(5000, dtype=np.float32) % 11 + c.rank
    exp = expected_sum(c, host)
    kw = {"min_ctas": min_ctas, "max_ctas": max_ctas}
    with stream:
        x, y, z = cp.asarray(host), cp.asarray(host), cp.asarray(host)
        c.Allreduce(x, algorithm="nccl", **kw)
        req = c.Iallreduce(y, algorithm="nccl", **kw)
        req.Wait(timeout=WAIT)
        c.Allreduce(z, algorithm="ht_ring", **kw)
    for name, out in zip(("Allreduce", "Iallreduce", "ht_ring"), fetch(stream, x, y, z)):
        assert np.array_equal(out, exp), f"{name} {kw}"
    key = (min_ctas, max_ctas)
    assert key in c._gpu._nccl_pool


def test_many_nonblocking_in_flight(comm):
    """Twelve Iallreduce in flight at once (every algorithm, twice), then al.Waitall."""
    c, stream = comm
    algs = GPU_ALGORITHMS * 2
    hosts = [(np.arange(4099, dtype=np.float32) * (k + 1)) % 23 + c.rank for k in range(len(algs))]
    with stream:
        bufs = [cp.asarray(h) for h in hosts]
        reqs = [c.Iallreduce(b, op=al.MAX if k % 2 else al.SUM, algorithm=a)
                for k, (b, a) in enumerate(zip(bufs, algs))]
        al.Waitall(reqs, timeout=WAIT)
    outs = fetch(stream, *bufs)
    for k, (h, out) in enumerate(zip(hosts, outs)):
        stack = gather_inputs(h)
        exp = stack.max(axis=0) if k % 2 else stack.sum(axis=0)
        assert np.array_equal(out, exp), f"request {k} ({algs[k]})"


def test_operations_keep_stream_order(comm):
    """GPU collectives and CuPy kernels chained on the bound stream without a host sync in
    between: each sees the previous one's result."""
    c, stream = comm
    n = 1000
    host = (np.arange(n * c.size, dtype=np.float32) % 13) + c.rank
    stack = gather_inputs(host)
    s = stack.sum(axis=0)                                   # Allreduce (ht_ring)
    s2 = 2 * s                                              # CuPy kernel
    rs = c.size * s2                                        # Reduce_scatter SUM (all equal)
    exp = np.maximum(rs + 1, 0)                             # Allgather, +1, Iallreduce MAX
    with stream:
        x = cp.asarray(host)
        c.Allreduce(x, algorithm="ht_ring")
        x *= 2
        part = cp.empty(n, dtype=cp.float32)
        c.Reduce_scatter(x, part)
        full = cp.empty(n * c.size, dtype=cp.float32)
        c.Allgather(part, full)
        full += 1
        req = c.Iallreduce(full, op=al.MAX, algorithm="nccl")
        req.Wait()
        full = cp.maximum(full, 0)
    (out,) = fetch(stream, full)
    assert np.array_equal(out, exp)


# ----------------------------------------------------------------------------- reduce
@pytest.mark.parametrize("op,dtype", OP_DTYPES)
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("place", PLACES)
def test_reduce(comm, place, count, op, dtype):
    """Reduce (root: the last rank) and Ireduce (root 0), in place or out of place at root."""
    c, stream = comm
    dt = np_dtype(dtype)
    host = reduction_input(op, dtype, dt, c.rank, c.size, count)
    stack = gather_inputs(host)
    exp = expected_reduction(op, stack)
    scale = float(np.abs(stack.astype(np.float64)).max())
    for blocking, root in ((True, c.size - 1), (False, 0)):
        what = f"{label(blocking, 'Reduce')} {place} root {root} {op} {dtype} n={count} rank {c.rank}"
        x = to_gpu(host, stream)
        y = None
        if place == "outofplace" and c.rank == root:
            y = to_gpu(with_tail(garbage(exp, dt)), stream)
        with stream:
            run(blocking, c.Reduce, c.Ireduce, x, y, op=getattr(al, op), root=root)
        if c.rank != root:
            (sent,) = fetch(stream, x)
            assert_same(sent, host, what + ": sendbuf changed on a non-root")
        else:
            assert_reduced(result(stream, x, y, host, count, dt, what), exp, op, dtype, c.size,
                           scale, what)


# ----------------------------------------------------------------------------- reduce_scatter
@pytest.mark.parametrize("op,dtype", OP_DTYPES)
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("place", PLACES)
def test_reduce_scatter(comm, place, count, op, dtype):
    """Reduce_scatter and Ireduce_scatter, `count` elements per rank; in place the result is
    sendbuf[:count]."""
    c, stream = comm
    dt = np_dtype(dtype)
    host = reduction_input(op, dtype, dt, c.rank, c.size, count * c.size)
    stack = gather_inputs(host)
    exp = expected_reduction(op, stack)[c.rank * count:(c.rank + 1) * count]
    scale = float(np.abs(stack.astype(np.float64)).max())
    for blocking in (True, False):
        what = f"{label(blocking, 'Reduce_scatter')} {place} {op} {dtype} n={count} rank {c.rank}"
        x = to_gpu(host, stream)
        y = None if place == "inplace" else to_gpu(with_tail(garbage(exp, dt)), stream)
        with stream:
            run(blocking, c.Reduce_scatter, c.Ireduce_scatter, x, y, op=getattr(al, op))
        assert_reduced(result(stream, x, y, host, count, dt, what), exp, op, dtype, c.size,
                       scale, what)


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_reduce_and_reduce_scatter_refuse_integer_avg_and_non_nccl_ops(comm, dtype):
    c, stream = comm
    dt = np_dtype(dtype)
    host = cast(np.arange(4 * c.size) % 5, dt)
    x, y = to_gpu(host, stream), to_gpu(host, stream)
    calls = [lambda op: c.Reduce(x, y, op=op, root=0), lambda op: c.Ireduce(x, op=op, root=0),
             lambda op: c.Reduce_scatter(x, y, op=op), lambda op: c.Ireduce_scatter(x, op=op)]
    for call in calls:
        with pytest.raises(TypeError, match=f"AVG is not defined for dtype {dtype}"):
            call(al.AVG)
        with pytest.raises(TypeError, match="NCCL has no BXOR"):
            call(al.BXOR)
    out, other = fetch(stream, x, y)
    assert_same(out, host, "sendbuf after refused calls")
    assert_same(other, host, "recvbuf after refused calls")


# ----------------------------------------------------------------------------- data movement
@pytest.mark.parametrize("dtype", NCCL_DTYPES)
@pytest.mark.parametrize("count", SIZES)
def test_bcast(comm, count, dtype):
    """Bcast from the last rank, Ibcast from rank 0."""
    c, stream = comm
    dt = np_dtype(dtype)
    stack = gather_inputs(payload(dtype, dt, c.rank, count))
    for blocking, root in ((True, c.size - 1), (False, 0)):
        what = f"{label(blocking, 'Bcast')} root {root} {dtype} n={count} rank {c.rank}"
        exp = stack[root]
        b = to_gpu(exp if c.rank == root else garbage(exp), stream)
        with stream:
            run(blocking, c.Bcast, c.Ibcast, b, root=root)
        (out,) = fetch(stream, b)
        assert_same(out, exp, what)


@pytest.mark.parametrize("dtype", NCCL_DTYPES)
@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize("place", PLACES)
def test_allgather(comm, place, count, dtype):
    """Allgather and Iallgather; in place, block `rank` of sendbuf is the input."""
    c, stream = comm
    dt = np_dtype(dtype)
    mine = payload(dtype, dt, c.rank, count)
    exp = gather_inputs(mine).reshape(-1)
    for blocking in (True, False):
        what = f"{label(blocking, 'Allgather')} {place} {dtype} n={count} rank {c.rank}"
        if place == "inplace":
            start = garbage(exp)
            start[c.rank * count:(c.rank + 1) * count] = mine
            x, y = to_gpu(start, stream), None
        else:
            x, y = to_gpu(mine, stream), to_gpu(with_tail(garbage(exp)), stream)
        with stream:
            run(blocking, c.Allgather, c.Iallgather, x, y)
        assert_same(result(stream, x, y, mine, exp.size, dt, what), exp, what)


@pytest.mark.parametrize("dtype", NCCL_DTYPES)
@pytest.mark.parametrize("count", SIZES)
def test_alltoall(comm, count, dtype):
    """Alltoall and Ialltoall (`count` elements per peer)."""
    c, stream = comm
    dt = np_dtype(dtype)
    mine = payload(dtype, dt, c.rank, count * c.size)
    stack = gather_inputs(mine)
    exp = np.concatenate([stack[j][c.rank * count:(c.rank + 1) * count] for j in range(c.size)])
    for blocking in (True, False):
        what = f"{label(blocking, 'Alltoall')} {dtype} n={count} rank {c.rank}"
        x, y = to_gpu(mine, stream), to_gpu(with_tail(garbage(exp)), stream)
        with stream:
            run(blocking, c.Alltoall, c.Ialltoall, x, y)
        assert_same(result(stream, x, y, mine, exp.size, dt, what), exp, what)


@pytest.mark.parametrize("dtype", NCCL_DTYPES)
@pytest.mark.parametrize("count", SIZES)
def test_gather(comm, count, dtype):
    """Gather to the last rank, Igather to rank 0 (recvbuf at root only)."""
    c, stream = comm
    dt = np_dtype(dtype)
    mine = payload(dtype, dt, c.rank, count)
    exp = gather_inputs(mine).reshape(-1)
    for blocking, root in ((True, c.size - 1), (False, 0)):
        what = f"{label(blocking, 'Gather')} root {root} {dtype} n={count} rank {c.rank}"
        x = to_gpu(mine, stream)
        y = to_gpu(with_tail(garbage(exp)), stream) if c.rank == root else None
        with stream:
            run(blocking, c.Gather, c.Igather, x, y, root=root)
        if y is None:
            (sent,) = fetch(stream, x)
            assert_same(sent, mine, what + ": sendbuf changed")
            continue
        assert_same(result(stream, x, y, mine, exp.size, dt, what), exp, what)


@pytest.mark.parametrize("dtype", NCCL_DTYPES)
@pytest.mark.parametrize("count", SIZES)
def test_scatter(comm, count, dtype):
    """Scatter from the last rank, Iscatter from rank 0 (sendbuf at root only; the recvbuf's
    length is the count)."""
    c, stream = comm
    dt = np_dtype(dtype)
    stack = gather_inputs(payload(dtype, dt, c.rank, count * c.size))
    for blocking, root in ((True, c.size - 1), (False, 0)):
        what = f"{label(blocking, 'Scatter')} root {root} {dtype} n={count} rank {c.rank}"
        exp = stack[root][c.rank * count:(c.rank + 1) * count]
        x = to_gpu(stack[root], stream) if c.rank == root else None
        y = to_gpu(garbage(exp), stream)
        with stream:
            run(blocking, c.Scatter, c.Iscatter, x, y, root=root)
        if x is None:
            (out,) = fetch(stream, y)
        else:
            out, sent = fetch(stream, y, x)
            assert_same(sent, stack[root], what + ": sendbuf changed")
        assert_same(out, exp, what)


# ----------------------------------------------------------------------------- point to point
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", NCCL_DTYPES)
@pytest.mark.parametrize("count", SIZES)
def test_send_recv(comm, count, dtype):
    """A ring: Send/Recv (even ranks send first, odd ranks receive first), then Isend/Irecv in
    the same order on the internal stream, waited for with al.Waitall."""
    c, stream = comm
    dt = np_dtype(dtype)
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    mine = payload(dtype, dt, c.rank, count)
    exp = gather_inputs(mine)[left]
    for blocking in (True, False):
        what = f"{label(blocking, 'Send')}/{label(blocking, 'Recv')} {dtype} n={count} rank {c.rank}"
        x, r = to_gpu(mine, stream), to_gpu(garbage(exp), stream)
        with stream:
            if blocking:
                steps = [lambda: c.Send(x, right), lambda: c.Recv(r, left)]
                for step in (steps if c.rank % 2 == 0 else steps[::-1]):
                    assert step() is None
            else:
                steps = [lambda: c.Isend(x, dest=right), lambda: c.Irecv(r, source=left)]
                reqs = [step() for step in (steps if c.rank % 2 == 0 else steps[::-1])]
                for req in reqs:
                    check_request(req, "nccl")
                al.Waitall(reqs, timeout=WAIT)
        out, sent = fetch(stream, r, x)
        assert_same(sent, mine, what + ": sendbuf changed")
        assert_same(out, exp, what)


@pytest.mark.parametrize("dtype", NCCL_DTYPES)
@pytest.mark.parametrize("count", SIZES)
def test_sendrecv(comm, count, dtype):
    """Sendrecv and Isendrecv around a ring (to self at one rank)."""
    c, stream = comm
    dt = np_dtype(dtype)
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    mine = payload(dtype, dt, c.rank, count)
    exp = gather_inputs(mine)[left]
    for blocking in (True, False):
        what = f"{label(blocking, 'Sendrecv')} {dtype} n={count} rank {c.rank}"
        x, r = to_gpu(mine, stream), to_gpu(garbage(exp), stream)
        with stream:
            run(blocking, c.Sendrecv, c.Isendrecv, x, right, r, left)
        out, sent = fetch(stream, r, x)
        assert_same(sent, mine, what + ": sendbuf changed")
        assert_same(out, exp, what)


# ----------------------------------------------------------------------------- argument errors
MIXED = {  # name: (call(comm, sendbuf, recvbuf, blocking), recv elements per send element)
    "Allreduce": (lambda c, s, r, b: (c.Allreduce if b else c.Iallreduce)(s, r), 1),
    "Reduce_scatter": (lambda c, s, r, b: (c.Reduce_scatter if b else c.Ireduce_scatter)(s, r), 0),
    "Allgather": (lambda c, s, r, b: (c.Allgather if b else c.Iallgather)(s, r), -1),
    "Alltoall": (lambda c, s, r, b: (c.Alltoall if b else c.Ialltoall)(s, r), 1),
    "Sendrecv": (lambda c, s, r, b: (c.Sendrecv if b else c.Isendrecv)(s, c.rank, r, c.rank), 1),
}


@pytest.mark.parametrize("name", list(MIXED))
@pytest.mark.parametrize("gpu_side", ["sendbuf", "recvbuf"])
def test_gpu_and_host_buffers_in_one_call_are_refused(comm, name, gpu_side):
    """A GPU buffer next to a host buffer: TypeError on every rank before anything runs (the
    calls where both buffers matter on every rank), nothing written, the communicator works."""
    c, stream = comm
    call, per = MIXED[name]
    host = np.arange(4 * c.size, dtype=np.float32) + c.rank
    recv_count = {1: host.size, 0: host.size // c.size, -1: host.size * c.size}[per]
    for blocking in (True, False):
        send = to_gpu(host, stream) if gpu_side == "sendbuf" else host.copy()
        recv = (to_gpu(np.full(recv_count, -1, np.float32), stream) if gpu_side == "recvbuf"
                else np.full(recv_count, -1, np.float32))
        with pytest.raises(TypeError, match="GPU buffer|host buffer") as info:
            call(c, send, recv, blocking)
        what = f"{label(blocking, name)} with a GPU {gpu_side}: {info.value}"
        host_side = recv if gpu_side == "sendbuf" else send
        assert np.array_equal(np.asarray(host_side), host if gpu_side == "recvbuf"
                              else np.full(recv_count, -1, np.float32)), what
        (dev,) = fetch(stream, send if gpu_side == "sendbuf" else recv)
        assert_same(dev, host if gpu_side == "sendbuf" else np.full(recv_count, -1, np.float32), what)
    x = to_gpu(host, stream)
    c.Allreduce(x)
    (out,) = fetch(stream, x)
    assert_same(out, expected_sum(c, host), f"Allreduce after refused {name} calls")


def test_gpu_argument_errors(comm):
    """Bad GPU calls raise before anything is enqueued (on every rank alike); the
    communicator works afterwards."""
    from mpi4py import MPI
    c, stream = comm
    host = np.arange(4 * c.size, dtype=np.float32)
    x = to_gpu(host, stream)
    with pytest.raises(ValueError, match="not a GPU algorithm"):
        c.Allreduce(x, algorithm="ring")
    with pytest.raises(ValueError, match="not a GPU algorithm"):
        c.Iallreduce(x, algorithm="bogus")
    with pytest.raises(TypeError):
        c.Allreduce(x, np.empty_like(host))                  # host recvbuf next to a GPU sendbuf
    with pytest.raises(TypeError, match="dtype"):
        c.Allreduce(x, to_gpu(host.astype(np.float64), stream))
    with pytest.raises(ValueError, match="too short"):
        c.Allreduce(x, to_gpu(host[:3], stream))
    with pytest.raises(ValueError, match="max_ctas"):
        c.Allreduce(x, algorithm="nccl", max_ctas=0)
    with pytest.raises(ValueError, match="min_ctas"):
        c.Allreduce(x, algorithm="nccl", min_ctas=8, max_ctas=2)
    with pytest.raises(ValueError, match="tag"):
        c.Send(x, dest=0, tag=1)
    with pytest.raises(ValueError, match="tag"):
        c.Isendrecv(x, 0, to_gpu(host, stream), 0, tag=3)
    with pytest.raises(al.UnavailableError, match="ANY_SOURCE"):
        c.Recv(x, source=MPI.ANY_SOURCE)
    with pytest.raises(ValueError, match="recvbuf"):
        c.Alltoall(x)
    with pytest.raises(TypeError, match="not an NCCL datatype"):
        c.Bcast(to_gpu(host.astype(np.int16), stream), root=0)
    if c.size > 1:
        with pytest.raises(ValueError, match="divisible"):
            c.Reduce_scatter(to_gpu(host[:-1], stream))
    with stream:
        c.Allreduce(x, algorithm="nccl")
    (out,) = fetch(stream, x)
    assert np.array_equal(out, host * c.size)


# ----------------------------------------------------------------------------- device, lifetime
def _fresh(stream=None):
    need_cupy()
    s = stream or cp.cuda.Stream(non_blocking=True)
    return al.Communicator(stream=s), s


def test_device_of_the_current_context(comm, gpu_index):
    from aluminum_py import gpu
    c, _ = comm
    assert cp.cuda.Device().id == gpu_index
    assert al._core.cuda_current_device(al.config.cuda_driver()) == cp.cuda.Device().id == gpu.current_device()
    assert c._gpu.device.ordinal == cp.cuda.Device().id


def test_free_destroys_the_internal_stream_after_its_work():
    c, stream = _fresh()
    with stream:
        x = cp.ones(1 << 20, dtype=cp.float32)
        reqs = [c.Iallreduce(x, algorithm=a) for a in ("nccl", "ht_ring")]
        for r in reqs:
            r.Wait(timeout=60)
        out = cp.asnumpy(x, stream=stream)
    stream.synchronize()
    assert c._gpu._internal is not None
    c.Free()                                   # cuStreamDestroy after the last op on it
    assert c._gpu._internal is None and c._gpu._ctl is None
    assert np.all(out == c.size ** 2)


def test_nonblocking_nccl_communicator_under_hang_timeout(monkeypatch):
    from aluminum_py import config
    monkeypatch.setattr(config, "_hang_timeout", 60.0)
    c, stream = _fresh()
    with stream:
        x = cp.full(1000, 2.0, dtype=cp.float32)
        c.Allreduce(x, algorithm="nccl")
        c.Allreduce(x, algorithm="nccl", max_ctas=2)           # a nonblocking split too
        with al.nccl.group():
            pass
        out = cp.asnumpy(x, stream=stream)
    stream.synchronize()
    assert c._gpu._nccl_base.config["blocking"] is False
    assert np.all(out == 2.0 * c.size ** 2)
    c.Free()


SYNC_SHAPES = [(300,), (64, 64), (7,), (1 << 16,)]


def synchronize_steps(c, stream, grads, sync, steps):
    """`steps` training steps: set each gradient, report them in backward order, wait, and
    check every gradient is the average over ranks (numpy, from every rank's inputs)."""
    from mpi4py import MPI
    for step in range(steps):
        host = [(np.arange(np.prod(g.shape), dtype=np.float32).reshape(g.shape) % 13) + c.rank + step
                for g in grads]
        for g, h in zip(grads, host):
            g.set(h, stream=stream)
        for i in reversed(range(len(grads))):
            sync.grad_ready(i)
        sync.wait()
        out = [cp.asnumpy(g, stream=stream) for g in grads]
        stream.synchronize()
        for o, h in zip(out, host):
            exp = np.sum(np.stack(MPI.COMM_WORLD.allgather(h)), axis=0) / c.size
            assert np.array_equal(o, exp)


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_gradient_synchronizer_gpu(comm, policy):
    """GradientSynchronizer over CuPy gradients: every step's average equals numpy's; policy
    "auto" finishes tuning (device-synchronised step timings) and keeps one candidate."""
    from aluminum_py.overlap import GradientSynchronizer
    c, stream = comm
    with stream:
        grads = [cp.zeros(s, dtype=cp.float32) for s in SYNC_SHAPES]
        opts = {"threshold": 1 << 14} if policy == "fixed" else {"tune_steps": (1, 2)}
        sync = GradientSynchronizer(c, grads, policy=policy, **opts)
        synchronize_steps(c, stream, grads, sync, 12)
    if policy == "auto":
        assert sync.chosen is not None


def test_libra_plan_limits_each_bucket(comm):
    """GradientSynchronizer with policy "libra" on device gradients: each bucket's allreduce
    runs on a communicator with its planned maxCTAs (threads / 512, rounded up); on the NCCL
    stand-in the launches themselves are checked (aluminum_py.testing.nccl_launches)."""
    from aluminum_py import nccl
    from aluminum_py.overlap import GradientSynchronizer
    from aluminum_py.planning.libra import Plan
    c, stream = comm
    plan = Plan(groups=[(0, 1), (2, 3)], threads=[1024, 4000], predicted_time=0.0)
    standin = nccl.library_path() == os.environ.get("AL_CUDA_LIBRARY")
    if standin:
        from aluminum_py.testing import nccl_launches, reset_nccl_launches
        reset_nccl_launches()
    with stream:
        grads = [cp.zeros(s, dtype=cp.float32) for s in SYNC_SHAPES]
        sync = GradientSynchronizer(c, grads, policy="libra", plan=plan, algorithm="nccl")
        assert sync.max_ctas == plan.max_ctas() == [2, 8]
        synchronize_steps(c, stream, grads, sync, 3)
    assert {(None, 2), (None, 8)} <= set(c._gpu._nccl_pool)
    if standin:
        launches = [l for l in nccl_launches() if l.coll == "AllReduce"]
        sizes = [sum(int(np.prod(SYNC_SHAPES[i])) for i in members) for members in sync.buckets]
        assert [(l.count, l.max_ctas) for l in launches] == \
            [(sizes[b], sync.max_ctas[b]) for _ in range(3) for b in range(len(sync.buckets))]


# ----------------------------------------------------------------------------- PyTorch
def _torch(gpu_index):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    torch.cuda.set_device(gpu_index)
    return torch


@pytest.fixture(scope="module")
def torch_comm(gpu_index):
    torch = _torch(gpu_index)
    s = torch.cuda.Stream()
    c = al.Communicator(stream=s)
    yield torch, c, s
    s.synchronize()
    c.Free()


def test_torch_bfloat16_through_dlpack(gpu_index):
    torch = _torch(gpu_index)
    s = torch.cuda.Stream()
    c = al.Communicator(stream=s)
    with torch.cuda.stream(s):
        x = torch.full((1000,), 1.5, dtype=torch.bfloat16, device="cuda")
        y = x.clone()
        c.Allreduce(x, algorithm="nccl")
        c.Allreduce(y, algorithm="ht_ring")
    s.synchronize()
    assert torch.all(x.float().cpu() == 1.5 * c.size) and torch.all(y.float().cpu() == 1.5 * c.size)
    c.Free()


@pytest.mark.parametrize("algorithm", ["nccl", "ht_ring"])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "int64", "float16", "bfloat16",
                                   "float32", "float64"])
def test_torch_allreduce_and_bcast(torch_comm, dtype, algorithm):
    """PyTorch CUDA tensors (DLPack): Allreduce and Iallreduce SUM, and Bcast, against numpy."""
    torch, c, s = torch_comm
    tdt = getattr(torch, dtype)
    host = reduction_input("SUM", dtype, np.float64, c.rank, c.size, 1001)
    stack = gather_inputs(host)
    exp = stack.sum(axis=0)
    with torch.cuda.stream(s):
        x = torch.tensor(host, device="cuda").to(tdt)
        y = torch.tensor(host, device="cuda").to(tdt)
        b = torch.tensor(stack[0] if c.rank == 0 else stack[0] + 1, device="cuda").to(tdt)
        c.Allreduce(x, algorithm=algorithm)
        req = c.Iallreduce(y, algorithm=algorithm)
        req.Wait(timeout=WAIT)
        c.Bcast(b, root=0)
        outs = [t.to(torch.float64).cpu() for t in (x, y, b)]
    s.synchronize()
    for name, out, e in zip(("Allreduce", "Iallreduce", "Bcast"), outs, (exp, exp, stack[0])):
        np.testing.assert_array_equal(out.numpy(), e, err_msg=f"{name} {algorithm} {dtype}")


# ----------------------------------------------------------------------------- edge cases (last:
# a hang here cannot hide the results above)
@pytest.mark.parametrize("algorithm", GPU_ALGORITHMS)
def test_allreduce_empty(comm, algorithm):
    """Count 0 works (api.md: "Any count works, 0 included") and leaves the stream usable."""
    c, stream = comm
    with stream:
        e = cp.empty(0, dtype=cp.float32)
        c.Allreduce(e, algorithm=algorithm)
        req = c.Iallreduce(e, cp.empty(0, dtype=cp.float32), algorithm=algorithm)
        req.Wait(timeout=WAIT)
        x = cp.full(5, c.rank + 1.0, dtype=cp.float32)
        c.Allreduce(x, algorithm=algorithm)
    (out,) = fetch(stream, x)
    assert np.all(out == c.size * (c.size + 1) / 2)
