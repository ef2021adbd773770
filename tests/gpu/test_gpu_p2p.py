"""Point-to-point on GPU buffers launched as NCCL groups, under mpiexec at 2 ranks and more.

Nonblocking GPU sends and receives of a communicator wait in one batch, which is launched as one
``ncclGroupStart``/``ncclGroupEnd`` at the first Wait/Test of one of its requests, at the next
other GPU operation on the communicator (a blocking Send/Recv/Sendrecv joins the batch as its
last member), or at the end of ``comm.p2p_group()`` (docs/gpu.md, "Point-to-point: one NCCL
group per batch"). Launched one group per call, the patterns here deadlock: each rank's receive
waits on the stream behind its own send, which waits for the peer's receive. Sizes are beyond
NCCL's (and the stand-in MPI's) eager buffering: 256 KiB and 16 MiB.

Values are compared with numpy against every rank's inputs, gathered with mpi4py. Runs on a GPU
and on the CUDA, NCCL and CuPy stand-ins (``-p aluminum_py.testing.pytest_standins``), where the
NCCL launches are also checked (one group serial per batch). A deadlock fails at the test's
timeout.
"""
import os

import numpy as np
import pytest

from test_gpu import comm  # noqa: F401  (the fixture: a communicator bound to a CuPy stream)
from test_gpu import WAIT, fetch, to_gpu

import aluminum_py as al

pytestmark = [pytest.mark.gpu, pytest.mark.mpi, pytest.mark.timeout(120)]

SIZES = {"256KiB": 256 << 10, "16MiB": 16 << 20}
ORDERS = ["as_issued", "reversed", "receives_first", "waitany", "testall"]
CASES = [(order, "256KiB") for order in ORDERS] + [("as_issued", "16MiB"), ("waitany", "16MiB")]


def on_standin() -> bool:
    from aluminum_py.testing import cuda_standin
    return os.environ.get("AL_NCCL_LIBRARY") == cuda_standin.path()


def launches():
    from aluminum_py.testing import nccl_launches
    return nccl_launches()


def gather_inputs(host: np.ndarray) -> np.ndarray:
    """Every rank's host array, stacked in rank order (mpi4py's buffer Allgather: these are
    megabytes)."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    out = np.empty((world.Get_size(),) + host.shape, host.dtype)
    world.Allgather(np.ascontiguousarray(host), out)
    return out


def data(rank: int, nbytes: int, salt: int = 0) -> np.ndarray:
    """float32 values distinct per rank, element and salt, exact in float32."""
    n = nbytes // 4
    return ((np.arange(n, dtype=np.int64) * 7 + 1000 * rank + 100003 * salt) % 65521
            ).astype(np.float32)


def ring(c, stream, nbytes: int):
    """A ring's neighbours (right, left), this rank's message, what comes from the left, the
    message and a zeroed receive buffer on the device."""
    right, left = (c.rank + 1) % c.size, (c.rank - 1) % c.size
    mine = data(c.rank, nbytes)
    x, y = to_gpu(mine, stream), to_gpu(np.zeros(nbytes // 4, np.float32), stream)
    return right, left, mine, gather_inputs(mine)[left], x, y


def two_messages(c, stream, nbytes: int):
    """Two messages of `nbytes` per rank: a ring's neighbours (right, left), every rank's
    inputs ([rank][message]), this rank's on the device, and two zeroed receive buffers there."""
    mine = [data(c.rank, nbytes, salt=s) for s in range(2)]
    x = [to_gpu(m, stream) for m in mine]
    y = [to_gpu(np.zeros(nbytes // 4, np.float32), stream) for _ in mine]
    return (c.rank + 1) % c.size, (c.rank - 1) % c.size, gather_inputs(np.stack(mine)), x, y


def complete(reqs: list, order: str) -> None:
    """Complete `reqs` in one of several orders (each rank its own for the rotating ones)."""
    if order == "as_issued":
        al.Waitall(reqs, timeout=WAIT)
    elif order == "reversed":
        al.Waitall(reqs[::-1], timeout=WAIT)
    elif order == "receives_first":       # the receives are at odd positions
        al.Waitall(reqs[1::2] + reqs[0::2], timeout=WAIT)
    elif order == "waitany":
        for _ in reqs:
            assert al.Waitany(reqs, timeout=WAIT) is not al.UNDEFINED
    else:
        while not al.Testall(reqs):       # polls the completion events
            pass


def need_ranks(c, n: int = 2) -> None:
    if c.size < n:
        pytest.skip(f"needs {n} ranks")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("order,size", CASES)
def test_every_rank_sends_first(comm, order, size):
    """Each rank Isends to every other rank first, then Irecvs from each (at 2 ranks: both send
    first; at 3: a ring each way), and completes the requests in `order`."""
    c, stream = comm
    need_ranks(c)
    nbytes = SIZES[size]
    mine = [data(c.rank, nbytes, salt=j) for j in range(c.size)]   # block j goes to rank j
    everyone = gather_inputs(np.stack(mine))                          # [from][to]
    peers = [(c.rank + k) % c.size for k in range(1, c.size)]
    x = [to_gpu(mine[j], stream) for j in peers]
    y = [to_gpu(np.full(nbytes // 4, -1, np.float32), stream) for _ in peers]
    with stream:
        reqs = []
        for j, xs, ys in zip(peers, x, y):
            reqs.append(c.Isend(xs, dest=j))
            reqs.append(None)
        for k, (j, ys) in enumerate(zip(peers, y)):
            reqs[2 * k + 1] = c.Irecv(ys, source=j)
        complete(reqs, order)
    got = fetch(stream, *y)
    for j, out in zip(peers, got):
        np.testing.assert_array_equal(out, everyone[j][c.rank], err_msg=f"from rank {j}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("size", list(SIZES))
def test_ring_exchange(comm, size):
    """Isend to the right, Irecv from the left, then Waitall of (send, receive) on every rank."""
    c, stream = comm
    need_ranks(c)
    nbytes = SIZES[size]
    right, left, mine, exp, x, y = ring(c, stream, nbytes)
    with stream:
        reqs = [c.Isend(x, dest=right), c.Irecv(y, source=left)]
        al.Waitall(reqs, timeout=WAIT)
    out, sent = fetch(stream, y, x)
    np.testing.assert_array_equal(sent, mine)
    np.testing.assert_array_equal(out, exp)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("collective", ["Allreduce", "Iallreduce"])
def test_batch_launches_before_a_collective(comm, collective):
    """Isend, Irecv, then an allreduce of another buffer before any Wait: the batch launches
    ahead of the collective (in call order), and both results are right."""
    c, stream = comm
    need_ranks(c)
    nbytes = SIZES["16MiB"]
    right, left, mine, exp, x, y = ring(c, stream, nbytes)
    a_host = data(c.rank, 4096, salt=3)
    a_exp = gather_inputs(a_host).sum(axis=0, dtype=np.float32)
    a = to_gpu(a_host, stream)
    with stream:
        reqs = [c.Isend(x, dest=right), c.Irecv(y, source=left)]
        if collective == "Allreduce":
            c.Allreduce(a, algorithm="nccl")
        else:
            reqs.append(c.Iallreduce(a, algorithm="nccl"))
        al.Waitall(reqs[::-1], timeout=WAIT)
    out, reduced = fetch(stream, y, a)
    np.testing.assert_array_equal(out, exp)
    np.testing.assert_array_equal(reduced, a_exp)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("blocking", ["Send", "Recv", "Sendrecv"])
def test_blocking_call_joins_the_batch(comm, blocking):
    """Every rank Isends to the right first; then a blocking call completes the exchange (a
    Send after an Irecv, a Recv, or a Sendrecv); it joins the batch, which launches as one
    group on the bound stream. The Isend's request then completes with it."""
    c, stream = comm
    need_ranks(c)
    nbytes = SIZES["16MiB"]
    right, left, everyone, x, y = two_messages(c, stream, nbytes)
    if on_standin():
        before = len(launches())
    with stream:
        if blocking == "Send":      # x[0] right, y[0] and y[1] from the left; then x[1] right
            reqs = [c.Isend(x[0], dest=right), c.Irecv(y[0], source=left),
                    c.Irecv(y[1], source=left)]
            c.Send(x[1], dest=right)
        elif blocking == "Recv":
            reqs = [c.Isend(x[0], dest=right), c.Isend(x[1], dest=right),
                    c.Irecv(y[0], source=left)]
            c.Recv(y[1], source=left)
        else:
            reqs = [c.Isend(x[0], dest=right), c.Irecv(y[0], source=left)]
            c.Sendrecv(x[1], right, y[1], left)
        if on_standin():
            batch = launches()[before:]
            assert len(batch) == 4 and len({(l.group, l.stream) for l in batch}) == 1, batch
            assert batch[0].group > 0 and batch[0].stream == stream.ptr, batch
        al.Waitall(reqs, timeout=WAIT)
    got = fetch(stream, *y)
    for s in range(2):
        np.testing.assert_array_equal(got[s], everyone[left][s], err_msg=f"message {s}")


@pytest.mark.mpi(min_size=2)
def test_p2p_group_launches_at_its_end(comm):
    """``with comm.p2p_group():`` launches the batch at the end of the block, as one group; a
    Wait inside the block, or another GPU operation there, raises al.Error before anything
    runs (the batch would wait for itself)."""
    c, stream = comm
    need_ranks(c)
    nbytes = SIZES["256KiB"]
    right, left, mine, exp, x, y = ring(c, stream, nbytes)
    other = to_gpu(np.ones(8, np.float32), stream)
    if on_standin():
        before = len(launches())
    with stream:
        with c.p2p_group():
            reqs = [c.Irecv(y, source=left), c.Isend(x, dest=right)]
            with pytest.raises(al.Error, match="p2p_group"):
                reqs[0].Wait()
            with pytest.raises(al.Error, match="p2p_group"):
                reqs[1].Test()
            with pytest.raises(al.Error, match="p2p_group"):
                c.Allreduce(other)
            with pytest.raises(al.Error, match="p2p_group"):
                c.Send(other, dest=right)
            if on_standin():
                assert len(launches()) == before        # nothing launched yet
        if on_standin():
            batch = launches()[before:]
            assert [l.coll for l in batch] == ["Recv", "Send"], batch
            assert len({l.group for l in batch}) == 1 and batch[0].group > 0, batch
        al.Waitall(reqs, timeout=WAIT)
    out, ones = fetch(stream, y, other)
    np.testing.assert_array_equal(out, exp)
    np.testing.assert_array_equal(ones, np.ones(8, np.float32))    # the refused calls ran nothing


@pytest.mark.mpi(min_size=2)
def test_p2p_group_inside_coalescing_pattern(comm):
    """torch's batch_isend_irecv pattern: p2p_group entered and left explicitly (as
    _start_coalescing / _end_coalescing do), every rank sending to both neighbours first; the
    requests are waited for after the group. 16 MiB each way."""
    c, stream = comm
    need_ranks(c)
    nbytes = SIZES["16MiB"]
    right, left, everyone, x, y = two_messages(c, stream, nbytes)
    with stream:
        group = c.p2p_group()
        group.__enter__()
        reqs = [c.Isend(x[0], dest=right), c.Isend(x[1], dest=left),
                c.Irecv(y[0], source=left), c.Irecv(y[1], source=right)]
        group.__exit__(None, None, None)
        for r in reqs:
            r.Wait()
    got = fetch(stream, *y)
    np.testing.assert_array_equal(got[0], everyone[left][0])
    np.testing.assert_array_equal(got[1], everyone[right][1])


@pytest.mark.mpi(min_size=2)
def test_isendrecv_joins_the_batch(comm):
    """An Isend to the left and an Irecv from the right, then an Isendrecv to the right (from
    the left): one batch."""
    c, stream = comm
    need_ranks(c)
    nbytes = SIZES["256KiB"]
    right, left, everyone, x, y = two_messages(c, stream, nbytes)
    with stream:
        reqs = [c.Isend(x[0], dest=left), c.Irecv(y[0], source=right),
                c.Isendrecv(x[1], right, y[1], left)]
        al.Waitall(reqs[::-1], timeout=WAIT)
    got = fetch(stream, *y)
    np.testing.assert_array_equal(got[0], everyone[right][0])
    np.testing.assert_array_equal(got[1], everyone[left][1])


def test_free_launches_the_batch(gpu_index):
    """Requests never waited for: Free launches their batch (the next operation on the
    communicator), and the data arrives (a device synchronize waits for every stream)."""
    from test_gpu import need_cupy
    need_cupy()
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    c = al.Communicator(stream=stream)
    right, left, mine, exp, x, y = ring(c, stream, SIZES["256KiB"])
    with stream:
        reqs = [c.Isend(x, dest=right), c.Irecv(y, source=left)]
    c.Free()
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y), exp)
    del reqs


def test_a_failed_launch_fails_every_request(comm, monkeypatch):
    """When the group cannot be launched (here: NCCL refuses its first send), the call that
    launched it raises NCCL's error and every other request of the batch raises al.Error naming
    it; the communicator then works. To this rank itself, so it runs at any size."""
    from aluminum_py import nccl
    from aluminum_py.errors import NcclError
    c, stream = comm
    mine = data(c.rank, 4096)
    x, y = to_gpu(mine, stream), to_gpu(np.zeros(mine.size, np.float32), stream)

    def refuse(self, *args):
        raise NcclError("ncclSend failed: ncclInvalidUsage (a test double)", nccl.INVALID_USAGE)
    with stream:
        reqs = [c.Isend(x, dest=c.rank), c.Irecv(y, source=c.rank)]
        with monkeypatch.context() as m:
            m.setattr(nccl.NcclComm, "send", refuse)
            with pytest.raises(NcclError, match="a test double"):
                reqs[1].Wait()
        with pytest.raises(al.Error, match="failed to launch.*a test double"):
            reqs[0].Wait()
        with pytest.raises(al.Error, match="failed to launch"):
            reqs[1].Test()
        reqs = [c.Isend(x, dest=c.rank), c.Irecv(y, source=c.rank)]
        al.Waitall(reqs, timeout=WAIT)
    (out,) = fetch(stream, y)
    np.testing.assert_array_equal(out, mine)


@pytest.mark.mpi(min_size=2)
def test_wait_from_another_thread_launches_the_batch(comm):
    """The batch launched by a Wait in another thread (as torch's waiter thread waits), while
    the owner thread goes on: the data arrives, every rank sending first at 16 MiB."""
    import threading
    c, stream = comm
    need_ranks(c)
    right, left, mine, exp, x, y = ring(c, stream, SIZES["16MiB"])
    with stream:
        reqs = [c.Isend(x, dest=right), c.Irecv(y, source=left)]
    failures = []

    def waiter():
        try:
            al.Waitall(reqs, timeout=WAIT)
        except Exception as e:      # reported by the owner thread
            failures.append(e)
    t = threading.Thread(target=waiter)
    t.start()
    t.join(WAIT)
    assert not t.is_alive() and not failures, failures
    with stream:
        reqs[1].Wait()              # launched already: the bound stream waits for it
    out, sent = fetch(stream, y, x)
    np.testing.assert_array_equal(sent, mine)
    np.testing.assert_array_equal(out, exp)
