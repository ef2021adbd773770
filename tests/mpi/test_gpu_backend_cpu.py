"""The communicator's GPU backend (aluminum_py.gpu.GpuBackend) run on the CPU device under real
MPI ranks: "GPU buffers" are numpy arrays behind __cuda_array_interface__, streams are CPU
worker threads (host_transfer.bind). Checks what the CUDA device cannot be checked for here:
failures of blocking host-transfer ops, AL_HANG_TIMEOUT, GpuRequest.Wait(timeout=), pending
counts, the internal stream's destruction and the private control communicator."""
import os
import time

import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import config
from aluminum_py import host_transfer as ht
from aluminum_py.testing.internals import addr

pytestmark = pytest.mark.mpi


class DeviceArray:
    """A numpy array presented as a GPU buffer; with the CPU device, device memory is host
    memory."""

    def __init__(self, a: np.ndarray):
        self.a = a
        self.__cuda_array_interface__ = {"shape": a.shape, "typestr": a.dtype.str,
                                         "data": (a.ctypes.data, False), "strides": None,
                                         "version": 3}


@pytest.fixture(scope="module")
def device():
    return ht.CpuDevice()


@pytest.fixture
def bound(device):
    """A fresh communicator whose GPU backend runs on the CPU device, and its bound stream
    (destroyed once the gates of `hold` are open: a failed test may have left one shut)."""
    comm = al.Communicator()
    stream = device.stream()
    ht.bind(comm, device, stream)
    yield comm, stream
    while GATES:
        GATES.pop()[0] = 1
    stream.destroy()


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


GATES = []       # the gates of `hold`, opened at the end of the test at the latest


def hold(stream) -> np.ndarray:
    """Keep `stream` busy until the test opens the returned gate (gate[0] = 1)."""
    gate = np.zeros(1, dtype=np.uint32)
    stream.wait_value32(addr(gate), 1)
    GATES.append(gate)
    return gate


def wait_until(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.mark.parametrize("algorithm", ["ht_ring", "ht_mpi", "ht_rabenseifner"])
def test_blocking_and_nonblocking_allreduce(bound, algorithm):
    comm, stream = bound
    n = comm.size
    x = np.full(1001, comm.rank + 1.0)
    y = np.arange(77, dtype=np.int32) * (comm.rank + 1)
    comm.Allreduce(DeviceArray(x), algorithm=algorithm)
    req = comm.Iallreduce(DeviceArray(y), op=al.MAX, algorithm=algorithm)
    assert req.algorithm == algorithm
    req.Wait(timeout=60)
    assert stream.synchronize(timeout=60)
    assert np.all(x == n * (n + 1) / 2)
    assert np.array_equal(y, np.arange(77, dtype=np.int32) * n)
    comm.Free()


def test_free_destroys_the_internal_stream(bound):
    comm, stream = bound
    x = np.ones(10)
    comm.Iallreduce(DeviceArray(x), algorithm="ht_ring").Wait(timeout=60)
    assert stream.synchronize(timeout=60)
    before = threads()
    comm.Free()                               # joins the internal stream's worker thread
    assert threads() == before - 1
    assert np.all(x == comm.size)


def test_blocking_failure_is_raised_at_the_next_gpu_op(bound, monkeypatch):
    """A blocking host-transfer op returns while its stream is busy and counts as pending until
    its host part ends; one whose host part misses AL_HANG_TIMEOUT (every rank's stream is busy
    for longer) is abandoned, its failure is raised once, by the next GPU op, which then does
    not run; the communicator keeps working."""
    comm, stream = bound
    monkeypatch.setattr(config, "_hang_timeout", None)      # no deadline: pending until opened
    gate = hold(stream)
    x = np.ones(16)
    comm.Allreduce(DeviceArray(x), algorithm="ht_ring")   # returns: the host is not blocked
    assert comm._state.pending == 1
    gate[0] = 1
    wait_until(lambda: comm._state.pending == 0)
    assert stream.synchronize(timeout=60)
    assert np.all(x == comm.size)
    monkeypatch.setattr(config, "_hang_timeout", 0.5)
    gate = hold(stream)                                # busy until the test opens it
    comm.Allreduce(DeviceArray(np.ones(16)), algorithm="ht_ring")
    wait_until(lambda: comm._state.pending == 0)    # abandoned at its deadline
    gate[0] = 1
    monkeypatch.setattr(config, "_hang_timeout", None)
    y = np.ones(16)
    with pytest.raises(al.TimeoutError, match=r"^allreduce/ht_ring: host part not complete "
                                              r"after 0\.5 s \(AL_HANG_TIMEOUT"):
        comm.Allreduce(DeviceArray(y), algorithm="ht_ring")
    assert np.all(y == 1)
    comm.Allreduce(DeviceArray(y), algorithm="ht_ring")   # reported once; still works
    assert stream.synchronize(timeout=60)
    assert np.all(y == comm.size)
    comm.Free()


def test_unreported_failure_is_raised_by_free(bound, monkeypatch):
    """Free waits for the blocking op's host part (abandoned at AL_HANG_TIMEOUT: the stream is
    held meanwhile), frees everything, then raises its failure."""
    comm, stream = bound
    monkeypatch.setattr(config, "_hang_timeout", 0.2)
    gate = hold(stream)
    comm.Allreduce(DeviceArray(np.ones(4)), algorithm="ht_recursive_doubling")
    try:
        with pytest.raises(al.TimeoutError, match="allreduce/ht_recursive_doubling: host part"):
            comm.Free()
    finally:
        gate[0] = 1
    assert stream.synchronize(timeout=60)
    comm.Free()                                        # freed all the same: a no-op now
    with pytest.raises(al.Error, match="freed"):
        comm.Allreduce(np.ones(4))


def test_gpu_request_wait_timeout_and_host_failure(bound, monkeypatch):
    comm, stream = bound
    gate = hold(stream)                               # busy until the test opens it
    x = np.full(100, 1.0)
    req = comm.Iallreduce(DeviceArray(x), algorithm="ht_recursive_doubling")
    assert comm._state.pending == 1                   # counted until its host part is done
    with pytest.raises(al.Error, match="Free: 1 operations are still pending"):
        comm.Free()
    req.Wait()                # no timeout: returns although the op cannot run (the host does not block)
    assert not req.Test()
    with pytest.raises(al.TimeoutError, match="not complete after 0.05 s"):
        req.Wait(timeout=0.05)                         # the host part is still waiting
    assert comm._state.pending == 1
    gate[0] = 1
    req.Wait(timeout=60)
    assert req.Test()
    assert stream.synchronize(timeout=60)
    assert np.all(x == comm.size)

    monkeypatch.setattr(config, "_hang_timeout", 0.2)
    gate = hold(stream)                                # until its host part has failed
    req = comm.Iallreduce(DeviceArray(np.ones(8)), algorithm="ht_ring")
    monkeypatch.setattr(config, "_hang_timeout", None)
    with pytest.raises(al.TimeoutError, match="AL_HANG_TIMEOUT"):
        req.Wait(timeout=60)                           # its own host part failed
    with pytest.raises(al.TimeoutError, match="AL_HANG_TIMEOUT"):
        req.Test()
    gate[0] = 1
    assert stream.synchronize(timeout=60)
    comm.Free()


def test_control_traffic_does_not_interleave_with_engine_collectives(bound):
    """Rank 0's stream is held, so its engine holds an ht_mpi op and, behind it, an MPI
    Iallreduce; the other ranks start both at once. The first "auto" GPU decision then
    broadcasts the tuning data from the calling thread: on the collective communicator rank 0
    would issue that bcast before its two held collectives and the others after theirs.
    On the private control communicator the order cannot mix. (MPICH's default bcast tolerates
    the mixed order; tests/test_mpi_suite.py runs this test with MPICH's bcast as a nonblocking
    schedule, which hangs on the collective communicator.)"""
    comm, stream = bound
    if comm.size < 2:
        pytest.skip("needs two ranks")
    gate = hold(stream) if comm.rank == 0 else np.ones(1, np.uint32)
    x = np.full(100, 1.0)
    y = np.full(100, float(comm.rank + 1))
    comm.Allreduce(DeviceArray(x), algorithm="ht_mpi")
    req = comm.Iallreduce(y, algorithm="mpi")
    try:
        choice = comm._gpu.choose("auto", 4096, 4)             # collective: tuning data from rank 0
    finally:
        gate[0] = 1                                            # rank 0's held ops go on
    assert choice in al.algorithms("allreduce", "cuda") or choice == "ht_auto"
    req.Wait(timeout=60)
    assert stream.synchronize(timeout=60)
    assert np.all(x == comm.size)
    assert np.all(y == sum(range(1, comm.size + 1)))
    ctl = comm._gpu.control_comm()
    assert ctl.Get_size() == comm.size and ctl != comm.mpi_comm
    comm.Free()
    assert comm._gpu._ctl is None


def test_abandoned_op_keeps_its_buffers_alive(bound, monkeypatch):
    """The engine abandons a host part at AL_HANG_TIMEOUT while its stream still has copies
    queued into the op's buffers: once its failure is reported, the op (and so its buffers) is
    retained, so the late copies cannot land in memory reused by something else."""
    import gc
    import weakref

    from aluminum_py import gpu
    comm, stream = bound
    monkeypatch.setattr(config, "_hang_timeout", 0.2)
    gate = hold(stream)                                   # until the test has checked
    a, b = np.full(4, 7.0), np.zeros(4)
    wa, wb = weakref.ref(a), weakref.ref(b)
    comm.Allreduce(DeviceArray(a), DeviceArray(b), algorithm="ht_ring")
    del a, b
    wait_until(lambda: comm._state.pending == 0)
    monkeypatch.setattr(config, "_hang_timeout", None)
    with pytest.raises(al.TimeoutError, match="AL_HANG_TIMEOUT"):
        comm.Allreduce(DeviceArray(np.ones(4)), algorithm="ht_ring")
    gc.collect()
    assert wa() is not None and wb() is not None          # retained with the abandoned op
    assert any(r._op.error is not None for r in gpu._ABANDONED)
    gate[0] = 1
    assert stream.synchronize(timeout=60)
    comm.Free()


def test_nonblocking_failure_after_an_early_wait_is_raised_at_the_next_gpu_op(bound, monkeypatch):
    """req.Wait() right after the call does not block: it raises the host part's failure only
    if the engine has already abandoned it (a machine busy past the deadline), else the next
    GPU op raises it, before it communicates; either way the failure is raised once."""
    comm, stream = bound
    monkeypatch.setattr(config, "_hang_timeout", 0.2)
    gate = hold(stream)
    req = comm.Iallreduce(DeviceArray(np.ones(8)), algorithm="ht_ring")
    raised = {}
    try:
        req.Wait()                                      # returns at once
    except al.TimeoutError as e:
        raised["Wait"] = e
    wait_until(lambda: comm._state.pending == 0)        # abandoned
    gate[0] = 1
    monkeypatch.setattr(config, "_hang_timeout", None)
    y = np.ones(8)
    if not raised:                  # ranks differ here only in which call reports the failure
        try:
            comm.Allreduce(DeviceArray(y), algorithm="ht_ring")   # raises; does not run
        except al.TimeoutError as e:
            raised["Allreduce"] = e
    assert len(raised) == 1 and "AL_HANG_TIMEOUT" in str(*raised.values()), raised
    assert np.all(y == 1)
    comm.Allreduce(DeviceArray(y), algorithm="ht_ring")     # reported once; works again
    assert stream.synchronize(timeout=60)
    assert np.all(y == comm.size)
    comm.Free()


class GpuGrad(np.ndarray):
    """A numpy array that is also a GPU buffer (reshaped views stay one), as gradients."""

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str,
                "data": (self.ctypes.data, False), "strides": None, "version": 3}


def test_gradient_synchronizer_with_gpu_gradients(bound):
    """GradientSynchronizer over GPU gradients: wait() returns (its all-reduces are GpuRequests,
    which complete on the stream: no host timings) and the stream then holds the average."""
    from conftest import all_ranks_ok, gather_all
    from aluminum_py.overlap import GradientSynchronizer
    comm, stream = bound
    host = [np.arange(n, dtype=np.float64) * (comm.rank + 1) for n in (10, 300, 7)]
    grads = [h.copy().view(GpuGrad) for h in host]
    sync = GradientSynchronizer(comm, grads, policy="none", algorithm="ht_ring")
    ok = True
    try:
        for i in reversed(range(len(grads))):
            sync.grad_ready(i)
        info = sync.wait()
        ok = info.timings == [] and stream.synchronize(timeout=60)
    except AttributeError:
        ok = False
    assert stream.synchronize(timeout=60)
    expected = [gather_all(h).sum(axis=0) / comm.size for h in host]
    ok = ok and all(np.array_equal(np.asarray(g), e) for g, e in zip(grads, expected))
    assert all_ranks_ok(ok)
    comm.Free()


# ---------------------------------------------------------------- the strict CPU device
@pytest.fixture
def strict():
    """A communicator bound to a stream of a fresh strict CPU device (pinned alloc/free wait
    for every stream, as CUDA's do), and the device."""
    device = ht.CpuDevice(strict=True)
    comm = al.Communicator()
    stream = device.stream()
    ht.bind(comm, device, stream)
    yield comm, stream, device
    stream.destroy()


@pytest.mark.local
def test_strict_device_reports_its_mode():
    assert ht.CpuDevice(strict=True).strict and not ht.CpuDevice().strict
    assert ht.CpuDevice(strict=True, queues=2).queues == 2
    with pytest.raises(ValueError, match="strict"):
        ht.CpuDevice(queues=2)
    with pytest.raises(ValueError, match="queues"):
        ht.CpuDevice(strict=True, queues=-1)
    with pytest.raises(TypeError):
        ht.CpuDevice(True, 2, 3)                        # no silently ignored arguments


@pytest.mark.local
def test_strict_device_synchronize_waits_for_a_blocked_stream():
    """What made the engine-thread free a deadlock on CUDA: a synchronizing call (here the
    device synchronize that pinned alloc/free imply) waits for a stream blocked on a flag,
    until the flag is written."""
    import threading
    device = ht.CpuDevice(strict=True)
    stream = device.stream()
    flag = np.zeros(1, dtype=np.uint32)
    stream.wait_value32(addr(flag), 1)       # the stream blocks until flag >= 1
    done = threading.Event()
    t = threading.Thread(target=lambda: (device.synchronize(), done.set()), daemon=True)
    t.start()
    assert not done.wait(0.5)                          # still waiting on the blocked stream
    flag[0] = 1
    assert done.wait(10)
    assert device.strict_stats()["sync_waits"] >= 1
    stream.destroy()


@pytest.mark.local
def test_strict_device_calls_wait_for_a_thread_inside_a_synchronize():
    """The strict device's driver lock: while one thread waits inside a synchronizing call,
    another thread's device calls (here an event query) wait too, as CUDA's may."""
    import threading
    device = ht.CpuDevice(strict=True)
    stream = device.stream()
    ev = device.event_create()
    flag = np.zeros(1, dtype=np.uint32)
    stream.wait_value32(addr(flag), 1)
    syncing = threading.Thread(target=device.synchronize, daemon=True)
    syncing.start()
    wait_until(lambda: device.strict_stats()["sync_waits"] >= 1)
    queried = threading.Event()
    t = threading.Thread(target=lambda: (device.event_query(ev), queried.set()), daemon=True)
    t.start()
    assert not queried.wait(0.5)                      # held up by the synchronize
    flag[0] = 1
    assert queried.wait(10)
    syncing.join(10)
    device.event_destroy(ev)
    stream.destroy()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("algorithm", ["ht_mpi", "ht_recursive_doubling", "ht_ring"])
def test_synchronizing_call_right_after_ht_ops_on_the_strict_device(strict, algorithm):
    """Regression (the 2-rank GPU run, 2026-11-22): a blocking and a nonblocking host-transfer
    allreduce, then at once a call that waits inside the driver for the stream (CuPy's
    asnumpy into pageable memory; here the device synchronize). Had the engine polled CUDA
    events, its query would wait for that thread, which waits for the stream, which waits
    for the flag only the engine writes: a deadlock. The engine polls words the stream
    writes instead, and the synchronize returns."""
    import threading
    comm, stream, device = strict
    n = comm.size
    for step in range(5):
        x = np.full(7, comm.rank + 1.0 + step)
        y = np.arange(5, dtype=np.int64) + comm.rank + step
        comm.Allreduce(DeviceArray(x), algorithm=algorithm)
        comm.Iallreduce(DeviceArray(y), algorithm=algorithm).Wait()
        synced = threading.Event()
        threading.Thread(target=lambda: (device.synchronize(), synced.set()), daemon=True).start()
        assert synced.wait(30), f"step {step}: the synchronize never returned (deadlock)"
        assert np.all(x == sum(r + 1.0 + step for r in range(n)))
        assert np.array_equal(y, n * np.arange(5, dtype=np.int64) + sum(range(n)) + n * step)
    comm._gpu.check()
    comm.Free()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["ht_ring", "ht_recursive_doubling", "ht_mpi"])
def test_blocking_then_nonblocking_ht_on_the_strict_device(strict, algorithm):
    """Regression (pinned free on the engine thread): a blocking host-transfer allreduce, then
    a nonblocking one. The second op's stream waits on its flag while the engine finishes the
    first; had the engine freed the first op's pinned buffer (an implicit device
    synchronize), it would wait for that stream, which waits for the engine: a deadlock,
    caught here by the timeouts. With the pool, buffers go back to it and are reused."""
    comm, stream, device = strict
    n = comm.size
    for step in range(3):
        x = np.full(1 << 14, comm.rank + 1.0 + step)
        y = np.arange(1000, dtype=np.int64) + comm.rank + step
        comm.Allreduce(DeviceArray(x), algorithm=algorithm)
        req = comm.Iallreduce(DeviceArray(y), algorithm=algorithm)
        req.Wait(timeout=30)
        assert stream.synchronize(timeout=30)
        assert np.all(x == sum(r + 1.0 + step for r in range(n)))
        assert np.array_equal(y, n * np.arange(1000, dtype=np.int64) + sum(range(n)) + n * step)
    comm._gpu.check()                                # every op completed: none left taken
    assert device.pinned_stats()["taken"] == 0
    assert device.pinned_stats()["reuses"] >= 3     # later steps reuse the pooled buffers
    assert device.strict_stats()["pinned_live"] == device.pinned_stats()["allocs"]
    comm.Free()                                      # no op in flight: the pool is released
    assert device.strict_stats()["pinned_live"] == 0
    assert [k for k, _, _ in device.trace()].count("free") == device.pinned_stats()["allocs"]


@pytest.mark.timeout(90)
def test_streams_per_communicator_are_bounded_with_shared_hardware_queues():
    """Every stream of the device on one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1): a
    stream blocked on a flag stalls the others. Interleaved blocking and nonblocking
    host-transfer ops on one communicator still complete, because the library uses one
    internal stream per communicator whatever the number of ops, and the engine runs a
    communicator's host parts in the order they were enqueued."""
    device = ht.CpuDevice(strict=True, queues=1)
    comm = al.Communicator()
    stream = device.stream()
    ht.bind(comm, device, stream)
    xs, reqs = [], []
    for i in range(16):
        x = np.full(100 + i, comm.rank + i, dtype=np.int64)
        xs.append(x)
        if i % 2:
            reqs.append(comm.Iallreduce(DeviceArray(x), algorithm="ht_ring"))
        else:
            comm.Allreduce(DeviceArray(x), algorithm="ht_recursive_doubling")
    al.Waitall(reqs, timeout=60)
    assert stream.synchronize(timeout=60)
    for i, x in enumerate(xs):
        assert np.all(x == sum(r + i for r in range(comm.size))), i
    assert device.strict_stats()["streams"] == 2      # the bound stream + one internal stream
    comm.Free()
    stream.destroy()


class ReadOnlyDeviceArray(DeviceArray):
    def __init__(self, a: np.ndarray):
        super().__init__(a)
        self.__cuda_array_interface__ = dict(self.__cuda_array_interface__, data=(a.ctypes.data, True))


def test_gpu_collectives_check_their_buffers_before_nccl(bound):
    """Checks that run before anything is enqueued, on every rank alike: in-place operations
    write sendbuf (read-only: ValueError); in-place Allgather needs a length divisible by the
    size; Sendrecv needs separate buffers; partial overlap is refused."""
    comm, stream = bound
    p = comm.size
    ro = ReadOnlyDeviceArray(np.ones(4 * p, np.float32))
    with pytest.raises(ValueError, match="read-only"):
        comm.Reduce_scatter(ro)
    with pytest.raises(ValueError, match="read-only"):
        comm.Allgather(ro)
    if p > 1:
        with pytest.raises(ValueError, match="not divisible"):
            comm.Allgather(DeviceArray(np.ones(4 * p + 1, np.float32)))
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="separate send and receive"):
        comm.Sendrecv(DeviceArray(x), (comm.rank + 1) % p, None, (comm.rank - 1) % p)
    with pytest.raises(ValueError, match="overlap partially"):
        comm.Allgather(DeviceArray(x[:5]), DeviceArray(x[2:]))
    assert np.all(x == 1)


def test_gpu_reduce_reads_recvbuf_at_root_only(bound):
    """A non-root rank's recvbuf is not read (too short and read-only here): every rank gets
    the same outcome, here NCCL's own failure without a GPU, never a ValueError on some ranks
    only (which would leave the others waiting in NCCL)."""
    comm, stream = bound
    x = DeviceArray(np.ones(8, np.float32))
    recv = DeviceArray(np.zeros(8, np.float32)) if comm.rank == 0 else \
        ReadOnlyDeviceArray(np.zeros(1, np.float32))
    with pytest.raises((al.NcclError, al.UnavailableError)):
        comm.Reduce(x, recv, root=0)


def test_shm_collectives_refuse_gpu_buffers(bound):
    """algorithm="shm" of Allgather/Bcast/Reduce_scatter is for host buffers: a GPU buffer
    raises ValueError before anything runs (GPU buffers take only "mpi")."""
    comm, _ = bound
    x = DeviceArray(np.ones(comm.size, np.float32))
    r = DeviceArray(np.ones(comm.size * comm.size, np.float32))
    for call in (lambda: comm.Allgather(x, r, algorithm="shm"),
                 lambda: comm.Ibcast(x, algorithm="shm"),
                 lambda: comm.Reduce_scatter(x, algorithm="shm")):
        with pytest.raises(ValueError, match="'shm' is for host buffers; .* is a GPU buffer"):
            call()
    assert comm._state.pending == 0


# ---------------------------------------------------------------- issue 29: v-collectives
def _v_bad_cases(p: int, me: int):
    """name -> (method, args builder, exception, match): bad calls of the GPU backend's
    v-collectives, refused before anything is enqueued (and so before NCCL, which this CPU
    device does not have). Every rank gets the same error: the rooted calls use root=me, so
    every rank checks what a root checks."""
    def f(n, dt=np.float32):
        return np.full(n, 3, dt)
    ones = [1] * p
    neg = ones[:-1] + [-1]
    i32, i16 = np.int32, np.int16
    rs, ag, at = "reduce_scatterv", "allgatherv", "alltoallv"
    cases = {
        "allgatherv-negative-count": (ag, lambda: (f(1), f(p), neg, None), ValueError,
                                      r"^recvbuf counts: counts of rank \d+ is negative"),
        "allgatherv-counts-per-rank": (ag, lambda: (f(1), f(p + 1), ones + [1], None),
                                       ValueError, "one per rank needed"),
        "allgatherv-block-past-end": (ag, lambda: (f(1), f(p), ones, [0] * (p - 1) + [p]),
                                      ValueError, r"^recvbuf: the block of rank .* past the"),
        "allgatherv-sendbuf-count": (ag, lambda: (f(2), f(p), ones, None), ValueError,
                                     r"^sendbuf has 2 elements but recvcounts\[\d+\] is 1"),
        "allgatherv-dtype": (ag, lambda: (f(1, np.float64), f(p), ones, None), TypeError,
                             "dtype"),
        "allgatherv-readonly": (ag, lambda: (f(1), ReadOnly(f(p)), ones, None), ValueError,
                                "read-only"),
        "allgatherv-aliased": (ag, lambda: (Alias(0, 1), Alias(0, p), ones, None), ValueError,
                               "overlap; pass sendbuf=None"),
        "allgatherv-algorithm": (ag, lambda: (f(1), f(p), ones, None, "ring"), ValueError,
                                 r"^algorithm: 'ring' cannot run allgatherv on GPU"),
        "gatherv-recvbuf-short": ("gatherv", lambda: (f(1), f(p - 1), ones, None, me),
                                  ValueError, r"^recvbuf: the block of rank"),
        "gatherv-sendbuf-count": ("gatherv", lambda: (f(3), f(p), ones, None, me),
                                  ValueError, r"^sendbuf has 3 elements but recvcounts"),
        "scatterv-sendbuf-short": ("scatterv", lambda: (f(p - 1), f(1), ones, None, me),
                                   ValueError, r"^sendbuf: the block of rank"),
        "scatterv-recvbuf-count": ("scatterv", lambda: (f(p), f(3), ones, None, me),
                                   ValueError, r"^recvbuf has 3 elements but sendcounts"),
        "alltoallv-in-place": (at, lambda: (None, ones, None, f(p), ones, None), ValueError,
                               "no in-place form"),
        "alltoallv-self-count": (at, lambda: (f(p), ones, None, f(p + 1),
                                              [2 if j == me else 1 for j in range(p)], None),
                                 ValueError, r"sends itself 1 elements .* receives 2"),
        "alltoallv-send-past-end": (at, lambda: (f(p - 1), ones, None, f(p), ones, None),
                                    ValueError, r"^sendbuf: the block of rank"),
        "reduce_scatterv-sum": (rs, lambda: (f(p + 1), f(1), ones, al.SUM), ValueError,
                                r"^sendbuf has \d+ elements but the recvcounts add up"),
        "reduce_scatterv-recvbuf-short": (rs, lambda: (f(2 * p), f(1), [2] * p, al.SUM),
                                          ValueError,
                                          r"^recvbuf is too short: 1 elements, needs 2"),
        "reduce_scatterv-int-avg": (rs, lambda: (f(p, i32), f(1, i32), ones, al.AVG),
                                    TypeError, "op: AVG is not defined"),
        "reduce_scatterv-band": (rs, lambda: (f(p, i32), f(1, i32), ones, al.BAND),
                                 TypeError, "NCCL has no BAND"),
        "reduce_scatterv-int16": (rs, lambda: (f(p, i16), f(1, i16), ones, al.SUM),
                                  TypeError, "not an NCCL datatype"),
        "reduce_scatterv-readonly-in-place": (rs, lambda: (ReadOnly(f(p)), None, ones, al.SUM),
                                              ValueError, "read-only"),
        "reduce_scatterv-algorithm": (rs, lambda: (f(p), f(1), ones, al.SUM, "shm"),
                                      ValueError, r"^algorithm: 'shm' cannot run reduce_scatter"),
        "scan": ("scan", lambda: (f(4), f(4), al.SUM), al.UnavailableError,
                 r"^Scan on GPU buffers: NCCL has no prefix reduction"),
        "exscan": ("exscan", lambda: (f(4), None, al.MAX), al.UnavailableError,
                   r"^Exscan on GPU buffers: .* call Exscan on the host arrays"),
        "recv-any-source": ("recv", lambda: (f(4), ANY, 0), al.UnavailableError,
                            r"^source: GPU buffers go through NCCL, which cannot receive from "
                            r"ANY_SOURCE"),
        "sendrecv-any-source": ("sendrecv", lambda: (f(4), me, f(4), ANY, 0),
                                al.UnavailableError, "ANY_SOURCE"),
        "recv-tag": ("recv", lambda: (f(4), me, 5), ValueError, "^tag: .* no tags"),
    }
    if p > 1:
        cases["allgatherv-overlapping-blocks"] = (
            "allgatherv", lambda: (f(1), f(p), ones, [0] * p), ValueError, "overlap")
        cases["alltoallv-overlapping-recv"] = (
            "alltoallv", lambda: (f(p), ones, None, f(p), ones, [0] * p), ValueError, "overlap")
    return cases


ANY = object()      # MPI.ANY_SOURCE in a case's arguments


class ReadOnly:
    def __init__(self, a):
        self.a = a


class Alias:
    """Views of one shared array (start, length), for aliased-buffer cases."""
    base = np.full(64, 3, np.float32)

    def __init__(self, start, n):
        self.a = self.base[start:start + n]


def _as_device(v):
    from mpi4py import MPI
    if v is ANY:
        return MPI.ANY_SOURCE
    if isinstance(v, ReadOnly):
        return ReadOnlyDeviceArray(v.a)
    if isinstance(v, Alias):
        return DeviceArray(v.a)
    if isinstance(v, np.ndarray):
        return DeviceArray(v)
    return v


# without AL_CHECK nothing is communicated (local); with it the ranks agree first
@pytest.mark.parametrize("check", [pytest.param(False, id="", marks=pytest.mark.local),
                                   pytest.param(True, id="AL_CHECK")])
@pytest.mark.parametrize("case", sorted(_v_bad_cases(4, 0)))
def test_gpu_v_collectives_refuse_bad_input(bound, case, check, monkeypatch):
    """The GPU backend's v-collectives, Reduce_scatter with counts, Scan/Exscan and wildcard
    receives: a clear error naming the argument, on every rank, before anything is enqueued;
    the buffers are untouched and nothing is pending. With AL_CHECK the same (every rank
    refuses, so each raises its own error after the agreement)."""
    comm, stream = bound
    monkeypatch.setattr(comm._gpu, "_check", check)
    cases = _v_bad_cases(comm.size, comm.rank)
    if case not in cases:
        pytest.skip("needs two ranks")
    method, build, exc, match = cases[case]
    args, kw = build(), {}
    if isinstance(args[-1], str):
        args, kw = args[:-1], {"algorithm": args[-1]}
    arrays = [a.a if isinstance(a, (ReadOnly, Alias)) else a for a in args]
    before = [a.copy() for a in arrays if isinstance(a, np.ndarray)]
    with pytest.raises(exc, match=match):
        getattr(comm._gpu, method)(*[_as_device(a) for a in args], True, **kw)
    after = [a for a in arrays if isinstance(a, np.ndarray)]
    assert all(np.array_equal(a, b) for a, b in zip(after, before))
    assert comm._state.pending == 0
    assert stream.synchronize(timeout=60)


@pytest.mark.mpi(min_size=2)
def test_al_check_stops_v_collectives_whose_ranks_disagree(bound, monkeypatch):
    """AL_CHECK=1: the v-collectives agree over the control communicator before any NCCL call,
    so calls that NCCL could never match fail on every rank (al.Error naming the ranks) instead
    of hanging the streams: a rank whose sendbuf differs from the root's count, a root that
    refuses its arguments, Reduce_scatter counts that differ between ranks. Buffers untouched."""
    comm, stream = bound
    monkeypatch.setattr(comm._gpu, "_check", True)
    p, me, gpu = comm.size, comm.rank, comm._gpu
    last = p - 1
    x = np.full(3 if me == last else 1, 5.0, np.float32)       # the last rank sends 3, not 1
    y = np.zeros(p, np.float32)
    with pytest.raises(al.Error, match=rf"^gatherv: rank {last} sends 12 bytes to rank 0, which "
                                       rf"expects 4 from it \(AL_CHECK"):
        gpu.gatherv(DeviceArray(x), DeviceArray(y) if me == 0 else None, [1] * p, None, 0, True)
    short = np.zeros(p - 1, np.float32)
    x = np.ones(1, np.float32)
    if me == 0:
        with pytest.raises(ValueError, match="^recvbuf: the block of rank"):
            gpu.gatherv(DeviceArray(x), DeviceArray(short), [1] * p, None, 0, True)
    else:
        with pytest.raises(al.Error, match=r"^gatherv: rank 0 refused its arguments \(ValueError: "
                                           r"recvbuf: the block"):
            gpu.gatherv(DeviceArray(x), None, None, None, 0, True)
    counts = [1] * p if me else [2] + [1] * (p - 1)
    s = np.ones(sum(counts), np.float32)
    with pytest.raises(al.Error, match=r"^reduce_scatter: rank 1 calls with \(\(1, "):
        gpu.reduce_scatterv(DeviceArray(s), DeviceArray(np.zeros(2, np.float32)), counts, al.SUM,
                            True)
    assert np.all(y == 0) and np.all(short == 0) and np.all(s == 1)
    assert comm._state.pending == 0
