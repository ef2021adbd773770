"""The CUDA implementation of the device interface (al_device.h's driver-API code, the code
that runs on a GPU) executed against the CUDA driver stand-in (aluminum_py.testing.cuda_standin)
under real MPI ranks. "Device memory" is host memory behind __cuda_array_interface__; streams
are the stand-in's worker threads, with CUDA's semantics: implicit synchronization of pinned
alloc/free, per-thread contexts, _v2 entry points, real error codes.

Run by tests/test_mpi_suite.py::test_cuda_standin_suite with AL_CUDA_LIBRARY set to the
stand-in (the library reads it when it first loads the driver)."""
import os
import threading

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import gpu
from aluminum_py.testing import cuda_standin as cs

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD
HT = ["ht_ring", "ht_recursive_doubling", "ht_rabenseifner", "ht_mpi"]


def lib():
    return cs.load()


def current_ctx() -> int:
    return lib().standin_current_ctx() or 0


def summed(host: np.ndarray) -> np.ndarray:
    return np.sum(np.stack(WORLD.allgather(host)), axis=0)


@pytest.fixture(scope="module", autouse=True)
def standin_is_loaded():
    assert os.environ.get("AL_CUDA_LIBRARY") == cs.path()
    assert gpu.cuda_device_count() >= 1



@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", HT)
def test_ht_allreduce_on_the_cuda_implementation(bound, algorithm):
    comm, stream = bound
    for count in (1, 7, 1001, 1 << 16):
        x = np.arange(count, dtype=np.float32) % 13 + comm.rank
        y = (np.arange(count, dtype=np.int64) % 5) * (comm.rank + 1)
        exp_x, exp_y = summed(x), summed(y)
        dx, dy = cs.HostBackedArray(x), cs.HostBackedArray(y)
        comm.Allreduce(dx, algorithm=algorithm)
        req = comm.Iallreduce(dy, algorithm=algorithm)
        req.Wait(timeout=60)
        cs.stream_synchronize(stream)
        assert np.array_equal(dx.get(), exp_x) and np.array_equal(dy.get(), exp_y)


@pytest.mark.timeout(120)
def test_blocking_then_nonblocking_does_not_deadlock_and_reuses_pinned_buffers(bound):
    """The stand-in's cuMemFreeHost/cuMemHostAlloc wait for every stream, as CUDA's do: a free
    on the engine thread while the nonblocking op's stream waits on its flag is a deadlock
    (the timeout fails the test). Pinned buffers come from the pool: after the first step no
    cuMemHostAlloc per op, and no cuMemFreeHost until Free."""
    comm, stream = bound
    L = lib()
    for step in range(4):
        if step == 1:
            allocs, frees = L.standin_calls(b"cuMemHostAlloc"), L.standin_calls(b"cuMemFreeHost")
        x = cs.HostBackedArray(np.full(1 << 14, comm.rank + 1.0 + step))
        y = cs.HostBackedArray(np.arange(1000, dtype=np.int32) + comm.rank)
        comm.Allreduce(x, algorithm="ht_ring")
        comm.Iallreduce(y, algorithm="ht_recursive_doubling").Wait(timeout=60)
        cs.stream_synchronize(stream)
        comm._gpu.check()
        n = comm.size
        assert np.all(x.get() == sum(r + 1.0 + step for r in range(n)))
        assert np.array_equal(y.get(), n * np.arange(1000, dtype=np.int32) + sum(range(n)))
    assert L.standin_calls(b"cuMemHostAlloc") == allocs      # the pool served every later op
    assert L.standin_calls(b"cuMemFreeHost") == frees
    assert comm._gpu.device.pinned_stats()["taken"] == 0


@pytest.mark.timeout(60)
def test_the_callers_context_is_neither_switched_nor_left_current():
    """On a thread with no current context, and on one where another context is current, the
    library's calls push and pop the device's context: the caller's current context is what it
    was before (cuCtxSetCurrent in every call used to leave the primary context current)."""
    results = {}

    def run():
        try:
            assert current_ctx() == 0
            comm = al.Communicator(stream=0)          # the legacy default stream
            x = cs.HostBackedArray(np.full(64, float(comm.rank)))
            comm.Allreduce(x, algorithm="ht_ring")
            comm.Iallreduce(x, algorithm="ht_ring").Wait(timeout=60)
            results["after"] = current_ctx()
            comm._gpu.device.synchronize()
            results["ok"] = bool(np.all(x.get() == 2 * sum(range(comm.size))))
            comm.Free()
        except BaseException as e:          # reported by the main thread
            results["error"] = repr(e)
    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert "error" not in results, results.get("error")
    assert results["after"] == 0 and results["ok"]


@pytest.mark.timeout(60)
def test_cuda_errors_carry_the_curesult_name_and_text():
    """A destroyed stream: the enqueue fails with CUDA_ERROR_INVALID_HANDLE, named in the
    exception with its number and text; nothing was submitted and the buffer is untouched."""
    cs.make_current(0)
    dead = cs.stream_create(1)
    cs.stream_destroy(dead)
    comm = al.Communicator(stream=dead)
    x = cs.HostBackedArray(np.ones(16, np.float32))
    with pytest.raises(al.Error, match=r"host-transfer allreduce: .*CUDA_ERROR_INVALID_HANDLE "
                                       r"\(CUresult 400\)"):
        comm.Allreduce(x, algorithm="ht_ring")
    with pytest.raises(al.Error, match=r"failed: CUDA_ERROR_INVALID_HANDLE \(CUresult 400\)"):
        comm.Iallreduce(x, algorithm="ht_ring")
    assert comm._state.pending == 0 and np.all(x.get() == 1)
    comm.Free()


def test_entry_points_are_resolved_by_their_exact_names():
    """The stand-in exports cuStreamWaitValue32 (v1: NOT_SUPPORTED), cuStreamWaitValue32_v2
    and an undocumented cuEventRecord_v2 (NOT_SUPPORTED): ops work only if the loader took
    cuStreamWaitValue32_v2 and the plain cuEventRecord, so the tests above prove the choice;
    here the stand-in's call counters show it directly."""
    L = lib()
    comm = al.Communicator(stream=0)
    x = cs.HostBackedArray(np.ones(8))
    comm.Iallreduce(x, algorithm="ht_ring").Wait(timeout=60)
    comm._gpu.device.synchronize()
    assert np.all(x.get() == comm.size)
    comm.Free()
    assert L.standin_calls(b"cuStreamWaitValue32_v2") > 0
    assert L.standin_calls(b"cuStreamWaitValue32") == 0
    assert L.standin_calls(b"cuEventRecord") > 0
    assert L.standin_calls(b"cuEventRecord_v2") == 0


def test_one_internal_stream_per_communicator(bound):
    comm, stream = bound
    L = lib()
    before = L.standin_live_streams()
    xs = [cs.HostBackedArray(np.full(100, float(i))) for i in range(12)]
    reqs = [comm.Iallreduce(x, algorithm=HT[i % 4]) for i, x in enumerate(xs)]
    al.Waitall(reqs, timeout=60)
    assert L.standin_live_streams() <= before + 1
    cs.stream_synchronize(stream)
    comm._gpu.device.synchronize()
    for i, x in enumerate(xs):
        assert np.all(x.get() == i * comm.size)
