"""Rules of the library's device calls on the CUDA driver stand-in (issue 28, GPU findings d and
f), under real MPI ranks:

* no device call holds the GIL while it may wait inside the driver: with the stand-in's driver
  lock (cuda_standin.driver_lock), a host-transfer allreduce enqueued while another thread
  waits in cuCtxSynchronize must not be reported (it was: the five enqueueing calls ran with
  the GIL held, e.g. from the DDP hook on torch's autograd thread);
* in a child process made by os.fork(), every GPU operation refuses before any CUDA or NCCL
  call (CUDA cannot be used in such a child).

Run by tests/test_mpi_suite.py::test_cuda_standin_suite with AL_CUDA_LIBRARY set."""
import os
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import nccl
from aluminum_py.testing import cuda_standin as cs

pytestmark = pytest.mark.mpi
WORLD = MPI.COMM_WORLD



@pytest.mark.timeout(120)
def test_host_transfer_enqueue_releases_the_gil_in_the_driver(bound):
    comm, stream = bound
    x = np.full(1000, comm.rank + 1.0, np.float32)
    buf = cs.HostBackedArray(x)
    comm.Allreduce(buf, algorithm="ht_ring")        # the pinned buffer is pooled from here on
    cs.stream_synchronize(stream)
    while comm._state.pending:      # until the engine is done with it: then no driver call of
        time.sleep(0.001)           # the engine's can be the lock wait counted below
    expected = WORLD.size * (WORLD.size + 1) / 2
    assert np.all(x == expected)
    x[:] = comm.rank + 1.0
    was = cs.load().standin_driver_lock_mode()
    cs.driver_lock(True)
    try:
        before = cs.driver_lock_violations()[0]
        busy = cs.stream_create(1)
        # a long kernel another thread waits for, until a call has waited for the driver lock
        cs.stream_hold(busy, cs.driver_lock_waits() + 1)

        def synchronize():
            cs.make_current(0)
            cs.load().cuCtxSynchronize()            # ctypes releases the GIL

        t = threading.Thread(target=synchronize)
        t.start()
        while not cs.driver_lock_held() and t.is_alive():
            pass
        held, waits = cs.driver_lock_held(), cs.driver_lock_waits()
        comm.Allreduce(buf, algorithm="ht_ring")    # enqueued while that thread is in the driver
        t.join()
        met = cs.driver_lock_waits() > waits        # the enqueue waited for the lock
        cs.stream_synchronize(stream)
        cs.stream_destroy(busy)
        after, message = cs.driver_lock_violations()
    finally:
        cs.driver_lock(bool(was))
    assert held, "the other thread never held the driver lock"
    assert met, "the allreduce made no call while the other thread held the driver lock"
    assert after == before, message
    assert np.all(x == expected)


@pytest.mark.timeout(120)
def test_gpu_ops_in_a_forked_child_make_no_cuda_call(bound):
    comm, stream = bound
    buf = cs.HostBackedArray(np.ones(8, np.float32))
    req = comm.Iallreduce(buf, algorithm="ht_ring")  # the backend exists; a request is pending
    req.Wait()
    cs.stream_synchronize(stream)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                     # the child: no MPI, no CUDA
        out = []
        try:
            cs.reset_counters()
            for what, call in (("Allreduce", lambda: comm.Allreduce(buf, algorithm="ht_ring")),
                               ("Bcast", lambda: comm.Bcast(buf)),
                               ("Wait", lambda: req.Wait()),
                               ("Test", lambda: req.Test()),
                               ("NcclComm", lambda: nccl.NcclComm(1, bytes(128), 0))):
                try:
                    call()
                    out.append(f"{what}: no error")
                except al.Error as e:
                    if "os.fork()" not in str(e):
                        out.append(f"{what}: {e!r}")
                except Exception as e:
                    out.append(f"{what}: {e!r}")
            made = {n: cs.calls(n) for n in cs._SIGNATURES if cs.calls(n) > 0}
            if made:
                out.append(f"driver calls in the child: {made}")
        except BaseException as e:
            out.append(repr(e))
        os.write(w, "\n".join(out).encode() or b"ok")
        os._exit(0)
    os.close(w)
    import select
    import signal
    ready, _, _ = select.select([r], [], [], 60)  # a child stuck in a lock: killed, reported
    if not ready:
        os.kill(pid, signal.SIGKILL)
    with os.fdopen(r) as f:
        report = f.read() if ready else "the child did not answer within 60 s (killed)"
    os.waitpid(pid, 0)
    assert report == "ok", report
