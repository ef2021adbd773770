"""Sub-groups of the torch backend "aluminum" made by ``ProcessGroupAluminum.split_group`` (torch
2.13's ``dist.split_group`` needs an accelerator, docs/torch.md "Groups"), and
``Communicator.timeout``, the per-communicator bound the backend gives a group's timeout."""
import time

import numpy as np
import pytest

import aluminum_py as al
from conftest import WORLD, all_ranks_ok, gather_all

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import aluminum_py.torch as alt  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.layout]


@pytest.fixture(scope="module")
def world():
    alt.init_process_group()
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_split_group_parts(world):
    """Parts [0, 2, 4, ...] and [1, 3, ...]: each rank's part reduces its members' inputs; the
    part's ranks are ordered as the parent's; a rank left out of every part gets None."""
    r, n = WORLD.rank, WORLD.size
    mine = list(range(r % 2, n, 2))
    sub = world.split_group(mine, group_name=f"part{r % 2}")
    assert isinstance(sub, alt.ProcessGroupAluminum)
    x = np.arange(5, dtype=np.float64) + 100 * r
    t = torch.from_numpy(x.copy())
    sub.allreduce([t], dist.AllreduceOptions()).wait()
    every = gather_all(x)
    ok = (np.array_equal(t.numpy(), every[mine].sum(axis=0)) and sub.size() == len(mine)
          and sub.rank() == mine.index(r) and sub.getGroupName() == f"part{r % 2}")
    assert all_ranks_ok(ok)
    only_first = world.split_group([0])
    assert all_ranks_ok((only_first is None) == (r != 0))
    if only_first is not None:
        t = torch.ones(2)
        only_first.allreduce([t], dist.AllreduceOptions()).wait()
        assert t.tolist() == [1.0, 1.0]
        only_first.shutdown()
    sub.shutdown()


def test_communicator_timeout_bounds_blocking_probe(comm):
    """A Probe for a message nobody sends raises al.TimeoutError after the communicator's
    timeout (here 0.3 s; AL_HANG_TIMEOUT otherwise); bad values are refused."""
    c = al.Communicator(comm)
    assert c.timeout is None
    c.timeout = 0.3
    t0 = time.monotonic()
    with pytest.raises(al.TimeoutError, match="after 0.3"):
        c.Probe(source=WORLD.rank, tag=31001)
    took = time.monotonic() - t0
    with pytest.raises(ValueError, match="seconds > 0"):
        c.timeout = 0
    c.timeout = None
    assert c.timeout is None
    c.Free()
    assert all_ranks_ok(0.3 <= took < 30), took


@pytest.mark.parametrize("dtype,op", [("float32", "SUM"), ("float64", "AVG"), ("int64", "MAX"),
                                      ("bfloat16", "SUM"), ("bool", "SUM"), ("int32", "BXOR")])
def test_direct_all_reduce(world, dtype, op):
    """aluminum_py.torch.all_reduce (dist.all_reduce without torch's dispatch): in place, the
    tensor returned, numpy's result from every rank's input; on a sub-group too."""
    r = WORLD.rank
    rng = np.random.default_rng(100 + r)
    x = rng.integers(0, 4, size=33)
    if dtype == "bool":
        x = x > 1
    every = gather_all(x)
    want = {"SUM": every.sum(axis=0), "AVG": every.mean(axis=0), "MAX": every.max(axis=0),
            "BXOR": np.bitwise_xor.reduce(every, axis=0)}[op]
    if dtype == "bool":
        want = every.any(axis=0)
    t = torch.tensor(x).to(getattr(torch, dtype))
    got = alt.all_reduce(t, getattr(dist.ReduceOp, op))
    ok = got is t and np.allclose(t.to(torch.float64).numpy(), np.asarray(want, np.float64))
    assert all_ranks_ok(ok), (t, want)


def test_direct_all_reduce_on_a_sub_group_and_refusals(world):
    r, n = WORLD.rank, WORLD.size
    sub = world.split_group(list(range(r % 2, n, 2)))
    t = torch.full((4,), float(r))
    alt.all_reduce(t, group=sub)
    ok = t.tolist() == [float(sum(range(r % 2, n, 2)))] * 4
    sub.shutdown()
    gloo = dist.new_group(backend="gloo")
    with pytest.raises(TypeError, match="'aluminum' backend"):
        alt.all_reduce(torch.ones(2), group=gloo)
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        alt.all_reduce(torch.ones(2), dist._make_nccl_premul_sum(2.0))
    with pytest.raises(ValueError, match="contiguous"):
        alt.all_reduce(torch.ones(4, 2)[:, 0])
    assert all_ranks_ok(ok)


def test_methods_called_without_options(world):
    """The ProcessGroup methods called directly without their options object (torch's Python
    callers always pass one; a user's code may not): torch's defaults (root 0, SUM)."""
    n, r = world.size(), world.rank()
    t = torch.full((3,), float(r + 1))
    world.reduce([t]).wait()
    ok = r != 0 or t.tolist() == [n * (n + 1) / 2] * 3
    b = torch.full((2,), float(r + 5))
    world.broadcast([b]).wait()
    ok = ok and b.tolist() == [5.0, 5.0]
    o = torch.empty(2)
    world.reduce_scatter([o], [[torch.full((2,), float(i + r)) for i in range(n)]]).wait()
    ok = ok and o.tolist() == [float(n * r + n * (n - 1) / 2)] * 2
    outs = [torch.empty(2) for _ in range(n)]
    world.allgather([outs], [torch.full((2,), float(r))]).wait()
    ok = ok and [x[0].item() for x in outs] == list(range(n))
    g = [[torch.empty(1) for _ in range(n)]] if r == 0 else []
    world.gather(g, [torch.full((1,), float(r))]).wait()
    ok = ok and (r != 0 or [x.item() for x in g[0]] == list(range(n)))
    sc = torch.empty(1)
    world.scatter([sc], [[torch.full((1,), float(10 + i)) for i in range(n)]] if r == 0 else []
                  ).wait()
    ok = ok and sc.item() == 10 + r
    parts = [[torch.empty(1), torch.empty(2)] for _ in range(n)]
    world.allgather_coalesced(parts, [torch.full((1,), float(r)), torch.full((2,), -float(r))]
                              ).wait()
    ok = ok and all(p[0].item() == i and p[1].tolist() == [-float(i)] * 2
                    for i, p in enumerate(parts))
    assert all_ranks_ok(ok)
