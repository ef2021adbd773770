"""Fixtures and helpers for the multi-rank tests (run under mpiexec by tests/test_mpi_suite.py).

Results are always checked against numpy computed from every rank's inputs (gathered with
mpi4py), never against the library itself.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.ops import DTYPES as _DTYPE_TABLE, OPS_FOR_KIND, supported_dtypes

WORLD = MPI.COMM_WORLD

# The dtypes a test parametrized by every dtype runs at the rank counts other than the runner's
# AL_TEST_LOCAL_RANKS (2): one of each kind (signed, unsigned, float, complex, bfloat16) and
# every element size (1, 2, 4, 8, 16 bytes). The reduction kernels are the same at every
# count; what a count changes (block boundaries, AVG's division) depends on kind and size.
EVERY_COUNT_DTYPES = ("int8", "uint16", "float32", "int64", "float64", "complex128", "bfloat16")


def at_this_count(dtypes, also=()) -> list:
    """`dtypes` (names), all of them at AL_TEST_LOCAL_RANKS ranks or when the variable is unset
    (a suite run by hand), else those in EVERY_COUNT_DTYPES or `also` (a kind of the file's
    own, such as torch's bool)."""
    want = os.environ.get("AL_TEST_LOCAL_RANKS")
    if not want or WORLD.size == int(want):
        return list(dtypes)
    return [d for d in dtypes if d in EVERY_COUNT_DTYPES or d in also]


DTYPES = at_this_count(supported_dtypes())   # bfloat16 where ml_dtypes is installed
KIND = {name: _DTYPE_TABLE[name][1] for name in supported_dtypes()}


@pytest.fixture(scope="session")
def comm():
    c = al.Communicator()
    yield c


def gather_all(x: np.ndarray) -> np.ndarray:
    """Every rank's array, stacked in rank order (shape (size, len))."""
    return np.stack(WORLD.allgather(np.array(x, copy=True)))


def all_ranks_ok(ok: bool) -> bool:
    """True only if `ok` holds on every rank (so all ranks fail a test together)."""
    return all(WORLD.allgather(bool(ok)))


def ops_for(dtype: str):
    return OPS_FOR_KIND[KIND[dtype]]


def make_input(dtype: str, op, count: int, seed: int, rank: int) -> np.ndarray:
    """Per-rank input whose reduction over <= 4 ranks is exact in `dtype` (so numpy's order of
    evaluation and ours agree bit for bit)."""
    rng = np.random.default_rng([seed, rank, count])
    dt = np.dtype(dtype)
    kind = KIND[dtype]
    unsigned = dt.kind == "u"
    name = op.name
    if name in ("PROD",):
        vals = np.array([1, 2] if unsigned else [-2, -1, 1, 2])
    elif name in ("LAND", "LOR", "LXOR"):
        vals = np.array([0, 1, 2, 5])
    elif name in ("BAND", "BOR", "BXOR"):
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, dtype=dt, endpoint=True)
    elif name in ("MIN", "MAX"):
        vals = np.arange(0, 100) if unsigned else np.arange(-50, 50)
    else:  # SUM, AVG
        vals = np.arange(0, 9) if unsigned else np.arange(-4, 5)
    if kind == "complex":
        re = rng.choice(vals if name != "PROD" else np.array([-1, 0, 1]), size=count)
        im = rng.choice(vals if name != "PROD" else np.array([-1, 0, 1]), size=count)
        return (re + 1j * im).astype(dt)
    return rng.choice(vals, size=count).astype(dt)


def reference(op, stack: np.ndarray, size: int) -> np.ndarray:
    """numpy's reduction of the stacked inputs, in the inputs' dtype."""
    dt = stack.dtype
    name = op.name
    if name == "SUM":
        return np.add.reduce(stack, axis=0, dtype=dt)
    if name == "AVG":
        return (np.add.reduce(stack, axis=0, dtype=dt) / dt.type(size)).astype(dt)
    if name == "PROD":
        return np.multiply.reduce(stack, axis=0, dtype=dt)
    if name == "MIN":
        return np.minimum.reduce(stack, axis=0)
    if name == "MAX":
        return np.maximum.reduce(stack, axis=0)
    if name in ("LAND", "LOR", "LXOR"):
        f = {"LAND": np.logical_and, "LOR": np.logical_or, "LXOR": np.logical_xor}[name]
        return f.reduce(stack != 0, axis=0).astype(dt)
    f = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[name]
    return f.reduce(stack, axis=0)


# ---------------------------------------------------------------------------- concurrency tests
import functools  # noqa: E402

RAMP_PERIOD = 65521     # a prime: below it, no two positions of one input hold the same value


def ramp(n: int, k: int, rank: int, dtype="float32") -> np.ndarray:
    """Input of op number `k` on `rank`: ``(arange(n) * (k + 1) + 1009 * rank + 31 * k) % 65521``.

    Unlike a constant, it differs at every position (within the period), for every op and for
    every rank, so a block that lands in the wrong place, a buffer swapped between two
    concurrent ops or a rank counted twice changes the result.  Values are below 65521, so the
    sum over <= 4 ranks (< 2**18) is exact in float32, float64 and int32/int64 alike.  Every
    rank's input is a pure function of (n, k, rank): a test can rebuild all of them
    (:func:`ramp_reference`) without gathering large buffers."""
    return _ramps(n, k, [rank], dtype)[0]


def _ramps(n: int, k: int, ranks, dtype) -> np.ndarray:
    """``ramp(n, k, r, dtype)`` for each r in `ranks`, stacked (one modulo pass for all)."""
    base = np.arange(n, dtype=np.int64)
    base *= k + 1
    base %= RAMP_PERIOD
    out = np.empty((len(ranks), n), dtype=dtype)
    for j, r in enumerate(ranks):
        v = base + (1009 * r + 31 * k) % RAMP_PERIOD
        v[v >= RAMP_PERIOD] -= RAMP_PERIOD
        out[j] = v
    return out


@functools.lru_cache(maxsize=16)
def _ramp_reference(n, k, size, dtype, op):
    out = reference(op, _ramps(n, k, range(size), dtype), size)
    out.setflags(write=False)
    return out


def ramp_reference(n: int, k: int, size: int, dtype="float32", op=al.SUM) -> np.ndarray:
    """numpy's reduction (conftest.reference) of every rank's ``ramp(n, k, rank, dtype)``
    (read-only: the last few are cached)."""
    return _ramp_reference(n, k, size, np.dtype(dtype).str, op)


def differences(what: str, got, expected) -> list:
    """[] if `got` equals `expected` (dtype, shape and every element), else one message saying
    where they differ (for a failures list asserted with all_ranks_ok)."""
    got = np.asarray(got)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return [f"{what}: got {got.dtype}{got.shape}, expected {expected.dtype}{expected.shape}"]
    if np.array_equal(got, expected):
        return []
    bad = np.flatnonzero(got != expected)
    return [f"{what}: {bad.size} elements differ, at {bad[:5]} got {got[bad[:5]]} "
            f"expected {expected[bad[:5]]}"]


def every_rank(failures, limit: int = 10) -> list:
    """Every rank's failure messages (the first `limit` of each), prefixed with the rank.
    Collective: use it as the message of
    ``assert all_ranks_ok(not failures), every_rank(failures)``, which every rank evaluates
    together (all_ranks_ok is the same on every rank), so a rank whose own checks passed still
    reports what differed elsewhere."""
    return [f"rank {r}: {m}" for r, fs in enumerate(WORLD.allgather(list(failures)[:limit]))
            for m in fs]


def phase(req) -> str:
    """Where a Request's op stands, from its state (never from a clock): "new" (queued in the
    progress engine, not started), "running" or "done"."""
    if req._op.describe().endswith(": new"):
        return "new"
    return "done" if req.done else "running"


def wait_for(predicate, seconds: float = 60.0) -> bool:
    """Poll `predicate` until it holds; False if it still does not after `seconds`: a guard
    against hanging, far above what any correct run needs (a state the test waits for, not a
    duration it measures)."""
    import time
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True
