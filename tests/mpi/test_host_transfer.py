"""The host-transfer allreduce state machine on the CPU device implementation, under real MPI
ranks: results, and the ordering the GPU version relies on."""

import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import host_transfer as ht
from conftest import WORLD, gather_all, make_input, reference

pytestmark = pytest.mark.mpi

ALGS = ["ht_mpi", "ht_recursive_doubling", "ht_rabenseifner", "ht_ring", "ht_auto"]


@pytest.fixture(scope="module")
def device():
    return ht.CpuDevice()


@pytest.mark.parametrize("algorithm", ALGS)
@pytest.mark.parametrize("count", [0, 1, 7, 1001, 100003])
def test_results_and_stream_order(comm, device, algorithm, count):
    """Work queued before the op (a copy filling sendbuf) happens before it; work queued after
    (a copy of recvbuf) sees the result; the host never waited for the device."""
    stream = device.stream()
    x = make_input("float32", al.SUM, count, seed=count, rank=comm.rank)
    expected = reference(al.SUM, gather_all(x), comm.size)
    staged, send = x.copy(), np.zeros_like(x)
    recv, after = np.full_like(x, -1), np.full_like(x, -2)
    if count:
        stream.memcpy(al._core.addr(send), al._core.addr(staged), staged.nbytes)
    req = ht.allreduce(comm, device, stream, send, recv, algorithm=algorithm)
    if count:
        stream.memcpy(al._core.addr(after), al._core.addr(recv), recv.nbytes)
    req.Wait(timeout=60)
    assert stream.synchronize(timeout=60)
    assert np.array_equal(recv, expected)
    if count:
        assert np.array_equal(after, expected)
    assert np.array_equal(send, x)                      # out of place: input untouched


def test_phase_ordering_and_pinned_buffer_pooled(comm):
    """The phases run in order; the pinned buffer goes back to the device's pool after the
    copy-back (never freed by the engine: a free is implicitly synchronizing on CUDA), and the
    next op of its size class reuses it without allocating."""
    device = ht.CpuDevice()
    stream = device.stream()
    n = 1 << 16
    send = np.full(n, comm.rank + 1.0, dtype=np.float64)
    recv = np.zeros_like(send)
    req = ht.allreduce(comm, device, stream, send, recv, op=al.MAX, algorithm="ht_ring")
    req.Wait(timeout=60)
    assert stream.synchronize(timeout=60)
    d2h_seen, host_done, flag, h2d_seen = ht.phase_times(req)
    assert d2h_seen <= host_done <= flag <= h2d_seen
    trace = device.trace()
    kinds = [k for k, _, _ in trace]
    # the stream's own record of what ran: the copy-back ran after the wait on the flag, which
    # ended after the engine wrote it
    waits = [t for k, t, _ in trace if k == "wait"]
    assert waits and waits[-1] >= flag
    assert kinds.count("alloc") == 1 and "free" not in kinds
    assert device.pinned_stats() == {"allocs": 1, "reuses": 0, "taken": 0,
                                     "cached_bytes": 1 << 20}   # 512 KiB + flag: 1 MiB class
    assert np.all(recv == comm.size)
    req = ht.allreduce(comm, device, stream, recv, op=al.SUM, algorithm="ht_recursive_doubling")
    req.Wait(timeout=60)
    assert device.pinned_stats()["allocs"] == 1 and device.pinned_stats()["reuses"] == 1
    assert np.all(recv == comm.size ** 2)
    device.release_pinned()
    assert device.pinned_stats()["cached_bytes"] == 0
    assert [k for k, _, _ in device.trace()].count("free") == 1
    stream.destroy()


def test_many_in_flight_on_two_streams(comm, device):
    streams = [device.stream(), device.stream()]
    bufs, reqs = [], []
    for i in range(24):
        x = np.full(1000 + 13 * i, comm.rank + i, dtype=np.int64)
        reqs.append(ht.allreduce(comm, device, streams[i % 2], x, algorithm=ALGS[i % 4]))
        bufs.append(x)
    al.Waitall(reqs, timeout=120)
    for st in streams:
        assert st.synchronize(timeout=60)
    for i, x in enumerate(bufs):
        assert np.all(x == sum(r + i for r in range(comm.size))), i


def test_host_is_not_blocked_by_the_stream(comm, device):
    """The call returns while the stream is still busy with earlier work (here blocked until
    the test opens a gate: a call that waited for the stream would never return), and the op
    completes once the stream gets to it."""
    stream = device.stream()
    gate = np.zeros(1, dtype=np.uint32)
    stream.wait_value32(al._core.addr(gate), 1)
    x = np.arange(10, dtype=np.float64) + comm.rank
    expected = gather_all(x).sum(axis=0)
    req = ht.allreduce(comm, device, stream, x, algorithm="ht_recursive_doubling")
    assert not req.done and not stream.synchronize(timeout=0)
    assert ht.phase_times(req)[0] == 0                 # the copy out has not run
    gate[0] = 1
    req.Wait(timeout=60)
    assert stream.synchronize(timeout=60)
    assert np.array_equal(x, expected)


def test_bad_arguments(comm, device):
    stream = device.stream()
    x = np.ones(4, dtype=np.float32)
    with pytest.raises(ValueError, match="algorithm"):
        ht.allreduce(comm, device, stream, x, algorithm="ring")
    with pytest.raises(TypeError, match="op"):
        ht.allreduce(comm, device, stream, x, op=al.BAND)
    with pytest.raises(ValueError, match="recvbuf"):
        ht.allreduce(comm, device, stream, x, np.ones(2, dtype=np.float32))


@pytest.mark.parametrize("after", ["Iallreduce-mpi", "Bcast", "Allreduce-mpi"])
def test_mpi_collectives_keep_call_order_behind_ht_mpi(comm, device, after):
    """ht_mpi starts its MPI_Iallreduce only when the device copy is done, which differs per
    rank (here rank 0's stream is busy); a later MPI collective must still come second."""
    stream = device.stream()
    if comm.rank == 0:
        big = np.ones(64 << 20, dtype=np.uint8)
        out = np.empty_like(big)
        for _ in range(3):
            stream.memcpy(al._core.addr(out), al._core.addr(big), big.nbytes)
    x = np.full(100, 1.0)
    y = np.full(100, float(comm.rank + 1))
    req = ht.allreduce(comm, device, stream, x, algorithm="ht_mpi")
    if after == "Iallreduce-mpi":
        comm.Iallreduce(y, algorithm="mpi").Wait(timeout=60)
    elif after == "Allreduce-mpi":
        comm.Allreduce(y, algorithm="mpi")
    else:
        comm.Bcast(y, root=comm.size - 1)
    req.Wait(timeout=60)
    assert stream.synchronize(timeout=60)
    assert np.all(x == comm.size)
    if after == "Bcast":
        assert np.all(y == comm.size)
    else:
        assert np.all(y == sum(range(1, comm.size + 1)))
