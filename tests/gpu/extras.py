"""Checks of issue 28's GPU findings for a lent GPU machine, at 2 ranks sharing one GPU (each
rank its own NCCL_HOSTID, see tests/gpu/lent_machine.sh, step ``extras``).  Each check prints
one line on rank 0, ``PASS <check>: ...``, ``FAIL <check>: ...`` or ``SKIP <check>: why``:

* ``queued``: a host-transfer op (host part "shm") held back in the engine behind a "shm" op
  whose peer is 4 s late is abandoned at AL_HANG_TIMEOUT (1 s) while it waits, its stream
  released then, its failure naming why (finding a);
* ``abandon``: a host-transfer op whose peer joins 3 s late is abandoned at 1 s on both ranks,
  its stream released, its failure raised once; a new communicator then works;
* ``sigint``: SIGINT during ``GpuRequest.Wait(timeout=30)`` raises KeyboardInterrupt at once;
  the operation then completes with the right values and the communicator goes on working;
* ``timeline``: AL_TIMELINE-style recording (``al.timeline.start``) of NCCL, host-transfer and
  nonblocking GPU operations: the file passes aluminum_py.testing.trace_format and has them;
* ``ddp``: PyTorch DDP on ``cuda:0`` with ``aluminum_py.torch.allreduce_hook`` against gloo's
  DDP: equal parameters after the steps, and both step times.

The torch.distributed backend "aluminum" on CUDA tensors is checked by tests/gpu/torch_checks.py.

    mpiexec -n 1 -env NCCL_HOSTID a python3 tests/gpu/extras.py [checks] : \\
            -n 1 -env NCCL_HOSTID b python3 tests/gpu/extras.py [checks]

Runs on the CUDA, NCCL and CuPy stand-ins too (``-p``-less: ``--standins`` installs them), so
it can be debugged without a GPU; ``ddp`` needs torch with CUDA.  Exit status 0 when no check
failed.  Every wait is bounded: a hang is a FAIL line, then the process exits.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time

CHECKS = ("queued", "abandon", "sigint", "timeline", "ddp")
if "--standins" in sys.argv:
    sys.argv.remove("--standins")
    from aluminum_py.testing import pytest_standins  # noqa: F401  (sets the libraries, cupy)

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import aluminum_py as al  # noqa: E402
from aluminum_py import config  # noqa: E402
from torch_checks import chosen_checks, ddp_against, report  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK = WORLD.rank
_BROKEN: list = []      # communicators after an abandoned op: kept, never freed (check_abandon)


def synchronize(stream, seconds: float) -> bool:
    """stream.synchronize() on a helper thread; False if it has not returned within `seconds`
    (a stream left waiting on a flag)."""
    t = threading.Thread(target=stream.synchronize, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def hang_timeout(seconds: float | None):
    config._hang_timeout = seconds      # what AL_HANG_TIMEOUT sets (read at every call)


def fail_hard(check: str, why: str) -> None:
    print(f"FAIL {check}: rank {RANK}: {why} (exiting: a wait did not end)", flush=True)
    os._exit(3)


def check_queued() -> bool:
    problems = []
    stream = cp.cuda.Stream(non_blocking=True)
    comm = al.Communicator(stream=stream)
    host = np.ones(64, np.float32)
    with stream:
        x = cp.ones(256, dtype=cp.float32)
    if not synchronize(stream, 30):
        fail_hard("queued", "the stream did not finish its set-up work")
    if comm.explain(host.nbytes).algorithm != "shm":
        return report("queued", [], skip="host auto is not shm here")
    hang_timeout(1.0)
    WORLD.Barrier()
    if RANK != 0:
        time.sleep(4.0)
    t0 = time.monotonic()
    first = comm.Iallreduce(host, algorithm="shm")
    # GPU "auto" runs host transfer with the host "auto" inside (here "shm") where NCCL is
    # missing; with NCCL here, the backend's host-transfer entry point is called directly
    ptr = x.__cuda_array_interface__["data"][0]
    op = comm._gpu.host_transfer.allreduce(stream.ptr, ptr, ptr, x.size, al.ops.DTYPE_CODES[
        np.dtype(np.float32)][0], 4, al.SUM.code, "auto", (x,))
    released = synchronize(stream, 30)
    took = time.monotonic() - t0
    if not released:
        fail_hard("queued", "the stream was never released")
    if RANK == 0 and took > 3.0:
        problems.append(f"stream released after {took:.1f} s, not at the 1 s timeout")
    if not op.wait(30):
        fail_hard("queued", "the host part never ended")
    if RANK == 0 and "not started (queued behind an earlier op" not in str(op.error):
        problems.append(f"failure: {op.error}")
    elif RANK != 0 and op.error is None:
        problems.append("no failure")
    for r in (first,):
        try:
            r.Wait(timeout=30)
            problems.append("the shm op ran over a segment rank 0 gave up")
        except al.Error:
            pass
    hang_timeout(30.0)
    _BROKEN.append(comm)
    return report("queued", problems, f"rank 0's stream released {took:.2f} s after the call")


def check_abandon() -> bool:
    problems = []
    stream = cp.cuda.Stream(non_blocking=True)
    comm = al.Communicator(stream=stream)
    with stream:
        x = cp.ones(1000, dtype=cp.float32)
    if not synchronize(stream, 30):
        fail_hard("abandon", "the stream did not finish its set-up work")
    hang_timeout(1.0)
    WORLD.Barrier()
    if RANK != 0:
        time.sleep(3.0)
    t0 = time.monotonic()
    comm.Allreduce(x, algorithm="ht_ring")
    if not synchronize(stream, 30):
        fail_hard("abandon", "the stream was never released")
    took = time.monotonic() - t0
    if took > 2.5:
        problems.append(f"stream released after {took:.1f} s")
    raised = 0
    for _ in range(2):
        try:
            comm.Allreduce(cp.ones(4, dtype=cp.float32), algorithm="ht_ring")
        except al.TimeoutError as e:
            raised += 1
            if "host part not complete after 1 s (AL_HANG_TIMEOUT)" not in str(e):
                problems.append(f"failure: {e}")
        except al.Error:
            pass                                    # the ring out of step afterwards: its error
    if raised != 1:
        problems.append(f"the timeout was raised {raised} times, not once")
    hang_timeout(30.0)
    # not freed: a peer's send of the abandoned op may still wait in MPI, and a communicator
    # made after MPI_Comm_free could reuse the context id and match it (a wrong result)
    _BROKEN.append(comm)
    WORLD.Barrier()
    fresh = al.Communicator(stream=stream)           # a new communicator works
    with stream:
        y = cp.full(1000, RANK + 1.0, dtype=cp.float32)
        fresh.Allreduce(y, algorithm="ht_ring")
        got = cp.asnumpy(y)
    if not np.all(got == WORLD.size * (WORLD.size + 1) / 2):
        problems.append(f"a new communicator: wrong result {got[:3]}")
    fresh.Free()
    return report("abandon", problems, f"stream released {took:.2f} s after the call")


def check_sigint() -> bool:
    problems = []
    stream = cp.cuda.Stream(non_blocking=True)
    comm = al.Communicator(stream=stream)
    with stream:
        y = cp.full(1000, RANK + 1.0, dtype=cp.float32)
    if not synchronize(stream, 30):
        fail_hard("sigint", "the stream did not finish its set-up work")
    hang_timeout(None)
    WORLD.Barrier()
    if RANK != 0:
        time.sleep(3.0)
    req = comm.Iallreduce(y, algorithm="ht_ring")
    took = None
    if RANK == 0:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        t0 = time.monotonic()
        try:
            req.Wait(timeout=30)
            problems.append("Wait returned: no KeyboardInterrupt")
        except KeyboardInterrupt:
            took = time.monotonic() - t0
            if took > 2.0:
                problems.append(f"KeyboardInterrupt after {took:.1f} s")
        timer.join()
    try:
        req.Wait(timeout=30)                         # the op goes on and completes
        with stream:
            got = cp.asnumpy(y)
        if not np.all(got == WORLD.size * (WORLD.size + 1) / 2):
            problems.append(f"wrong result {got[:3]}")
        with stream:
            z = cp.full(10, 1.0, dtype=cp.float32)
            comm.Allreduce(z, algorithm="ht_ring")   # still usable
            if not np.all(cp.asnumpy(z) == WORLD.size):
                problems.append("the communicator is not usable afterwards")
    except al.Error as e:
        problems.append(f"after the interrupt: {e}")
    if not synchronize(stream, 30):
        fail_hard("sigint", "the stream was never released")
    comm.Free()
    return report("sigint", problems, f"KeyboardInterrupt {took:.2f} s into Wait"
                  if took is not None else "")


def check_timeline() -> bool:
    from aluminum_py import timeline
    from aluminum_py.testing import trace_format
    problems = []
    stream = cp.cuda.Stream(non_blocking=True)
    comm = al.Communicator(stream=stream)
    d = WORLD.bcast(tempfile.mkdtemp(prefix="al-extras-") if RANK == 0 else None, root=0)
    path = timeline.start(os.path.join(d, "gpu.json"), comm)
    with stream:
        x = cp.ones(1 << 16, dtype=cp.float32)
        comm.Allreduce(x, algorithm="nccl")
        comm.Allreduce(x, algorithm="ht_ring")
        comm.Iallreduce(x, algorithm="ht_rabenseifner").Wait(timeout=30)
        comm.Iallreduce(x, algorithm="nccl").Wait()
        comm.Bcast(x)
    if not synchronize(stream, 30):
        fail_hard("timeline", "the stream did not finish")
    time.sleep(0.3)                                  # the host parts end, the writer drains
    timeline.stop()
    comm.Free()
    with open(path) as f:
        trace = json.load(f)
    problems += trace_format.problems(trace)
    names = {e.get("name") for e in trace["traceEvents"] if e.get("ph") == "X"}
    for want in ("allreduce/nccl", "allreduce/ht_ring", "allreduce/ht_rabenseifner", "bcast"):
        if want not in names:
            problems.append(f"no {want} event (events: {sorted(n for n in names if n)})")
    return report("timeline", problems, f"{len(trace['traceEvents'])} events in {path}")


def check_ddp(steps: int = 8) -> bool:
    try:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        import aluminum_py.torch as alt
    except ImportError as e:
        return report("ddp", [], skip=str(e))
    if not torch.cuda.is_available():
        return report("ddp", [], skip="torch has no CUDA device")
    torch.cuda.set_device(0)
    d = WORLD.bcast(tempfile.mkdtemp(prefix="al-ddp-") if RANK == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"file://{d}/rendezvous", rank=RANK,
                            world_size=WORLD.size)
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10)).cuda()
    import copy
    models = {"gloo": DDP(copy.deepcopy(base), device_ids=[0]),
              "hook": DDP(copy.deepcopy(base), device_ids=[0])}
    models["hook"].register_comm_hook(None, alt.allreduce_hook)
    problems, summary = ddp_against(torch, "gloo", models, steps)
    dist.destroy_process_group()
    return report("ddp", problems, summary)


def main() -> int:
    chosen = chosen_checks(CHECKS)
    if chosen is None:
        return 2
    cp.cuda.Device(0).use()
    ok = True
    for name in chosen:
        ok = globals()[f"check_{name}"]() and ok
        WORLD.Barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
