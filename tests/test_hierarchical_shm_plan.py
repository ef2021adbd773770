"""The phases of `hierarchical` over the nodes' segments (schedules.hierarchical_shm), executed for
every rank in numpy (schedules.simulate_hierarchical_shm: the node phases as the shm protocols
define them, the steps between nodes through the schedule simulator), for many layouts, counts
and both forms, against numpy; and what crosses nodes."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from aluminum_py import schedules
from aluminum_py.schedules import (LocalPhase, NetPhase, NodePhase, hierarchical_shm,
                                   simulate_hierarchical_shm)
from test_schedules import _layouts as schedule_layouts, inputs
from test_schedules import split_from  # noqa: F401  (the fixture: both forms at small counts)


def _layouts(p, rng):
    """test_schedules' layouts, plus nodes of three, that have a node segment to use: several
    nodes, one of them of several ranks."""
    out = schedule_layouts(p, rng) + [[r // 3 for r in range(p)]]
    return [lay for lay in out if 1 < len(set(lay)) < p]


@pytest.mark.parametrize("p", [3, 4, 5, 6, 8])
@pytest.mark.parametrize("split,ring_from", [(10 ** 9, 10 ** 9), (0, 10 ** 9), (0, 0)])
def test_every_layout(split_from, p, split, ring_from):
    split_from(split, ring_from)
    rng = np.random.default_rng(p)
    for layout in _layouts(p, rng):
        for count in [0, 1, 2, 3, 7, 12, 100]:
            xs = inputs(p, count, seed=p * 100 + count)
            for inplace in (False, True):
                for r, got in enumerate(simulate_hierarchical_shm(xs, np.add, inplace, layout)):
                    assert np.array_equal(got, np.sum(xs, axis=0)), (layout, count, inplace, r)
                # AVG: divided once, by one rank per element, before the node phases copy it
                avg = simulate_hierarchical_shm([x.astype(float) for x in xs], np.add, inplace,
                                                layout, divide=lambda a: a / p)
                for got in avg:
                    assert np.allclose(got, np.sum(xs, axis=0) / p)


@settings(max_examples=60, deadline=None)
@given(layout=st.lists(st.integers(0, 3), min_size=2, max_size=10), count=st.integers(0, 40),
       inplace=st.booleans(), split=st.booleans())
def test_max_hypothesis(layout, count, inplace, split):
    old = schedules.HIER_SHM_SPLIT_FROM
    schedules.HIER_SHM_SPLIT_FROM = 0 if split else old
    hierarchical_shm.cache_clear()
    try:
        xs = inputs(len(layout), count, seed=count)
        for got in simulate_hierarchical_shm(xs, np.maximum, inplace, layout):
            assert np.array_equal(got, np.max(xs, axis=0) if count else xs[0])
    finally:
        schedules.HIER_SHM_SPLIT_FROM = old
        hierarchical_shm.cache_clear()


def test_forms_and_what_crosses_nodes():
    """2 x 2: below the split, shm allreduce, the leaders' steps, shm bcast (only leaders cross);
    from it, every rank carries its half across nodes, to the same local rank of the other
    node, and the odd tail as well; in place through scratch.  Nodes of different sizes keep
    the first form at every size."""
    layout = (0, 0, 1, 1)
    n = schedules.HIER_SHM_SPLIT_FROM + 1
    small = [hierarchical_shm(4, r, n - 2, False, layout)[0] for r in range(4)]
    assert [type(ph) for ph in small[0]] == [NodePhase, NetPhase, LocalPhase, NodePhase]
    assert [type(ph) for ph in small[1]] == [NodePhase, NodePhase]
    assert small[0][0].coll == "allreduce" and small[0][-1].coll == "bcast"
    for r in range(4):
        phases, tmp = hierarchical_shm(4, r, n, False, layout)
        assert [getattr(ph, "coll", None) for ph in phases if isinstance(ph, NodePhase)] == [
            "allreduce", "reduce_scatter", "allgather"]       # (the tail, then the blocks)
        assert tmp == 0
        steps = [ph for ph in phases if isinstance(ph, NetPhase)][0].steps
        peers = {s.send_peer for s in steps if s.send_peer >= 0}
        assert peers == {r ^ 2}
        assert sum(s.send_cnt for s in steps) == n // 2 + 1
        phases, tmp = hierarchical_shm(4, r, n, True, layout)
        assert tmp == n // 2 and any(isinstance(ph, LocalPhase) and ph.what == "copy_tmp"
                                     for ph in phases)
    uneven = hierarchical_shm(3, 0, 10 ** 6, False, (0, 0, 1))[0]
    assert [getattr(ph, "coll", None) for ph in uneven if isinstance(ph, NodePhase)] == [
        "allreduce", "bcast"]
    assert hierarchical_shm(4, 0, 0, False, layout) == ((), 0)


def test_bytes_between_nodes_as_the_point_to_point_form():
    """What the phases between nodes send is what `bench cluster --expect-algorithm
    hierarchical` expects (computed from the point-to-point form), plus, in the reduce-scatter
    form, the tail that every node rank's group carries (k - 1 extra copies of t elements)."""
    from aluminum_py.bench.cluster import expected_nic_bytes
    for layout in [(0, 0, 1, 1), (0, 0, 0, 1, 1, 1), (0, 0, 1), (0, 1, 0, 1)]:
        p = len(layout)
        sizes = [layout.count(n) for n in set(layout)]
        for count in [1, 1000, schedules.HIER_SHM_SPLIT_FROM - 1, schedules.HIER_SHM_SPLIT_FROM,
                      schedules.HIER_SHM_SPLIT_FROM + 1, (1 << 20) + 2]:
            sent = [0] * len(sizes)
            for r in range(p):
                for ph in hierarchical_shm(p, r, count, False, layout)[0]:
                    if isinstance(ph, NetPhase):
                        sent[layout[r]] += sum(4 * s.send_cnt for s in ph.steps if s.send_peer >= 0
                                               and layout[s.send_peer] != layout[r])
            k = sizes[0]
            split = count >= schedules.HIER_SHM_SPLIT_FROM and len(set(sizes)) == 1
            extra = (k - 1) * (count % k) * 4 if split else 0
            assert sent == [s + extra for s, _ in expected_nic_bytes("hierarchical", layout,
                                                                      count, 4)], (layout, count)
