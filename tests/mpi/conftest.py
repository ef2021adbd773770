"""Fixtures and helpers for the multi-rank tests (run under mpiexec by tests/test_mpi_suite.py).

Results are always checked against numpy computed from every rank's inputs (gathered with
mpi4py), never against the library itself.
"""
import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.ops import DTYPE_CODES, OPS_FOR_KIND

WORLD = MPI.COMM_WORLD

DTYPES = [str(dt) for dt in DTYPE_CODES]
KIND = {str(dt): kind for dt, (_, kind) in DTYPE_CODES.items()}


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
