"""The hierarchical allreduce: every op x dtype, in place and out, blocking and not, on the real
node layout (one node here) and on layouts forced with AL_NODE_LAYOUT (several emulated nodes,
uneven and interleaved), checked against numpy on all ranks' inputs."""
import os

import numpy as np
import pytest

import aluminum_py as al
from conftest import DTYPES, WORLD, all_ranks_ok, every_rank, gather_all
from test_allreduce import matrix_failures

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

SIZES = [0, 1, 3, 7, 1001, 20000]   # 20000: the split form (one rank per node: leaders by ring)


def layouts(p):
    """Node labels per rank: one node, a node per rank, pairs, uneven, interleaved."""
    out = {",".join(["0"] * p), ",".join(str(r) for r in range(p)),
           ",".join(str(r // 2) for r in range(p)), ",".join(str(r % 2) for r in range(p)),
           ",".join(["0"] + ["1"] * (p - 1))}
    return sorted(out)


def communicator(layout):
    old = os.environ.get("AL_NODE_LAYOUT")
    os.environ["AL_NODE_LAYOUT"] = layout
    try:
        return al.Communicator()
    finally:
        if old is None:
            del os.environ["AL_NODE_LAYOUT"]
        else:
            os.environ["AL_NODE_LAYOUT"] = old


def check(comm, dtypes, sizes):
    """Failures (strings) of hierarchical over dtypes x ops x sizes x in place x blocking."""
    return matrix_failures(comm, "hierarchical", dtypes, sizes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matrix_real_layout(comm, dtype):
    failures = check(comm, [dtype], SIZES)
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("index", range(5))
def test_forced_layouts(index):
    ls = layouts(WORLD.Get_size())
    if index >= len(ls):
        pytest.skip("fewer distinct layouts at this rank count")
    c = communicator(ls[index])
    try:
        failures = check(c, ["float32", "int64"], SIZES)
        failures += check(c, ["float64"], [20001, 70001])    # 70001: pieces by ring
    finally:
        c.Free()
    assert all_ranks_ok(not failures), every_rank([f"layout {ls[index]}: {f}" for f in failures])


def test_bad_layout_is_refused():
    os.environ["AL_NODE_LAYOUT"] = ",".join(["0"] * (WORLD.Get_size() + 1))
    try:
        with pytest.raises(ValueError, match="AL_NODE_LAYOUT"):
            al.Communicator()
    finally:
        del os.environ["AL_NODE_LAYOUT"]


def test_identical_results_on_forced_nodes():
    """Arbitrary floats: every rank holds bit-identical results, two emulated nodes."""
    p = WORLD.Get_size()
    c = communicator(",".join(str(r % 2) for r in range(p)))
    try:
        x = np.random.default_rng(c.rank).standard_normal(30011)
        exact = np.sum(gather_all(x), axis=0)
        c.Allreduce(x, algorithm="hierarchical")
        stack = gather_all(x)
    finally:
        c.Free()
    failures = [f"rank {r} differs" for r, s in enumerate(stack) if not np.array_equal(s, stack[0])]
    if not np.allclose(x, exact, rtol=1e-12, atol=1e-12):
        failures.append("not the sum")
    assert all_ranks_ok(not failures), every_rank(failures)
