"""A host-transfer allreduce whose inner host algorithm is "shm" (what GPU auto runs on one node
without NCCL: the host auto picks shm), abandoned at the hang timeout on one rank, leaves the
segment's rounds out of step: the segment is marked unusable, the peers' waiting ops fail at
once (not at their own, later timeout), every later op over the segment fails on every rank
with an error naming why, and the other algorithms still work.  Run on the CPU device."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import config
from aluminum_py.testing.internals import shm_info
from aluminum_py import host_transfer as ht
from conftest import WORLD, all_ranks_ok, wait_for

pytestmark = pytest.mark.mpi

UNUSABLE = "shared-memory segment is unusable: rank 0 abandoned an op over it"


def test_abandoned_shm_host_part_makes_the_segment_unusable(tmp_path_factory, monkeypatch):
    if WORLD.size < 2:
        pytest.skip("needs a peer")
    monkeypatch.setenv("AL_TUNING_FILE", str(tmp_path_factory.mktemp("none") / "missing.json"))
    comm = al.Communicator()
    device = ht.CpuDevice()
    stream = device.stream()
    x = np.ones(256, np.float32)
    assert comm.explain(x.nbytes).algorithm == "shm"      # the host part ht_auto runs
    req = ht.allreduce(comm, device, stream, x, algorithm="ht_auto")
    req.Wait(timeout=60)
    assert req.algorithm == "ht_shm"
    assert stream.synchronize(timeout=60) and np.all(x == comm.size)
    problems = []
    # rank 0's stream is held until its host part is abandoned (after 0.3 s: it never starts);
    # the peers' host parts publish and wait for rank 0, with a timeout that is only a hang
    # guard: they must fail on rank 0's mark, a MPIError, never on their own TimeoutError
    # (every wait of this test is bounded, so that it fails rather than hangs without the mark)
    monkeypatch.setattr(config, "_hang_timeout", 0.3 if comm.rank == 0 else 60.0)
    gate = np.zeros(1, dtype=np.uint32)
    if comm.rank == 0:
        stream.wait_value32(al._core.addr(gate), 1)
    req = ht.allreduce(comm, device, stream, x, algorithm="ht_auto")
    if not wait_for(lambda: comm._state.pending == 0, 90.0):
        problems.append("the host part did not end")
    gate[0] = 1
    monkeypatch.setattr(config, "_hang_timeout", 30.0)
    if not stream.synchronize(timeout=60):
        problems.append("the stream was not released")
    info = shm_info(comm._state)
    if info["broken_by"] != 0:
        problems.append(f"shm_info: {info}")
    # rank 0: its own timeout; the peers: the mark rank 0 left, seen while they waited
    want = ((al.TimeoutError, "host part not complete after 0.3 s")
            if comm.rank == 0 else (al.MPIError, UNUSABLE))
    try:
        req.Wait(timeout=60)
        problems.append("no error for the abandoned op")
    except al.Error as e:
        if (type(e) is not want[0] or want[1] not in str(e)
                or (comm.rank == 0 and "segment is now unusable" not in str(e))):
            problems.append(f"host-transfer op: {e!r}")
    WORLD.Barrier()
    # every later op over the segment fails at once on every rank (al.MPIError naming why,
    # not a TimeoutError at the hang timeout), auto's choice too (unchanged: it must stay the
    # same on every rank)
    for call in (lambda: comm.Allreduce(np.ones(8, np.float32), algorithm="shm"),
                 lambda: comm.Allreduce(np.ones(8, np.float32)),
                 lambda: comm.Iallreduce(np.ones(8, np.float32)).Wait(timeout=60),
                 lambda: comm.Bcast(np.ones(8), algorithm="shm"),
                 lambda: comm.Barrier(algorithm="shm")):
        try:
            call()
            problems.append("an op over the broken segment ran")
        except al.Error as e:
            if type(e) is not al.MPIError or UNUSABLE not in str(e):
                problems.append(f"shm op: {e!r}")
    # the MPI-based algorithms are not affected
    y = np.full(1000, comm.rank + 1.0)
    comm.Allreduce(y, algorithm="ring")
    if not np.all(y == comm.size * (comm.size + 1) / 2):
        problems.append("ring after the abandon: wrong result")
    assert all_ranks_ok(not problems), problems
    comm.Free()
    stream.destroy()
