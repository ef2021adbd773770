"""DeFT: knapsacks vs brute force, the four-case delayed-update state machine on hand-made
instances (outcomes derived from the paper's section III-B text and Fig. 4), the Preserver
formula, and the discrete-event simulator against hand-computed timelines."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from aluminum_py.planning import deft
from aluminum_py.planning.deft import (TABLE_II, DelayedUpdateScheduler, Transfer,
                                       knapsack, multi_link_greedy, recursive_knapsack, simulate)


# ------------------------------------------------------------------------------------ fixture
def test_table_ii_as_printed_and_its_total():
    assert [b.forward for b in TABLE_II] == [1238, 28799, 4801, 1899, 326, 103]
    assert [b.backward for b in TABLE_II] == [72496, 12786, 4872, 2319, 484, 162]
    assert [b.comm for b in TABLE_II] == [1968, 11262, 15447, 178643, 31754, 8651]
    assert sum(b.forward for b in TABLE_II) == 37166 == deft.TABLE_II_PRINTED_TOTAL[0]
    assert sum(b.backward for b in TABLE_II) == 93119 == deft.TABLE_II_PRINTED_TOTAL[1]
    # the communication column sums to 247725; the paper prints 257725 (misprint)
    assert sum(b.comm for b in TABLE_II) == 247725
    assert deft.TABLE_II_PRINTED_TOTAL[2] == 257725


# ---------------------------------------------------------------------------------- knapsacks
def brute(weights, values, ok):
    best = 0.0
    for r in range(len(weights) + 1):
        for s in itertools.combinations(range(len(weights)), r):
            if ok(s):
                best = max(best, sum(values[i] for i in s))
    return best


items = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 30)), min_size=0, max_size=8)


@settings(max_examples=200, deadline=None)
@given(items, st.integers(0, 60), st.sampled_from([None, 1.0]))
def test_knapsack_is_exact(its, cap, res):
    w = [a for a, _ in its]
    v = [b + 0.5 for _, b in its]
    sel = knapsack(w, v, cap, resolution=res)
    assert sum(w[i] for i in sel.indices) <= cap
    assert sel.value == pytest.approx(sum(v[i] for i in sel.indices))
    assert list(sel.indices) == sorted(set(sel.indices))
    assert sel.value == pytest.approx(brute(w, v, lambda s: sum(w[i] for i in s) <= cap))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 10.0), max_size=7), st.floats(0.0, 30.0),
       st.sampled_from([0.25, 0.7, 2.0]))
def test_knapsack_on_a_coarse_grid_fits_and_is_exact_for_the_grid(w, cap, res):
    sel = knapsack(w, w, cap, resolution=res)
    assert sum(w[i] for i in sel.indices) <= cap + 1e-9          # always fits the real capacity
    steps = [math.ceil(x / res - 1e-9) for x in w]
    grid_cap = math.floor(cap / res + 1e-9)
    assert sel.value == pytest.approx(
        brute(w, w, lambda s: sum(steps[i] for i in s) <= grid_cap))


def test_knapsack_beats_largest_first():
    sel = knapsack([6, 5, 5], [6, 5, 5], 10)
    assert sel.indices == (1, 2) and sel.value == 10


def test_knapsack_rejects_bad_input():
    with pytest.raises(ValueError):
        knapsack([1, -1], [1, 1], 3)
    with pytest.raises(ValueError):
        knapsack([1, 2], [1], 3)
    with pytest.raises(ValueError):
        knapsack([1], [1], 3, resolution=0)
    assert knapsack([], [], 5) == ((), 0.0)
    assert knapsack([1], [1], -1) == ((), 0.0)


def link_finish(comm, compute, chosen, free_at=0.0, speed=1.0):
    """End of the last chosen all-reduce, sent in ready order on one link free from `free_at`;
    item p's gradient exists after compute[0..p]."""
    ready = np.cumsum(compute)
    t = free_at
    for p in sorted(chosen):
        t = max(t, ready[p]) + comm[p] / speed
    return t


def nested_ok(comm, compute, cap):
    win = deft.windows_from_compute(compute)
    return lambda s: (sum(comm[i] for i in s) <= cap
                      and all(sum(comm[q] for q in s if q >= p) <= win[p] for p in s))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 15), st.integers(0, 15)), min_size=1, max_size=7),
       st.one_of(st.none(), st.integers(0, 60)))
def test_recursive_knapsack_fits_the_windows_and_is_exact(its, cap):
    comm = [a for a, _ in its]
    compute = [b for _, b in its]
    sel = recursive_knapsack(comm, compute, cap)
    total = sum(compute)
    capacity = sum(compute[1:]) if cap is None else cap
    # feasibility: sent in ready order on a link free from (total - capacity) on, every chosen
    # all-reduce ends before the backward compute does
    assert link_finish(comm, compute, sel.indices, free_at=max(0, total - capacity)) <= total
    assert sum(comm[i] for i in sel.indices) <= capacity
    assert sel.value == pytest.approx(brute(comm, comm, nested_ok(comm, compute, capacity)))


def test_alg1_as_printed_can_overrun_the_backward_pass():
    # backward order: item 0 ready at 1, item 1 at 6, item 2 (bucket #1) at 10; windows 9, 4, 0
    comm, compute = [3, 5, 2], [1, 5, 4]
    naive = knapsack(comm[:-1], comm[:-1], sum(compute[1:]))     # Alg. 1 line 4 (= its result)
    assert naive.indices == (0, 1)
    assert link_finish(comm, compute, naive.indices) == 11 > sum(compute)   # 1-4, 6-11
    sel = recursive_knapsack(comm, compute)
    assert sel.indices == (0,) and link_finish(comm, compute, sel.indices) <= sum(compute)


def test_multi_link_greedy_follows_the_paper():
    # two links: fast (capacity 10) and gloo-like (speed 1/2: capacity 5 in weight units);
    # smallest knapsack first, longest items first: 5 -> slow link; then 6, 4 -> fast link.
    g = multi_link_greedy([6, 5, 4, 3], [10, 10], speeds=[1.0, 0.5])
    assert g.links == ((0, 2), (1,)) and g.value == 15


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=7),
       st.integers(0, 40), st.integers(0, 40), st.booleans())
def test_multi_link_greedy_fits(its, c0, c1, dependent):
    comm = [a for a, _ in its]
    compute = [b for _, b in its]
    win = deft.windows_from_compute(compute) if dependent else None
    g = multi_link_greedy(comm, [c0, c1], speeds=[1.0, 1 / 1.65], windows=win)
    assert not set(g.links[0]) & set(g.links[1])
    for l, (cap, sp) in enumerate([(c0, 1.0), (c1, 1 / 1.65)]):
        assert sum(comm[i] / sp for i in g.links[l]) <= cap + 1e-9
        if dependent:
            total = sum(compute)
            assert link_finish(comm, compute, g.links[l], total - cap, sp) <= total + 1e-9


def test_partition():
    pieces = deft.partition(TABLE_II, 37166)
    assert len(pieces) == 10
    assert sum(p.comm for p in pieces) == 247725
    assert all(p.comm <= 37166 and float(p.comm).is_integer() for p in pieces)
    four = [p for p in pieces if p.name.startswith("#4")]
    assert [p.comm for p in four] == [35729, 35729, 35729, 35728, 35728]
    assert [(p.forward, p.backward) for p in four] == [(0, 0)] * 4 + [(1899, 2319)]


# ------------------------------------------------------------------------ the state machine
def test_case4_initial_then_delayed_bucket_applied_one_iteration_later():
    # windows W = (0, 10, 20): bucket 0 can never go in the backward pass (hard dependency)
    s = DelayedUpdateScheduler([5, 8, 4], [5, 5, 5], [10, 10, 10])
    p0 = s.plan(0)
    # Case 4 (both queues empty): Alg. 1 over the new buckets picks 2 (4 <= 20) and 1
    # (suffix 8 <= 10); bucket 0 goes to the current queue; nothing to apply yet
    assert p0.cases == (4,) and p0.now == (2, 1) and p0.held == (0,)
    assert p0.backward == (Transfer(2, (0,)), Transfer(1, (0,)))
    assert p0.delayed == (0,) and p0.next_forward == (Transfer(0, (0,)),)
    assert not p0.update and p0.applied_iteration == (None, None, None)
    for t in range(1, 8):
        p = s.plan(t)
        # Case 1 sends the delayed bucket in the forward pass, the current queue is then
        # empty, so Case 4 again; the update applies iteration t-1, one iteration late
        assert p.cases == (1, 4)
        assert p.forward == (Transfer(0, (t - 1,)),)
        assert p.update and p.applied_iteration == (t - 1,) * 3
        assert p.applied_iterations == ((t - 1,),) * 3
    assert s.batch_multipliers(8) == [1] * 7


def test_case1_exact_knapsack_and_case3():
    # windows (0, 1, 2, 3); only bucket 3 (comm 3) fits its window; F = 10, B = 23
    s = DelayedUpdateScheduler([6, 5, 5, 3], [4, 3, 2, 1], [1, 1, 1, 20])
    p0 = s.plan(0)
    assert p0.cases == (4,) and p0.now == (3,) and p0.held == (2, 1, 0)
    # Case 1: the knapsack over {6, 5, 5} with capacity 10 takes 5 + 5 (largest-first: 6)
    assert p0.delayed == (1, 2)
    p1 = s.plan(1)
    assert p1.forward == (Transfer(1, (0,)), Transfer(2, (0,)))
    # Case 3: the rest (bucket 0: 6 <= 23) goes first, then Alg. 1 over the new buckets with
    # capacity 23 - 6 = 17: bucket 3 only; update with iteration 0 at the end
    assert p1.cases == (1, 3)
    assert p1.backward == (Transfer(0, (0,)), Transfer(3, (1,)))
    assert p1.now == (3,) and p1.now_iterations == (1,)
    assert p1.update and p1.applied_iteration == (0, 0, 0, 0)


def test_case2_then_case4_merges_the_future_queue():
    # windows (0, 1, 2, 3), F = 4, B = 4
    s = DelayedUpdateScheduler([2, 3, 4, 1], [1, 1, 1, 1], [1, 1, 1, 1])
    p0, p1, p2, p3, p4 = s.run(5)
    assert p0.cases == (4,) and p0.now == (3,) and p0.delayed == (2,)
    # iteration 1: Case 1 sends 4; {2, 3} (5) exceeds B = 4, so Case 2: the knapsack over the
    # old buckets takes 3; the whole new gradient goes to the future queue; no update
    assert p1.cases == (1, 2) and p1.forward == (Transfer(2, (0,)),)
    assert p1.backward == (Transfer(1, (0,)),)
    assert p1.now == () and p1.held == (3, 2, 1, 0) and not p1.update
    assert p1.delayed == (0,)
    # iteration 2: Case 1 empties the current queue; Case 4 merges iteration 1 (future queue)
    # with iteration 2; the update at the end applies iteration 0 (Fig. 4, iteration 5)
    assert p2.cases == (1, 4) and p2.forward == (Transfer(0, (0,)),)
    assert p2.backward == (Transfer(3, (1, 2)),) and p2.now_iterations == (1, 2)
    assert p2.update and p2.applied_iteration == (0,) * 4
    assert p3.cases == (1, 2) and not p3.update
    # iterations 1 and 2 are applied together (Fig. 4: "updated together")
    assert p4.cases == (1, 4) and p4.applied_iterations == ((1, 2),) * 4
    assert p4.applied_iteration == (2,) * 4
    assert s.batch_multipliers(5) == [1, 2]


def test_case3_merges_the_future_queue_and_old_transfers_use_the_capacity_first():
    # windows (0, 1, 2, 3), F = 2, B = 4
    s = DelayedUpdateScheduler([2, 3, 4, 1], [1, 1, 0, 0], [1, 1, 1, 1])
    p0, p1, p2 = s.run(3)
    assert p0.now == (3,)
    assert p1.cases == (1, 2) and p1.forward == (Transfer(0, (0,)),)
    assert p1.backward == (Transfer(2, (0,)),)          # knapsack {3, 4}, capacity 4
    # iteration 2: Case 1 cannot send 3 in F = 2; Case 3: 3 <= 4 goes first; new group =
    # future {1} + {2}; capacity left 1: bucket 3 (comm 1) fits
    assert p2.cases == (1, 3) and p2.forward == ()
    assert p2.backward == (Transfer(1, (0,)), Transfer(3, (1, 2)))
    assert p2.applied_iterations == ((0,),) * 4
    s2 = DelayedUpdateScheduler([2, 3, 4, 2], [1, 1, 0, 0], [1, 1, 1, 1])
    q2 = s2.plan(2)
    # same, but bucket 3 takes 2 > 1 left after the old transfer: nothing new this time
    assert q2.case == 3 and q2.backward == (Transfer(1, (0,)),) and q2.now == ()


def test_unsendable_bucket_is_an_error():
    with pytest.raises(ValueError, match="partition"):
        DelayedUpdateScheduler([b.comm for b in TABLE_II], [b.forward for b in TABLE_II],
                               [b.backward for b in TABLE_II])


def check_invariants(s, T):
    plans = s.run(T + 1)
    sent: dict = {}
    applied_iters = []
    for p in plans[:T]:
        t = p.iteration
        # the forward transfers are the ones announced as delayed one iteration earlier
        if t:
            assert plans[t - 1].delayed == tuple(x.bucket for x in p.forward)
            assert plans[t - 1].next_forward == p.forward
        for x in p.forward + p.backward:
            assert (x.bucket, x.iterations) not in sent, "a bucket of a group sent twice"
            sent[(x.bucket, x.iterations)] = t
        assert sorted(p.now + p.held) == list(range(s.n))
        for l in range(s.links):
            sp = s.speeds[l]
            assert sum(s.comm[x.bucket] / sp for x in p.forward if x.link == l) <= s.F + 1e-9
            # backward pass on link l: old transfers first, new ones when ready
            ready = {i: sum(s.backward_times[i:]) for i in range(s.n)}
            clock = 0.0
            for x in p.backward:
                if x.link == l:
                    r = ready[x.bucket] if t in x.iterations else 0.0
                    clock = max(clock, r) + s.comm[x.bucket] / sp
            assert clock <= s.B + 1e-9
        if p.update:
            group = p.applied_iterations[0]
            assert all(a == group for a in p.applied_iterations)
            applied_iters.extend(group)
            assert max(group) < t or s.comm[0] == 0
    # every iteration applied once, in order, in consecutive groups
    assert applied_iters == list(range(len(applied_iters)))
    for t_upd, g in s.applied_groups(T):
        for i in range(s.n):
            assert sent[(i, g)] <= t_upd
    # a delayed bucket whose group the next forward pass completes is applied right after it
    for t in range(T - 1):
        p, q = plans[t], plans[t + 1]
        if q.cases == (1, 4) and q.forward:
            g = q.forward[0].iterations
            assert g in [gg for tt, gg in s.applied_groups(T) if tt == t + 1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(1, 12)),
                min_size=1, max_size=6), st.sampled_from([1, 2]))
def test_state_machine_invariants(its, links):
    f = [a for a, _, _ in its]
    b = [x for _, x, _ in its]
    c = [x for _, _, x in its]
    if max(c) > max(sum(f), sum(b)):
        with pytest.raises(ValueError):
            DelayedUpdateScheduler(c, f, b, links=links)
        return
    check_invariants(DelayedUpdateScheduler(c, f, b, links=links), 25)


@pytest.mark.parametrize("links", [1, 2])
def test_state_machine_invariants_on_table_ii(links):
    bk = deft.partition(TABLE_II, deft._auto_piece(TABLE_II, links, deft.MU_GLOO))
    s = DelayedUpdateScheduler([x.comm for x in bk], [x.forward for x in bk],
                               [x.backward for x in bk], links=links)
    check_invariants(s, 40)


# ---------------------------------------------------------------------------------- Preserver
def test_expected_next_loss_matches_the_reflected_walk():
    rng = np.random.default_rng(1)
    s, m, sd, lr, B, S = 0.21, 3.0, 40.0, 0.01, 256, 0.05
    ds = rng.normal(m, sd / math.sqrt(B), 2_000_000)
    nxt = np.where(s - lr * ds >= S, s - lr * ds, 2 * S + lr * ds - s)
    e = deft.expected_next_loss(s, m, sd, lr, B, S)
    assert e == pytest.approx(nxt.mean(), rel=2e-3)
    assert deft.expected_next_loss(1.0, 2.0, 0.0, 0.1, 8) == pytest.approx(0.8)


def test_preserver_ok():
    args = dict(s0=0.2103, grad_mean=1.0, grad_std=30.0, lr=0.01, batch_size=256)
    assert deft.preserver_ratio([1, 1, 1, 1], **args) == pytest.approx(1.0)
    assert deft.preserver_ok([1, 1, 1, 1], **args)
    # merging iterations means fewer steps: the expected loss is higher, the ratio below 1
    r2 = deft.preserver_ratio([2, 1, 1], **args)
    r4 = deft.preserver_ratio([4], **args)
    assert r4 < r2 < 1
    assert deft.preserver_ok([2, 1, 1], **args, eps=1 - r2 + 1e-9)
    assert not deft.preserver_ok([4], **args, eps=0.01)
    with pytest.raises(ValueError):
        deft.preserver_ratio([1, 2], s0=1, grad_mean=[1, 2], grad_std=1, lr=0.1, batch_size=1)


def test_tune_capacity_grows_the_capacity_until_the_check_passes():
    bk = deft.partition(TABLE_II, 37166)
    c, f, b = ([x.comm for x in bk], [x.forward for x in bk], [x.backward for x in bk])
    # descent regime (the loss stays far above S*): fewer updates -> higher loss, ratio < 1
    args = dict(s0=0.2103, grad_mean=1.0, grad_std=30.0, lr=0.001, batch_size=256)
    base = DelayedUpdateScheduler(c, f, b)
    # the buckets' communication (247.7 ms) fits in the forward and backward time of two
    # iterations (2 x 130.3 ms) but not of one: after the first, one update per 2 iterations
    per_iteration = sum(f) + sum(b)
    k = math.ceil(sum(c) / per_iteration)
    assert k == 2
    assert base.batch_multipliers(64)[:4] == [1, k, k, k]
    r0 = deft.preserver_ratio(base.batch_multipliers(64), **args)
    assert r0 < 1
    sched, ratio, ok = deft.tune_capacity(c, f, b, **args, eps=(1 - r0) / 2)
    assert ok and sched.capacity_scale > 1 and r0 < ratio <= 1
    assert len(sched.batch_multipliers(64)) > len(base.batch_multipliers(64))


# ---------------------------------------------------------------------------------- simulator
def test_wfbp_trivial_instance_by_hand():
    # forward 0-3; B1 3-7, C1 7-8; B0 7-10, C0 10-15; the next iteration starts at 15
    r = simulate([(1, 3, 5), (2, 4, 1)], "wfbp", iterations=4, warmup=1)
    assert r.iteration_times == [15, 15, 15, 15] and r.iteration_time == 15
    assert [(s.label, s.start, s.end) for s in r.timelines["link0"][:2]] == \
        [("C1", 7, 8), ("C0", 10, 15)]
    assert [(s.label, s.start, s.end) for s in r.timelines["compute"][:4]] == \
        [("F0", 0, 1), ("F1", 1, 3), ("B1", 3, 7), ("B0", 7, 10)]
    assert r.updates_per_iteration == 1


def test_priority_trivial_instance_by_hand():
    # backward: B2 7-8, C2 8-14 (link busy while B1, B0 end at 9, 11); then priority sends C0
    # 14-15 before C1 15-19; F0 waits for C0 only (15), F1 for C1 (19): iterations 15, 18, 18
    buckets = [(1, 2, 1), (1, 1, 4), (5, 1, 6)]
    r = simulate(buckets, "priority", iterations=4, warmup=1, partition_time=None)
    assert r.iteration_times == [15, 18, 18, 18]
    assert [(s.label, s.start, s.end) for s in r.timelines["link0"][:3]] == \
        [("C2", 8, 14), ("C0", 14, 15), ("C1", 15, 19)]
    w = simulate(buckets, "wfbp", iterations=4, warmup=1)
    assert w.iteration_times == [19] * 4


def test_deft_trivial_instance_by_hand():
    # DeFT hides every all-reduce: iteration = F + B = 45; WFBP: 15 + 30 + C0's 5 = 50
    buckets = [(5, 10, 5), (5, 10, 8), (5, 10, 4)]
    d = simulate(buckets, "deft", iterations=6, warmup=1)
    assert d.iteration_times == [45] * 6
    assert simulate(buckets, "wfbp", iterations=6, warmup=1).iteration_time == 50
    assert d.updates == [(t, (t - 1,)) for t in range(1, 6)]
    assert [(s.label, s.start, s.end) for s in d.timelines["link0"][:3]] == \
        [("C2", 25, 29), ("C1", 35, 43), ("C0", 45, 50)]


def test_two_links_wfbp_uses_the_slow_link_when_it_finishes_first():
    # C1 (8) ready at 1 takes the fast link 1-9; C0 ready at 2: the fast link would end at 10,
    # the slow one (x2) at 2 + 2 = 4: it takes the slow link
    r = simulate([(0, 1, 1), (0, 1, 8)], "wfbp", links=2, mu=2.0, iterations=3, warmup=0)
    assert [(s.label, s.start, s.end) for s in r.timelines["link1"][:1]] == [("C0", 2, 4)]
    assert r.iteration_time == 9


def test_streams_never_overlap():
    for policy in ("wfbp", "priority", "deft"):
        for links in (1, 2):
            r = simulate(TABLE_II, policy, links, iterations=12, warmup=2)
            for spans in r.timelines.values():
                for a, b in zip(spans, spans[1:]):
                    assert a.end <= b.start + 1e-6


def test_table_ii_wfbp_by_hand():
    # ready after the backward starts: #6 162, #5 646, #4 2965, #3 7837, #2 20623, #1 93119;
    # FIFO: 162 + 8651 + 31754 + 178643 + 15447 + 11262 = 245919, #1 then ends at 247887
    r = simulate(TABLE_II, "wfbp", iterations=5, warmup=1)
    assert r.iteration_time == 37166 + 247887 == 285053


@pytest.mark.parametrize("links", [1, 2])
def test_deft_never_slower_than_wfbp_on_table_ii(links):
    w = simulate(TABLE_II, "wfbp", links, iterations=30, warmup=4)
    p = simulate(TABLE_II, "priority", links, iterations=30, warmup=4)
    d = simulate(TABLE_II, "deft", links, iterations=30, warmup=4)
    assert d.iteration_time <= w.iteration_time
    assert d.iteration_time <= p.iteration_time <= w.iteration_time
    # every all-reduce is hidden: the iteration is the compute time
    assert d.iteration_times[4:] == [37166 + 93119] * 26
    assert 0 < d.updates_per_iteration < 1


def test_bad_simulation_arguments():
    with pytest.raises(ValueError, match="policy"):
        simulate(TABLE_II, "fifo")
    with pytest.raises(ValueError, match="links"):
        simulate(TABLE_II, "wfbp", links=3)
    with pytest.raises(ValueError, match="partition"):
        simulate(TABLE_II, "deft", partition_time=None)


def test_forget_keeps_memory_bounded_and_plans_unchanged():
    comm, fwd, bwd = [3.0, 5.0, 2.0], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]
    full = DelayedUpdateScheduler(comm, fwd, bwd).run(30)
    s = DelayedUpdateScheduler(comm, fwd, bwd)
    for t in range(30):
        assert s.plan(t) == full[t]
        s.forget(t)
        assert len(s._plans) <= 1
    with pytest.raises(ValueError, match="dropped"):
        s.plan(3)
    assert all(t >= 29 for t, _ in s.applied_groups(30))
