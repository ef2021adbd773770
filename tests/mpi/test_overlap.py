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
    with pytest.raises(ValueError, match="compute_times"):
        GradientSynchronizer(comm, grads, policy="mgwfbp")
    with pytest.raises(ValueError, match="plan"):
        GradientSynchronizer(comm, grads, policy="libra")
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
