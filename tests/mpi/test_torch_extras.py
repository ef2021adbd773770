"""What torch's own suite checks of a CPU backend beyond the collectives (gloo has them): the
profiler's events of each call (``aluminum:all_reduce``, ..., asynchronous, with the input
shapes; one event for a coalesced call), sparse COO ``all_reduce``, the group's
``monitored_barrier``, and a timeout message torch's checks recognise."""
import re
from datetime import timedelta

import numpy as np
import pytest

from conftest import WORLD, all_ranks_ok, gather_all

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import aluminum_py.torch as alt  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]
RANK, SIZE = WORLD.rank, WORLD.size


@pytest.fixture(scope="module")
def world():
    alt.init_process_group(timeout=timedelta(seconds=60))
    yield dist.group.WORLD
    dist.destroy_process_group()


def events(prof, name):
    return [e for e in prof.function_events if e.name == name]


def test_profiler_records_each_call(world):
    """all_reduce (blocking and async), a coalesced all_reduce (one event, every shape),
    send/recv: each an asynchronous event named for the backend, with the input shapes."""
    t, u = torch.ones(3, 4), torch.ones(5)
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        dist.all_reduce(t)
        dist.all_reduce(u, async_op=True).wait()
        dist.all_reduce_coalesced([t, u])
        if SIZE > 1:
            peer = RANK ^ 1
            if peer < SIZE:
                if RANK % 2 == 0:
                    dist.send(t, peer)
                else:
                    dist.recv(t, peer)
    ar = events(prof, "aluminum:all_reduce")
    shapes = sorted(str(e.input_shapes) for e in ar)
    ok = (len(ar) == 3 and all(e.is_async and e.count == 1 for e in ar)
          and shapes == sorted(["[[3, 4]]", "[[5]]", "[[3, 4], [5]]"])
          and t.eq(SIZE ** 2).all().item() and u.eq(SIZE ** 2).all().item())
    if SIZE > 1 and RANK ^ 1 < SIZE:
        p2p = events(prof, "aluminum:send" if RANK % 2 == 0 else "aluminum:recv")
        ok = ok and len(p2p) == 1 and p2p[0].is_async
    assert all_ranks_ok(ok), [(e.name, e.is_async, e.input_shapes) for e in ar]


def test_no_event_without_the_profiler(world):
    """Outside the profiler a blocking call runs in the caller (no waiter hand-off)."""
    t = torch.ones(4)
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    work = world.allreduce([t], opts)
    assert all_ranks_ok(work._completion is None and not work._by_waiter)


def test_sparse_all_reduce_sums(world):
    """Each rank's sparse COO tensor (2 sparse dims, 1 dense, a different number of nonzeros
    per rank, rank 0 none): the sum over ranks, as numpy adds the dense forms."""
    rng = np.random.default_rng([3, RANK])
    n = 0 if RANK == 0 else 1 + RANK
    idx = np.stack([rng.integers(0, 4, n), rng.integers(0, 5, n)])
    val = rng.integers(-4, 5, size=(n, 2)).astype(np.float32)
    t = torch.sparse_coo_tensor(torch.from_numpy(idx), torch.from_numpy(val), (4, 5, 2))
    dense = t.to_dense().numpy()
    dist.all_reduce(t)
    got = t.to_dense().numpy()
    ok = t.is_sparse and np.array_equal(got, gather_all(dense.reshape(-1)).sum(axis=0)
                                        .reshape(4, 5, 2))
    with pytest.raises(ValueError, match="SUM only"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert all_ranks_ok(ok)


def test_monitored_barrier(world):
    """Every rank calls: it passes.  Rank 1 stays away: rank 0 raises naming it (every absent
    rank with wait_all_ranks), the others that came raise that rank 0 did not release them.
    A zero timeout: rank 0 raises at once."""
    group = dist.new_group(list(range(SIZE)))
    group.monitored_barrier(timedelta(seconds=30))
    group.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)
    if SIZE < 2:
        return
    errors = []
    if RANK != 1:
        try:
            group.monitored_barrier(timedelta(seconds=1), wait_all_ranks=SIZE > 2)
        except RuntimeError as e:
            errors.append(str(e))
    expected = (("Ranks 1" if SIZE > 2 else "Rank 1") + " failed to pass monitoredBarrier"
                if RANK == 0 else
                f"Rank {RANK} successfully reached monitoredBarrier, but received errors "
                f"while waiting for send/recv from rank 0")
    ok = RANK == 1 or (len(errors) == 1 and expected in errors[0])
    if RANK == 0:
        with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier"):
            group.monitored_barrier(timedelta(seconds=0))
    assert all_ranks_ok(ok), errors


def test_timeout_message_names_a_timeout(world):
    """torch's checks of a timed-out call match " (Timed out|closed|timeout) "."""
    err = world._timed_out("barrier", 1.0, None)
    world._broken = None
    assert re.search(" (Timed out|closed|timeout) ", str(err)), str(err)
