"""GradientSynchronizer: fused, overlapped allreduces equal plain per-gradient allreduce."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py.overlap import GradientSynchronizer
from aluminum_py.planning import libra
from aluminum_py.planning.contention import ContentionModel
from conftest import WORLD, gather_all

pytestmark = pytest.mark.mpi

SHAPES = [(3, 4), (100,), (7,), (64, 16), (1,), (1000,), (5, 5, 5), (2,)]


def make_grads(rank, step, dtypes=None):
    rng = np.random.default_rng([rank, step])
    dts = dtypes or [np.float64] * len(SHAPES)
    return [rng.integers(-8, 9, size=s).astype(dt) for s, dt in zip(SHAPES, dts)]


def run_step(sync, grads, fresh, order=None):
    """One emulated backward: load this step's gradients, report them ready, wait."""
    for g, v in zip(grads, fresh):
        g[...] = v
    for i in (order if order is not None else reversed(range(len(grads)))):
        sync.grad_ready(i)
    return sync.wait(timeout=60)


def profile():
    return [1e-4 * (i + 1) for i in range(len(SHAPES))]


POLICY_OPTIONS = {
    "none": {},
    "fixed": {"threshold": 1024},
    "mgwfbp": {"compute_times": profile()},
    "adafusion": {"compute_times": profile(), "cost": lambda n: 2e-4 + n * 1e-9},
    "osf": {"compute_times": profile(), "cost": lambda n: 2e-4 + n * 1e-9},
    "libra": {"plan": libra.Plan([(0, 2), (3, 3), (4, 7)], [512, 512, 512], 0.0)},
}


@pytest.mark.parametrize("policy", list(POLICY_OPTIONS))
@pytest.mark.parametrize("average", [True, False])
def test_policies_equal_plain_allreduce(comm, policy, average):
    grads = [np.zeros(s) for s in SHAPES]
    sync = GradientSynchronizer(comm, grads, policy=policy, average=average, **POLICY_OPTIONS[policy])
    buffers = [b for b in sync._buffers if b is not None]
    for step in range(3):
        fresh = make_grads(comm.rank, step)
        info = run_step(sync, grads, fresh)
        assert info.iteration == step and info.applied == [step] * len(sync.buckets)
        for g, v in zip(grads, fresh):
            stack = gather_all(v)
            exp = stack.sum(axis=0) / (comm.size if average else 1)
            assert np.array_equal(g, exp)
    # persistent buffers: the same objects every step
    assert [b for b in sync._buffers if b is not None] == buffers or not buffers
    assert all(b is c for b, c in zip([b for b in sync._buffers if b is not None], buffers))


def test_sync_info_timings(comm):
    """SyncInfo.timings: per bucket (launched, started, completed), ordered, inside the step."""
    import time
    grads = [np.zeros(s) for s in SHAPES]
    sync = GradientSynchronizer(comm, grads, policy="fixed", threshold=1024)
    fresh = make_grads(comm.rank, 0)
    t0 = time.monotonic()
    info = run_step(sync, grads, fresh)
    t1 = time.monotonic()
    assert len(info.timings) == len(info.buckets) > 1
    for launched, started, completed in info.timings:
        assert t0 <= launched <= started <= completed <= t1
    launches = [t[0] for t in info.timings]
    assert launches == sorted(launches)
    for g, v in zip(grads, fresh):
        assert np.array_equal(g, gather_all(v).sum(axis=0) / comm.size)


def test_fixed_threshold_buckets_and_mixed_dtypes(comm):
    dts = [np.float32, np.float32, np.float64, np.float64, np.float32, np.float32, np.float32, np.float64]
    grads = [np.zeros(s, dtype=dt) for s, dt in zip(SHAPES, dts)]
    sync = GradientSynchronizer(comm, grads, policy="fixed", threshold=1 << 30)
    for b in sync.buckets:
        assert len({grads[i].dtype for i in b}) == 1       # split where the dtype changes
    fresh = make_grads(comm.rank, 0, dts)
    run_step(sync, grads, fresh)
    for g, v in zip(grads, fresh):
        assert np.array_equal(g, (gather_all(v).sum(axis=0) / comm.size).astype(g.dtype))


def test_ready_order_may_differ_between_ranks(comm):
    """Buckets launch in bucket order, so a different grad_ready order on some rank is safe."""
    grads = [np.zeros(s) for s in SHAPES]
    sync = GradientSynchronizer(comm, grads, policy="fixed", threshold=2000)
    fresh = make_grads(comm.rank, 9)
    order = list(range(len(grads)))
    np.random.default_rng(comm.rank).shuffle(order)
    run_step(sync, grads, fresh, order)
    for g, v in zip(grads, fresh):
        assert np.array_equal(g, gather_all(v).sum(axis=0) / comm.size)


def test_errors(comm):
    grads = [np.zeros(4), np.zeros(3)]
    with pytest.raises(ValueError, match="policy"):
        GradientSynchronizer(comm, grads, policy="bogus")
    with pytest.raises(ValueError, match="profile_steps"):
        GradientSynchronizer(comm, grads, policy="mgwfbp", profile_steps=(1, 0))
    with pytest.raises(ValueError, match="average"):
        GradientSynchronizer(comm, [np.zeros(3, dtype=np.int32)], policy="none")
    with pytest.raises(ValueError, match="contiguous"):
        GradientSynchronizer(comm, [np.zeros((4, 4))[:, 0]], policy="none")
    with pytest.raises(ValueError, match="cycle_time"):
        GradientSynchronizer(comm, grads, policy="fixed", cycle_time=0.01)
    sync = GradientSynchronizer(comm, grads, policy="none")
    sync.grad_ready(1)
    with pytest.raises(al.Error, match="twice"):
        sync.grad_ready(1)
    with pytest.raises(al.Error, match="never reported"):
        sync.wait()
    sync.grad_ready(0)
    sync.wait(timeout=60)


@pytest.mark.parametrize("policy", ["fixed", "libra"])
def test_gradient_arena_buckets_are_reduced_in_place(comm, policy):
    from aluminum_py.overlap import gradient_arena
    arena, grads = gradient_arena(SHAPES, np.float64)
    sync = GradientSynchronizer(comm, grads, policy=policy, **POLICY_OPTIONS[policy])
    assert all(b is None for b in sync._buffers)                 # no fusion buffers
    assert any(v is not None for v in sync._views)
    for step in range(2):
        fresh = make_grads(comm.rank, step)
        run_step(sync, grads, fresh)
        for g, v in zip(grads, fresh):
            assert np.array_equal(g, gather_all(v).sum(axis=0) / comm.size)


def test_ranks_with_different_buckets_are_refused(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    grads = [np.zeros(4) for _ in range(4)]
    groups = [(0, 3)] if comm.rank == 0 else [(0, 1), (2, 3)]
    with pytest.raises(al.Error, match="different gradient buckets"):
        GradientSynchronizer(comm, grads, policy="fixed", groups=groups)


# ---------------------------------------------------------------- policy "deft" (delayed updates)
DEFT_PROFILE = {"compute_times": profile(), "forward_times": [t / 2 for t in profile()],
                "threshold": 1024}
# all-reduce seconds of n bytes: "light" lets DeFT apply every gradient one iteration late
# (Cases 3/4); "heavy" makes it hold several iterations and merge them (Case 2).
DEFT_COSTS = {"light": lambda n: 2e-4 + n * 2e-7, "heavy": lambda n: 5e-4 + n * 4e-7}


def expected_sum(history, iters, j, size, average):
    """Sum over ranks and the applied iterations of gradient j (gathered from every rank)."""
    if not iters:
        return np.zeros(SHAPES[j])
    total = sum(history[t][j].sum(axis=0) for t in iters)
    return total / (size * len(iters)) if average else total


@pytest.mark.parametrize("load", list(DEFT_COSTS))
@pytest.mark.parametrize("average,layout", [(True, "separate"), (False, "separate"),
                                            (True, "arena")])
def test_deft_applies_the_iterations_it_reports(comm, load, average, layout):
    """(With the arena every bucket is one memory range, so the pieces sent in their own
    backward pass are reduced out of place from the gradients.)"""
    from aluminum_py.overlap import gradient_arena
    from aluminum_py.planning.deft import DelayedUpdateScheduler
    grads = gradient_arena(SHAPES, np.float64)[1] if layout == "arena" else \
        [np.zeros(s) for s in SHAPES]
    sync = GradientSynchronizer(comm, grads, policy="deft", average=average,
                                cost=DEFT_COSTS[load], **DEFT_PROFILE)
    history, updates, steps = [], [], 10
    for step in range(steps):
        fresh = make_grads(comm.rank, step)
        history.append([gather_all(v) for v in fresh])
        if step % 2:
            sync.begin_backward()                  # optional; else at the first grad_ready
        info = run_step(sync, grads, fresh)
        assert info.iteration == step
        iters = info.applied_iterations[0]
        assert info.update == bool(iters)
        assert all(a == iters for a in info.applied_iterations)
        assert info.applied == [iters[-1] if iters else None] * len(sync.buckets)
        for j, g in enumerate(grads):
            assert np.array_equal(g, expected_sum(history, iters, j, comm.size, average))
        if iters:
            updates.append((step, iters))
        assert set(sync.held_iterations) == set(range(step + 1)) - {
            t for _, it in updates for t in it}
    # the synchronizer applied what the scheduler planned (same inputs on a fresh scheduler)
    d = sync._deft
    sched = DelayedUpdateScheduler(*d._sched_args[:3], capacity_scale=d._sched_args[3])
    assert updates == sched.applied_groups(steps)
    merged = any(len(it) > 1 for _, it in updates)
    assert merged == (load == "heavy")              # Case 2 merges iterations
    assert all(it[-1] < t for t, it in updates)     # delayed: applied after its iteration
    assert len(d.scheduler._plans) <= 1                # plans of past steps are dropped
    held = sync.held_iterations
    info = sync.flush(timeout=60)
    assert info.applied_iterations[0] == held and info.update == bool(held)
    for j, g in enumerate(grads):
        assert np.array_equal(g, expected_sum(history, held, j, comm.size, average))
    applied = sorted(t for _, it in updates for t in it) + list(held)
    assert applied == list(range(steps))           # every iteration applied exactly once
    # after flush the schedule starts over
    fresh = make_grads(comm.rank, steps)
    history.append([gather_all(v) for v in fresh])
    info = run_step(sync, grads, fresh)
    assert info.iteration == steps and sync.held_iterations in ((steps,), ())


def test_deft_errors_and_flush_of_other_policies(comm):
    grads = [np.zeros(s) for s in SHAPES]
    with pytest.raises(ValueError, match="exceeds"):
        GradientSynchronizer(comm, grads, policy="deft", cost=lambda n: 1.0, **DEFT_PROFILE)
    sync = GradientSynchronizer(comm, grads, policy="none")
    info = sync.flush()
    assert not info.update and info.applied_iterations[0] == () and sync.held_iterations == ()
    sync = GradientSynchronizer(comm, grads, policy="deft", cost=DEFT_COSTS["light"], **DEFT_PROFILE)
    sync.grad_ready(len(grads) - 1)
    with pytest.raises(al.Error, match="middle of a step"):
        sync.flush()
    for i in reversed(range(len(grads) - 1)):
        sync.grad_ready(i)
    sync.wait(timeout=60)
    sync.flush(timeout=60)


def test_auto_tries_each_candidate_then_keeps_the_fastest(comm, monkeypatch):
    """Policy "auto": results equal plain allreduce during and after tuning; the candidates run
    round-robin; the one with the shortest measured steps (a fake clock charges "medium" 0.5 s
    a step, the others 1 s or more, differently per rank) is kept on every rank; the others
    are dropped."""
    from aluminum_py.overlap import autotune as _autotune
    grads = [np.zeros(s) for s in SHAPES]
    cands = [("one each", "none", {}), ("medium", "fixed", {"threshold": 1024}),
             ("all", "fixed", {"threshold": 1 << 30})]
    sync = GradientSynchronizer(comm, grads, policy="auto", candidates=cands, tune_steps=(1, 3))
    clock = {"t": 0.0}
    # the step that just ended ran candidate `active`: charge it 1 s, "medium" 0.5 s
    monkeypatch.setattr(_autotune, "_now", lambda: clock["t"])
    seen = []
    for step in range(3 * 4 + 2):
        label = sync._auto.labels[sync._auto.order[sync._auto.step]] \
            if sync._auto.chosen is None else sync.chosen
        seen.append(label)
        clock["t"] += 0.5 if label == "medium" else 1.0 + 0.1 * comm.rank
        fresh = make_grads(comm.rank, step)
        info = run_step(sync, grads, fresh)
        assert info.iteration == step and info.applied == [step] * len(info.buckets)
        for g, v in zip(grads, fresh):
            assert np.array_equal(g, gather_all(v).sum(axis=0) / comm.size)
    assert seen[:12] == ["one each", "medium", "all"] * 4
    assert sync.chosen == "medium" and seen[12:] == ["medium", "medium"]
    assert set(sync.tuning_report) == {"one each", "medium", "all"}
    assert sync.tuning_report["medium"] == 0.5
    assert sync.buckets == sync._auto.syncs[1].buckets
    assert [s is None for s in sync._auto.syncs] == [True, False, True]


def test_auto_default_candidates_and_duplicates(comm):
    """Without a profile: no fusion and the fixed thresholds; thresholds that form the same
    buckets (all of these tiny gradients fit in 1 MiB) are tried once."""
    grads = [np.zeros(s) for s in SHAPES]
    sync = GradientSynchronizer(comm, grads, policy="auto")
    assert sync._auto.labels == ["none", "fixed 1 MiB"]
    from aluminum_py.overlap.autotune import default_candidates
    cost = lambda n: 2e-4 + n * 1e-9    # noqa: E731
    labels = [c[0] for c in default_candidates({"compute_times": profile(), "cost": cost})]
    assert labels == ["none", "fixed 1 MiB", "fixed 4 MiB", "fixed 16 MiB", "fixed 64 MiB",
                      "osf", "adafusion", "mgwfbp"]
    prof = GradientSynchronizer(comm, grads, policy="auto", compute_times=profile(), cost=cost)
    assert set(prof._auto.labels) <= set(labels) and len(prof._auto.labels) >= 2
    with pytest.raises(ValueError, match="policy 'auto' chooses them"):
        GradientSynchronizer(comm, grads, policy="auto", groups=[(0, 7)])
    with pytest.raises(ValueError, match="cannot be a candidate"):
        GradientSynchronizer(comm, grads, policy="auto", candidates=[("d", "deft", {})])
    sync.flush()


# ---------------------------------------------------------------- planned policies without a profile
PLANNED = ["mgwfbp", "adafusion", "osf", "libra", "deft"]
PLANNED_OPTIONS = {"deft": {"cost": DEFT_COSTS["light"], "threshold": 1024},
                   "adafusion": {"cost": lambda n: 2e-4 + n * 1e-9}}


def emulated_step(sync, grads, fresh, clock, rank, begin=True):
    """One step on a fake clock: the forward pass takes 2 ms, gradient i's backward
    ``profile()[i]``, both 10% longer per rank (the slowest rank's profile is planned)."""
    slow = 1.0 + 0.1 * rank
    for g, v in zip(grads, fresh):
        g[...] = v
    clock["t"] += 2e-3 * slow
    if begin:
        sync.begin_backward()
    for i in reversed(range(len(grads))):
        clock["t"] += profile()[i] * slow
        sync.grad_ready(i)
    return sync.wait(timeout=60)


@pytest.mark.parametrize("policy", PLANNED)
def test_planned_policies_measure_their_profile(comm, policy, monkeypatch):
    """Without compute_times: the first steps run as "none" (one bucket per gradient), results
    exact; after profile_steps the policy plans from the measured profile (the maximum over
    ranks, the same on every rank); results stay exact (deft: the reported iterations'
    gradients, every iteration applied once)."""
    from aluminum_py.overlap import profiled
    clock = {"t": 100.0}
    monkeypatch.setattr(profiled, "_now", lambda: clock["t"])
    grads = [np.zeros(s) for s in SHAPES]
    sync = GradientSynchronizer(comm, grads, policy=policy, **PLANNED_OPTIONS.get(policy, {}))
    n, history, applied, steps = len(SHAPES), [], [], 10
    for step in range(steps):
        measuring = step < 4                    # profile_steps (1, 3)
        assert (sync.profile is None) == measuring
        if measuring:
            assert sync.buckets == [[i] for i in reversed(range(n))]
        fresh = make_grads(comm.rank, step)
        history.append([gather_all(v) for v in fresh])
        info = emulated_step(sync, grads, fresh, clock, comm.rank)
        assert info.iteration == step
        iters = info.applied_iterations[0]
        applied += list(iters)
        for j, g in enumerate(grads):
            assert np.array_equal(g, expected_sum(history, iters, j, comm.size, True))
    prof = sync.profile
    slowest = 1.0 + 0.1 * (comm.size - 1)
    assert prof.measured and prof.steps == 3 and prof.error is None
    assert np.allclose(prof.compute_times, [t * slowest for t in profile()], rtol=1e-9)
    assert np.isclose(sum(prof.forward_times), 2e-3 * slowest, rtol=1e-9)
    assert (sync._deft is not None) == (policy == "deft")
    info = sync.flush(timeout=60)
    applied += list(info.applied_iterations[0])
    assert sorted(applied) == list(range(steps))


def test_planned_policy_given_a_profile_does_not_measure(comm):
    grads = [np.zeros(s) for s in SHAPES]
    sync = GradientSynchronizer(comm, grads, policy="mgwfbp", compute_times=profile())
    assert sync.profile.compute_times == tuple(profile()) and not sync.profile.measured
    libra_sync = GradientSynchronizer(comm, grads, policy="libra", compute_times=profile())
    assert libra_sync.profile is not None and len(libra_sync.buckets) >= 1
    for step in range(2):
        fresh = make_grads(comm.rank, step)
        run_step(libra_sync, grads, fresh)
        for g, v in zip(grads, fresh):
            assert np.array_equal(g, gather_all(v).sum(axis=0) / comm.size)


def test_unplannable_measurement_keeps_running_exactly(comm, monkeypatch):
    """DeFT cannot hide an allreduce of one element under the measured compute (a cost of
    1 s): the synchronizer says why in its profile and keeps running as "none"."""
    from aluminum_py.overlap import profiled
    clock = {"t": 0.0}
    monkeypatch.setattr(profiled, "_now", lambda: clock["t"])
    grads = [np.zeros(s) for s in SHAPES]
    sync = GradientSynchronizer(comm, grads, policy="deft", cost=lambda n: 1.0)
    for step in range(6):
        fresh = make_grads(comm.rank, step)
        info = emulated_step(sync, grads, fresh, clock, comm.rank, begin=False)
        assert info.applied_iterations[0] == (step,)
        for g, v in zip(grads, fresh):
            assert np.array_equal(g, gather_all(v).sum(axis=0) / comm.size)
    assert "exceeds" in sync.profile.error and sync._deft is None


def test_default_constructor(comm):
    """GradientSynchronizer(comm, grads): policy "auto", no profile needed, exact results."""
    grads = [np.zeros(s) for s in SHAPES]
    sync = GradientSynchronizer(comm, grads)
    assert sync.policy == "auto" and sync.profile is None
    for step in range(14):
        fresh = make_grads(comm.rank, step)
        run_step(sync, grads, fresh)
        for g, v in zip(grads, fresh):
            assert np.array_equal(g, gather_all(v).sum(axis=0) / comm.size)
    assert sync.chosen in ("none", "fixed 1 MiB")
