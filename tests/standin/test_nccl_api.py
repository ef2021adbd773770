"""aluminum_py.nccl's NcclComm.split, finalize, destroy and abort (docs/gpu.md "The low-level
aluminum_py.nccl module", Reference) on the NCCL stand-in, with stand-in device memory:

* ``split(color, key)`` gives a communicator over the ranks of that colour, ranked by key, whose
  collectives reduce over those ranks only (against numpy over every rank's input); the parent
  keeps working;
* ``split(..., max_ctas=, min_ctas=)`` carries its own config (``.config``, and the launches on
  it), blocking and nonblocking;
* ``finalize()`` flushes the issued operations, then ``destroy()``; ``destroy``/``abort`` are
  idempotent and any later call raises ``NcclError: the NCCL communicator has been destroyed``.

Run like tests/standin/test_nccl_path.py: ``-p aluminum_py.testing.pytest_standins`` with
AL_CUDA_LIBRARY and AL_NCCL_LIBRARY naming the stand-in (skipped otherwise, e.g. in
tests/test_mpi_suite.py::test_cuda_standin_suite, which sets AL_CUDA_LIBRARY only)."""
import time

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import config, nccl
from aluminum_py.testing import nccl_launches, reset_nccl_launches

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("standins")]
WORLD = MPI.COMM_WORLD




@pytest.fixture(autouse=True)
def hang_timeout(monkeypatch):
    """Nonblocking communicators are settled for at most this long (no test can hang on one)."""
    monkeypatch.setattr(config, "_hang_timeout", 30.0)


@pytest.fixture
def parent(standins):
    """An NCCL communicator over MPI.COMM_WORLD (unique id from rank 0), and a stream."""
    cp = standins
    uid = WORLD.bcast(nccl.get_unique_id() if WORLD.rank == 0 else None, root=0)
    comm = nccl.NcclComm(WORLD.size, uid, WORLD.rank)
    stream = cp.cuda.Stream(non_blocking=True)
    reset_nccl_launches()
    yield comm, stream, cp
    stream.synchronize()
    comm.destroy()
    WORLD.Barrier()


def all_ranks_ok(ok: bool) -> bool:
    return all(WORLD.allgather(bool(ok)))


def on_device(cp, stream, host):
    """A stand-in device copy of `host` (ready before any NCCL call) and its pointer."""
    with stream:
        x = cp.asarray(host)
    stream.synchronize()
    return x, x.__cuda_array_interface__["data"][0]


def host_input(dtype, count, salt=0):
    """Per-rank input: arange-based, different on every rank, small enough to sum exactly."""
    r = WORLD.rank
    return ((np.arange(count) * (r + 2) + 3 * r + salt) % 23 - 11).astype(dtype)


def members(color_of):
    return [k for k in range(WORLD.size) if color_of(k) == color_of(WORLD.rank)]


def mismatch(what, got, expected):
    if got.dtype != expected.dtype or got.shape != expected.shape or \
            not np.array_equal(got, expected):
        return f"{what}: got {got[:6]}... expected {expected[:6]}..."
    return None


@pytest.mark.parametrize("blocking", [None, False], ids=["blocking", "nonblocking"])
def test_split_by_parity(parent, blocking):
    """split(color=rank % 2, key=-rank): one communicator per parity, ranked in reverse; its
    allreduce (sum, max) reduces over that parity's ranks only; the parent still reduces over
    all of them."""
    comm, stream, cp = parent
    r = WORLD.rank
    color = lambda k: k % 2                         # noqa: E731
    group = members(color)
    order = sorted(group, key=lambda k: -k)        # by key, the split's rank order
    child = comm.split(color(r), -r, blocking=blocking)
    problems = []
    try:
        if (child.count, child.user_rank) != (len(group), order.index(r)):
            problems.append(f"count/user_rank {(child.count, child.user_rank)}, expected "
                            f"{(len(group), order.index(r))}")
        if child.config["blocking"] is not blocking or child.device != comm.device:
            problems.append(f"config {child.config}, device {child.device}")
        h32, h64 = host_input(np.int32, 1001), host_input(np.float64, 257, salt=5)
        every32, every64 = np.stack(WORLD.allgather(h32)), np.stack(WORLD.allgather(h64))
        x, px = on_device(cp, stream, h32)
        y, py = on_device(cp, stream, h64)
        out, pout = on_device(cp, stream, np.zeros_like(h64))
        child.allreduce(px, px, h32.size, "int32", "sum", stream.ptr)          # in place
        child.allreduce(py, pout, h64.size, np.float64, al.MAX, stream.ptr)   # out of place
        comm.allreduce(py, py, h64.size, "float64", "SUM", stream.ptr)         # the parent
        got32 = cp.asnumpy(x, stream=stream)
        got_max, got_par = cp.asnumpy(out, stream=stream), cp.asnumpy(y, stream=stream)
        problems += [mismatch("child sum", got32, every32[group].sum(axis=0, dtype=np.int32)),
                     mismatch("child max", got_max, every64[group].max(axis=0)),
                     mismatch("parent sum", got_par, every64.sum(axis=0))]
        launches = nccl_launches()
        if [(l.coll, l.count, l.nranks, l.rank) for l in launches] != [
                ("AllReduce", 1001, len(group), order.index(r)),
                ("AllReduce", 257, len(group), order.index(r)),
                ("AllReduce", 257, WORLD.size, r)]:
            problems.append(f"launches {launches}")
        elif launches[0].comm != launches[1].comm or launches[0].comm == launches[2].comm:
            problems.append(f"the child's launches are not on their own communicator: {launches}")
    except Exception as e:         # reported by every rank together
        problems.append(f"{type(e).__name__}: {e}")
    stream.synchronize()
    child.destroy()
    problems = [p for p in problems if p]
    assert all_ranks_ok(not problems), problems


@pytest.mark.parametrize("blocking", [None, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("min_ctas,max_ctas", [(None, 2), (2, 6), (3, None)])
def test_split_with_cta_limits(parent, min_ctas, max_ctas, blocking):
    """split(..., min_ctas=, max_ctas=): the child's config holds the limits (a min_ctas alone
    gets max_ctas = max(min_ctas, MAX_CHANNELS)), the launches on it carry them, the parent's
    do not; results against numpy."""
    comm, stream, cp = parent
    r = WORLD.rank
    child = comm.split(0, r, min_ctas=min_ctas, max_ctas=max_ctas, blocking=blocking)
    want_max = max_ctas if max_ctas is not None else max(min_ctas, nccl.MAX_CHANNELS)
    problems = []
    try:
        cfg = child.config
        if (cfg["min_ctas"], cfg["max_ctas"], cfg["blocking"]) != (min_ctas, want_max, blocking):
            problems.append(f"config {cfg}")
        if (child.count, child.user_rank) != (WORLD.size, r):
            problems.append(f"count/user_rank {(child.count, child.user_rank)}")
        host = host_input(np.float32, 4096)
        every = np.stack(WORLD.allgather(host))
        x, px = on_device(cp, stream, host)
        child.allreduce(px, px, host.size, "float32", "sum", stream.ptr)
        comm.allreduce(px, px, host.size, "float32", "max", stream.ptr)
        got = cp.asnumpy(x, stream=stream)
        problems.append(mismatch("child sum then parent max", got,
                                 every.sum(axis=0, dtype=np.float32)))
        launches = nccl_launches()
        limits = [(l.min_ctas, l.max_ctas) for l in launches]
        if limits != [(min_ctas, want_max), (None, None)]:
            problems.append(f"launch limits {limits}")
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
    stream.synchronize()
    child.destroy()
    problems = [p for p in problems if p]
    assert all_ranks_ok(not problems), problems


def after_destroy_problems(c, stream_ptr):
    """Every call on a destroyed communicator must raise NcclError ("destroyed",
    INVALID_USAGE); destroy() and abort() again do nothing."""
    problems = []
    calls = {
        "count": lambda: c.count, "user_rank": lambda: c.user_rank, "device": lambda: c.device,
        "async_error": c.async_error, "check_async_error": c.check_async_error,
        "allreduce": lambda: c.allreduce(0, 0, 4, "float32", "sum", stream_ptr),
        "broadcast": lambda: c.broadcast(0, 0, 4, "float32", 0, stream_ptr),
        "reduce": lambda: c.reduce(0, 0, 4, "float32", "sum", 0, stream_ptr),
        "allgather": lambda: c.allgather(0, 0, 4, "float32", stream_ptr),
        "reduce_scatter": lambda: c.reduce_scatter(0, 0, 4, "float32", "sum", stream_ptr),
        "send": lambda: c.send(0, 4, "float32", 0, stream_ptr),
        "recv": lambda: c.recv(0, 4, "float32", 0, stream_ptr),
        "split": lambda: c.split(0, 0),
        "finalize": c.finalize,
    }
    for name, call in calls.items():
        try:
            call()
            problems.append(f"{name} did not raise")
        except al.NcclError as e:
            if "the NCCL communicator has been destroyed" not in str(e) or \
                    e.code != nccl.INVALID_USAGE:
                problems.append(f"{name}: {e!r} code {e.code}")
        except Exception as e:
            problems.append(f"{name}: {type(e).__name__}: {e}")
    for name in ("destroy", "abort", "destroy"):
        try:
            getattr(c, name)()
        except Exception as e:
            problems.append(f"{name} again: {type(e).__name__}: {e}")
    if c.handle != 0:
        problems.append(f"handle {c.handle:#x} after destroy")
    return problems


def parent_problem(parent, host, every, op, when):
    """None if the parent communicator still allreduces `host` (op over every rank's row of
    `every`) correctly, else what went wrong."""
    comm, stream, cp = parent
    try:
        x, px = on_device(cp, stream, host)
        comm.allreduce(px, px, host.size, host.dtype.name, op, stream.ptr)
        return mismatch(f"parent {when}", cp.asnumpy(x, stream=stream),
                        getattr(every, op)(axis=0))
    except Exception as e:
        return f"parent {when}: {type(e).__name__}: {e}"


@pytest.mark.parametrize("blocking", [None, False], ids=["blocking", "nonblocking"])
def test_finalize_then_destroy(parent, blocking):
    """An allreduce issued on a split communicator, finalize() (flushes it: the result is in
    memory when it returns, though the other ranks issue theirs later), destroy(); every later
    call raises "destroyed"; the parent goes on working."""
    comm, stream, cp = parent
    r = WORLD.rank
    child = comm.split(0, WORLD.size - r, blocking=blocking)
    group = list(range(WORLD.size))
    host = host_input(np.int64, 999, salt=1)
    every = np.stack(WORLD.allgather(host))
    problems = []
    try:
        x, px = on_device(cp, stream, host)
        WORLD.Barrier()
        if r != 0:
            time.sleep(0.3)                      # rank 0's allreduce cannot finish before
        child.allreduce(px, px, host.size, "int64", "sum", stream.ptr)
        child.finalize()
        flushed = x.view(np.ndarray).copy()      # the memory as it is, no stream sync
        child.destroy()
        problems.append(mismatch("memory right after finalize", flushed, every[group].sum(axis=0)))
        problems.append(mismatch("allreduce after destroy", cp.asnumpy(x, stream=stream),
                                 every[group].sum(axis=0)))
    except Exception as e:
        problems.append(f"{type(e).__name__}: {e}")
        child.abort()
    problems += after_destroy_problems(child, stream.ptr)
    problems.append(parent_problem(parent, host, every, "min", "after the child was destroyed"))
    problems = [p for p in problems if p]
    assert all_ranks_ok(not problems), problems


def test_abort_then_calls_raise(parent):
    """abort() (ncclCommAbort) on an idle split communicator: later calls raise "destroyed",
    abort/destroy again do nothing; the parent is unaffected."""
    comm, stream, cp = parent
    r = WORLD.rank
    child = comm.split(0, r)
    child.abort()
    problems = after_destroy_problems(child, stream.ptr)
    host = host_input(np.float64, 100, salt=2)
    every = np.stack(WORLD.allgather(host))
    problems.append(parent_problem(parent, host, every, "sum", "after the child was aborted"))
    problems = [p for p in problems if p]
    assert all_ranks_ok(not problems), problems


def test_destroyed_parent_cannot_split(parent):
    """The parent itself, destroyed: split (and everything else) raises "destroyed" on every
    rank, before any collective work."""
    comm, stream, cp = parent
    comm.finalize()
    comm.destroy()
    problems = after_destroy_problems(comm, stream.ptr)
    assert all_ranks_ok(not problems), problems


def test_launch_records_name_their_group(parent):
    """Each launch records the serial number of the outermost group it was issued in (nested
    groups share it; a later group has a larger one) and 0 outside a group: how the tests see
    that point-to-point batches reach NCCL as one group."""
    comm, stream, cp = parent
    x, ptr = on_device(cp, stream, np.arange(8, dtype=np.float32))
    comm.allreduce(ptr, ptr, 8, "float32", "sum", stream.ptr)
    with nccl.group():
        comm.allreduce(ptr, ptr, 8, "float32", "sum", stream.ptr)
        with nccl.group():
            comm.broadcast(ptr, ptr, 8, "float32", 0, stream.ptr)
    with nccl.group():
        comm.reduce(ptr, ptr, 8, "float32", "max", 0, stream.ptr)
    stream.synchronize()
    groups = [launch.group for launch in nccl_launches()]
    assert groups[0] == 0 and groups[1] == groups[2] > 0 and groups[3] > groups[2], groups
    assert [launch.grouped for launch in nccl_launches()] == [False, True, True, True]
