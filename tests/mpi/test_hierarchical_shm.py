"""`hierarchical` over each node's shared-memory segment, on nodes emulated with AL_NODE_LAYOUT
(2 x 2, 3 + 1, 2 + 1, interleaved; 2 x 1 and 1 x p have no node segment): every op x dtype x
count (0, 1, odd, larger than a slot, both forms) x in place or not x blocking or not against
numpy on all ranks' inputs; that the segment's rounds really advance; the fallback to the
point-to-point form when some node cannot make its segment (the same on every rank); the hang
timeout's message; its order among other nonblocking ops.  The plans themselves are checked for
many layouts without MPI in tests/test_hierarchical_shm_plan.py."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import schedules
from aluminum_py.topology import canonical_layout
from conftest import (DTYPES, WORLD, all_ranks_ok, differences, every_rank, gather_all, ramp,
                      ramp_reference, wait_for)
from test_allreduce import matrix_failures
from test_shm import late_peers, with_env

pytestmark = [pytest.mark.mpi, pytest.mark.layout]

TINY = {"AL_SHM_SLOT_BYTES": "4096", "AL_SHM_SMALL_BYTES": "1024"}
# 1001: the first form over several 4 KiB chunks; 20003: the reduce-scatter form (from
# HIER_SHM_SPLIT_FROM elements) with a tail on 2 and 3 ranks per node
SIZES = [0, 1, 7, 1001, 20003]
assert schedules.HIER_SHM_SPLIT_FROM <= 20003


def layouts(p):
    """Layouts with a node segment at this rank count: several nodes, one of several ranks."""
    return {2: [], 3: ["0,0,1", "0,1,0"], 4: ["0,0,1,1", "0,0,0,1", "0,1,0,1"]}.get(p, [])


def communicator(layout, env=None):
    return with_env({"AL_NODE_LAYOUT": layout, **(env or {})}, al.Communicator)


@pytest.fixture(scope="module", params=range(3))
def emulated(request):
    ls = layouts(WORLD.Get_size())
    if request.param >= len(ls):
        pytest.skip("no such layout at this rank count")
    c = communicator(ls[request.param], TINY)
    yield c
    c.Free()


def test_segments_where_a_node_has_several_ranks():
    """1 x p (the communicator's own segment serves "shm") and p x 1: no node segments; the
    emulated layouts above: one per node of several ranks, none on a node of one."""
    p = WORLD.Get_size()
    failures = []
    for layout in sorted({",".join(["0"] * p), ",".join(map(str, range(p)))}):
        c = communicator(layout)
        if c._host._node_segments is not None:
            failures.append(f"{layout}: node segments")
        c.Free()
    for layout in layouts(p):
        c = communicator(layout)
        seg = c._host._node_segments
        alone = layout.split(",").count(layout.split(",")[c.rank]) == 1
        if seg is None or (seg.info() is None) != alone:
            failures.append(f"{layout}: {seg and seg.info()} ({c._host._no_hier_shm})")
        c.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matrix(emulated, dtype):
    """Every op (AVG included) of `dtype`, every count, in place or not, blocking or not: every
    dtype on the first layout (2 x 2, 2 + 1), three on the others (time)."""
    first = canonical_layout(layouts(WORLD.Get_size())[0].split(","))
    if emulated._host.layout != first and dtype not in ("int8", "float16", "float64"):
        pytest.skip("every dtype on the first layout only")
    failures = matrix_failures(emulated, "hierarchical", [dtype], SIZES)
    assert all_ranks_ok(not failures), every_rank(failures)


def test_rounds_advance_and_match(emulated):
    """The shm path is taken: each allreduce advances the node segment's rounds, by the same
    number on every rank of a node (a node of one rank has no segment)."""
    seg = emulated._host._node_segments
    before = seg.info()
    x = ramp(5000, 3, emulated.rank)
    emulated.Allreduce(x, algorithm="hierarchical")
    after = seg.info()
    failures = differences("result", x, ramp_reference(5000, 3, emulated.size))
    if before is not None and after["rounds"] <= before["rounds"]:
        failures.append(f"rounds did not advance: {before} -> {after}")
    node = emulated._host.layout[emulated.rank]
    rounds = WORLD.allgather((node, None if after is None else after["rounds"]))
    if len({r for n, r in rounds if n == node}) != 1:
        failures.append(f"rounds differ inside node {node}: {rounds}")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_identical_results_on_all_ranks(emulated):
    """Arbitrary floats, both forms: every rank holds the same bits."""
    failures = []
    for n in (999, 30011):
        x = np.random.default_rng([emulated.rank, n]).standard_normal(n)
        exact = np.sum(gather_all(x), axis=0)
        emulated.Allreduce(x, algorithm="hierarchical")
        stack = gather_all(x)
        failures += [f"n={n}: rank {r} differs" for r, s in enumerate(stack)
                     if not np.array_equal(s, stack[0])]
        if not np.allclose(x, exact, rtol=1e-12, atol=1e-12):
            failures.append(f"n={n}: not the sum")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_in_call_order_among_other_ops(emulated):
    """Nonblocking hierarchical ops between ring and shm-free ops, then a blocking one behind
    them: every result right (the gate keeps the node's rounds in call order)."""
    r, p = emulated.rank, emulated.size
    bufs = [ramp(n, s, r) for s, n in enumerate((10, 20003, 7, 3000, 20003))]
    algs = ["hierarchical", "hierarchical", "ring", "hierarchical", "hierarchical"]
    reqs = [emulated.Iallreduce(b, algorithm=a) for b, a in zip(bufs[:4], algs)]
    emulated.Allreduce(bufs[4], algorithm=algs[4])
    al.Waitall(reqs)
    failures = []
    for s, (b, n) in enumerate(zip(bufs, (10, 20003, 7, 3000, 20003))):
        failures += differences(f"op {s}", b, ramp_reference(n, s, p))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_fallback_when_a_node_cannot_make_its_segment():
    """The ranks of node 0 disable their segment (AL_SHM_SLOT_BYTES=0: the node's first
    rank's value counts; at 4 ranks node 1 makes its own): no rank uses node segments, every
    rank says why, and hierarchical is right through its point-to-point form."""
    p = WORLD.Get_size()
    if p < 3:
        pytest.skip("needs a node of several ranks and a second node")
    layout = "0,0,1" if p == 3 else "0,0,1,1"
    first = layout.split(",")[WORLD.Get_rank()] == "0"
    c = communicator(layout, {"AL_SHM_SLOT_BYTES": "0" if first else "4096"})
    failures = []
    if c._host._node_segments is not None:
        failures.append("node segments made")
    if "AL_SHM_SLOT_BYTES=0" not in (c._host._no_hier_shm or ""):
        failures.append(f"why: {c._host._no_hier_shm!r}")
    failures += matrix_failures(c, "hierarchical", ["float32"], [0, 7, 20003])
    c.Free()
    assert all_ranks_ok(not failures), every_rank(failures)


def test_point_to_point_by_name(emulated):
    """"hierarchical_p2p" never touches the segment."""
    seg = emulated._host._node_segments
    before = seg.info()
    x = ramp(3000, 5, emulated.rank)
    emulated.Allreduce(x, algorithm="hierarchical_p2p")
    failures = differences("result", x, ramp_reference(3000, 5, emulated.size))
    if seg.info() != before:
        failures.append(f"the segment was used: {before} -> {seg.info()}")
    assert all_ranks_ok(not failures), every_rank(failures)


def test_hang_timeout_names_the_node_rank(emulated):
    """Rank 0 alone: it times out in the node phase, naming a node rank that has not published
    and its rank in the communicator; the op completes in the engine once the others join."""
    x = ramp(1000, 9, emulated.rank)
    failures = late_peers(emulated, lambda: emulated.Allreduce(x, algorithm="hierarchical"),
                          "allreduce/hierarchical: phase 1/")
    failures += differences("late op", x, ramp_reference(1000, 9, emulated.size))
    assert all_ranks_ok(not failures), every_rank(failures)


def test_hang_timeout_between_nodes():
    """2 x 2: node 0 calls, node 1 joins after node 0's leader gave up: the leader's error
    names the phase between nodes and the rank it receives from."""
    if WORLD.Get_size() != 4:
        pytest.skip("2 x 2 layout")
    c = communicator("0,0,1,1")
    x = ramp(100, 4, c.rank)
    err = None
    if c.rank < 2:
        try:
            with_env({"AL_HANG_TIMEOUT": "0.3"}, lambda: c.Allreduce(x, algorithm="hierarchical"))
        except al.TimeoutError as e:
            err = str(e)
    WORLD.Barrier()
    if c.rank >= 2:
        c.Allreduce(x, algorithm="hierarchical")
    failures = []
    if c.rank == 0 and (err is None or "between nodes" not in err or "recv from rank 2" not in err):
        failures.append(f"timeout error: {err!r}")
    if c.rank < 2 and not wait_for(lambda: c._state.pending == 0):
        failures.append("the timed-out op did not complete after the peers joined")
    failures += differences("late op", x, ramp_reference(100, 4, c.size))
    c.Free()
    assert all_ranks_ok(not failures), every_rank(failures)
