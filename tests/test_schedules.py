"""The allreduce schedules, executed for all ranks in one process (no MPI)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from aluminum_py import schedules
from aluminum_py.topology import canonical_layout
from aluminum_py.schedules import (FROM_RECV, RECV_INTO, RECV_INTO_REDUCE, RECV_TMP_REDUCE,
                                   block_bounds, build, simulate)

ALGS = schedules.ALGORITHMS


def inputs(p, count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(-100, 100, size=count).astype(np.int64) for _ in range(p)]


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("p", range(1, 10))
@pytest.mark.parametrize("inplace", [False, True])
def test_simulated_sum(alg, p, inplace):
    for count in [0, 1, 2, 3, 5, 7, 8, 13, 64, 100]:
        xs = inputs(p, count, seed=p * 1000 + count)
        expected = np.sum(xs, axis=0)
        for r, got in enumerate(simulate(alg, xs, np.add, inplace)):
            assert np.array_equal(got, expected), (alg, p, count, r)


@pytest.mark.parametrize("alg", ["ring", "rabenseifner"])
@pytest.mark.parametrize("p", range(2, 10))
@pytest.mark.parametrize("inplace", [False, True])
def test_owned_blocks_scale_every_element_once(alg, p, inplace):
    """AVG divides at the owned steps: each element of every rank's result is scaled exactly
    once (x1000 on integers shows a double or missing scaling), by the same owner for all."""
    for count in [0, 1, 2, 3, 5, 7, 8, 13, 64, 100]:
        xs = inputs(p, count, seed=p * 7 + count)
        expected = np.sum(xs, axis=0) * 1000
        for r, got in enumerate(simulate(alg, xs, np.add, inplace, owned=lambda a: a * 1000)):
            assert np.array_equal(got, expected), (alg, p, count, r)
        for r in range(p):
            steps = build(alg, p, r, count, inplace)[0]
            assert sum(st.owned for st in steps) == 1     # every rank, folded out or not
        # float average: bit-identical on every rank, numpy's mean up to summation order
        fs = [x.astype(np.float64) * 0.37 for x in xs]
        res = simulate(alg, fs, np.add, inplace, owned=lambda a: a / p)
        assert all(np.array_equal(res[0], x) for x in res)
        assert np.allclose(res[0], np.sum(fs, axis=0) / p, rtol=1e-12, atol=1e-12)


def test_recursive_doubling_has_no_owned_block():
    for p in range(1, 9):
        for r in range(p):
            assert not any(st.owned for st in build("recursive_doubling", p, r, 50, False)[0])
    assert not any(st.owned for st in build("ring", 1, 0, 50, False)[0])


@settings(max_examples=60, deadline=None)
@given(alg=st.sampled_from(ALGS), p=st.integers(1, 17), count=st.integers(0, 300),
       inplace=st.booleans())
def test_simulated_max_hypothesis(alg, p, count, inplace):
    xs = inputs(p, count, seed=count)
    expected = np.max(xs, axis=0) if count else np.zeros(0, np.int64)
    for got in simulate(alg, xs, np.maximum, inplace):
        assert np.array_equal(got, expected)


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
def test_no_receive_into_region_being_sent(alg, p):
    """A step never receives into recvbuf where it simultaneously sends from recvbuf."""
    for count in [1, 7, 64, 101]:
        for inplace in (False, True):
            for r in range(p):
                for s in build(alg, p, r, count, inplace)[0]:
                    if s.recv_peer >= 0 and s.send_peer >= 0 and s.recv_mode in (RECV_INTO, RECV_INTO_REDUCE) \
                            and s.send_src == FROM_RECV:
                        assert s.send_off + s.send_cnt <= s.recv_off or s.recv_off + s.recv_cnt <= s.send_off


@pytest.mark.parametrize("alg", ALGS)
def test_out_of_place_needs_no_scratch_for_power_of_two(alg):
    """Out of place, the first reduction of each block lands straight in recvbuf."""
    steps, tmp = build(alg, 2, 0, 1000, False)
    assert tmp == 0
    assert any(s.recv_mode == RECV_INTO_REDUCE for s in steps)
    steps, tmp = build(alg, 2, 0, 1000, True)
    assert tmp > 0 and all(s.recv_mode != RECV_INTO_REDUCE for s in steps)


def test_step_counts_and_volumes():
    """Message counts and volumes match the algorithms' cost formulas."""
    n, p = 1 << 12, 8
    for r in range(p):
        rd, _ = build("recursive_doubling", p, r, n, False)
        assert len(rd) == 3 and all(s.send_cnt == n for s in rd)
        rab, _ = build("rabenseifner", p, r, n, False)
        assert len(rab) == 6 and sum(s.send_cnt for s in rab) == 2 * (p - 1) * n // p
        ring, _ = build("ring", p, r, n, False)
        assert len(ring) == 2 * (p - 1) and sum(s.send_cnt for s in ring) == 2 * (p - 1) * n // p


def test_fold_for_non_power_of_two():
    # p = 6: ranks 0..3 fold in pairs, 0 and 2 hand their data over and get the result back
    steps, _ = build("recursive_doubling", 6, 0, 10, False)
    assert [(s.send_peer, s.recv_peer) for s in steps] == [(1, -1), (-1, 1)]
    steps, _ = build("recursive_doubling", 6, 1, 10, False)
    assert steps[0].recv_peer == 0 and steps[-1].send_peer == 0


def test_block_bounds():
    assert block_bounds(10, 4) == [0, 3, 6, 8, 10]
    assert block_bounds(2, 4) == [0, 1, 2, 2, 2]
    assert block_bounds(0, 3) == [0, 0, 0, 0]


def test_single_rank_is_a_copy():
    steps, tmp = build("ring", 1, 0, 5, False)
    assert len(steps) == 1 and steps[0].copy_cnt == 5 and tmp == 0
    assert build("ring", 1, 0, 5, True)[0] == ()


# ---------------------------------------------------------------------------- hierarchical
def _layouts(p, rng):
    """One node, a node per rank, pairs, interleaved, uneven, and random labels."""
    out = [[0] * p, list(range(p)), [r // 2 for r in range(p)], [r % 2 for r in range(p)],
           [0] + [1] * (p - 1), [min(r, 2) for r in range(p)]]
    out += [list(rng.integers(0, max(1, p // 2) + 1, p)) for _ in range(4)]
    return out


@pytest.mark.parametrize("p", range(1, 10))
@pytest.mark.parametrize("inplace", [False, True])
def test_hierarchical_every_layout(p, inplace):
    rng = np.random.default_rng(p)
    for layout in _layouts(p, rng):
        for count in [0, 1, 2, 7, 100, schedules.HIER_RING_FROM + 3,
                      schedules.HIER_SPLIT_FROM + 5]:
            xs = inputs(p, count, seed=p * 1000 + count)
            expected = np.sum(xs, axis=0)
            for r, got in enumerate(simulate("hierarchical", xs, np.add, inplace,
                                             layout=layout)):
                assert np.array_equal(got, expected), (p, layout, count, inplace, r)


@pytest.fixture
def split_from(monkeypatch):
    """Make the large-message forms (reduce-scatter/allgather inside nodes: the point-to-point
    one and the one over the nodes' segments, schedules.hierarchical_shm) start from `split`
    elements, and the leaders' ring from `ring_from`."""
    def clear():
        build.cache_clear()
        schedules.hierarchical_shm.cache_clear()

    def set_(split, ring_from):
        monkeypatch.setattr(schedules, "HIER_SPLIT_FROM", split)
        monkeypatch.setattr(schedules, "HIER_SHM_SPLIT_FROM", split)
        monkeypatch.setattr(schedules, "HIER_RING_FROM", ring_from)
        clear()
    yield set_
    clear()


@pytest.mark.parametrize("p", range(2, 11))
@pytest.mark.parametrize("ring_from", [0, 10 ** 9])     # leaders' pieces by ring / by doubling
def test_hierarchical_split_every_layout(split_from, p, ring_from):
    split_from(0, ring_from)
    rng = np.random.default_rng(p + 100)
    for layout in _layouts(p, rng):
        for count in [0, 1, 2, 3, 7, 12, 100]:
            xs = inputs(p, count, seed=p * 100 + count)
            expected = np.sum(xs, axis=0)
            for inplace in (False, True):
                for r, got in enumerate(simulate("hierarchical", xs, np.add, inplace,
                                                 layout=layout)):
                    assert np.array_equal(got, expected), (p, layout, count, inplace, r)


def test_hierarchical_split_spreads_the_network_traffic():
    """From HIER_SPLIT_FROM, every rank of a 2 x 2 layout carries half the node's share across
    nodes; below, only the leaders do."""
    from aluminum_py.bench.cluster import expected_nic_bytes
    n = schedules.HIER_SPLIT_FROM
    layout = (0, 0, 1, 1)
    crossing = [sum(s.send_cnt for s in build("hierarchical", 4, r, n, False, layout)[0]
                    if s.send_peer >= 0 and layout[s.send_peer] != layout[r]) for r in range(4)]
    assert crossing == [n // 2] * 4
    small = [sum(s.send_cnt for s in build("hierarchical", 4, r, n - 1, False, layout)[0]
                 if s.send_peer >= 0 and layout[s.send_peer] != layout[r]) for r in range(4)]
    assert small[1] == small[3] == 0 and small[0] > 0
    assert expected_nic_bytes("hierarchical", layout, n, 4) == [(n * 4, n * 4)] * 2


@settings(max_examples=60, deadline=None)
@given(layout=st.lists(st.integers(0, 4), min_size=1, max_size=12),
       count=st.integers(0, 40), inplace=st.booleans())
def test_hierarchical_max_hypothesis(layout, count, inplace):
    xs = inputs(len(layout), count, seed=count)
    expected = np.max(xs, axis=0) if count else np.zeros(0, np.int64)
    for got in simulate("hierarchical", xs, np.maximum, inplace, layout=layout):
        assert np.array_equal(got, expected)


def test_hierarchical_traffic_by_layout():
    """Only leaders cross nodes; members talk only inside their node; no owned markers."""
    layout = (0, 0, 1, 1, 1)
    leaders = {0, 2}
    for r in range(5):
        steps, _ = build("hierarchical", 5, r, 64, False, layout)
        assert not any(s.owned for s in steps)
        for s in steps:
            for peer in (s.send_peer, s.recv_peer):
                if peer >= 0 and layout[peer] != layout[r]:
                    assert r in leaders and peer in leaders
    # one node: a reduce then a broadcast, no more than 2 log2(p) steps per rank
    for p in range(2, 9):
        for r in range(p):
            assert len(build("hierarchical", p, r, 10, True, None)[0]) <= 2 * (p - 1).bit_length()
    # leaders' inner algorithm: recursive doubling below HIER_RING_FROM, ring from it
    big = build("hierarchical", 3, 0, schedules.HIER_RING_FROM, True, (0, 1, 2))[0]
    assert sum(s.send_peer >= 0 for s in big) == 2 * (3 - 1)


def test_canonical_layout_numbering():
    assert canonical_layout(["b", "a", "b"]) == (0, 1, 0)
    assert canonical_layout([7, 7, 3]) == (0, 0, 1)
    with pytest.raises(ValueError, match="layout"):
        build("hierarchical", 3, 0, 4, False, (0, 1))


# The scratch of a schedule op, placed against MPICH's slow copy to a destination 1-63 bytes
# ahead of its source modulo a page (ext/core/schedule.pxi, sched_scratch; issue 31).
PAGE = 1 << 20          # fake, page-aligned addresses (sched_scratch never dereferences them)


def scratch_of(alg, p, rank, count, send_off, recv_off, esize=4):
    """(INTO_REDUCE steps land in the scratch, its page offset or None, its bytes) for an op of
    `alg` on a sendbuf at `send_off` into a page and a recvbuf at `recv_off` (None: in place)."""
    from mpi4py import MPI  # noqa: F401  (libmpi before _core)
    from aluminum_py import _core
    steps, tmp = build(alg, p, rank, count, recv_off is None)
    sp = PAGE + send_off
    rp = sp if recv_off is None else 3 * PAGE + recv_off
    return _core._sched_scratch(_core.Schedule(steps, tmp), sp, rp, esize)


@pytest.mark.parametrize("ahead", [4, 16, 28, 32, 63])
def test_a_recvbuf_just_ahead_of_the_sendbuf_takes_the_messages_into_scratch(ahead):
    """ring at 2 ranks receives straight into recvbuf from the peer's sendbuf; with recvbuf
    1-63 bytes ahead of sendbuf (modulo a page) it receives into scratch at sendbuf's page
    offset, as large as the largest such block (1 MiB of float32: 512 KiB)."""
    land, off, nbytes = scratch_of("ring", 2, 0, 1 << 18, 16, 16 + ahead)
    assert (land, off) == (True, 16)
    assert nbytes >= 1 << 19


@pytest.mark.parametrize("recv_off", [16, 16 + 64, 16 + 2048, 0, 8])
def test_other_placements_receive_into_recvbuf(recv_off):
    """At sendbuf's offset, 64 bytes or more ahead, or behind it: no scratch for ring at 2
    ranks (it has no scratch step)."""
    assert scratch_of("ring", 2, 0, 1 << 18, 16, recv_off) == (False, None, 0)


def test_small_blocks_are_not_moved():
    """Below 16 KiB a block goes through MPICH's cells, not its single copy: unchanged."""
    land, off, nbytes = scratch_of("ring", 2, 0, 1000, 16, 32)
    assert (land, off, nbytes) == (False, None, 0)


@pytest.mark.parametrize("alg", ["rabenseifner", "recursive_doubling", "ring"])
@pytest.mark.parametrize("p", [3, 4])
def test_the_scratch_starts_where_no_sender_is_just_behind_it(alg, p):
    """The scratch receives from peers' sendbufs and recvbufs: it starts at sendbuf's page
    offset, or at recvbuf's where sendbuf is just ahead of recvbuf, or in place."""
    count = 1 << 18
    for send_off, recv_off, expect in [(16, 16, 16), (16, 2000, 16), (48, 16, 16),
                                       (16, 40, 16), (48, None, 48)]:
        land, off, nbytes = scratch_of(alg, p, 1, count, send_off, recv_off)
        has_into = any(s.recv_mode == RECV_INTO_REDUCE and s.recv_cnt * 4 >= 16384
                       for s in build(alg, p, 1, count, recv_off is None)[0])
        assert land == (recv_off == 40 and has_into), (send_off, recv_off)
        if nbytes:
            assert off == expect, (send_off, recv_off)
