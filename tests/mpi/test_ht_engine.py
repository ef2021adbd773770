"""The progress engine's handling of host-transfer ops (issue 28, GPU findings a-c), on the CPU
device under real MPI ranks:

* a host-transfer op held back in the engine's start queue (behind an earlier op over the
  segment) is abandoned at its hang timeout while it waits there, with a message that says so,
  and its stream is released then (on a GPU it would sit in cuStreamWaitValue32);
* a host-transfer op waiting for its copy back after its inner "shm" op has finished is not
  counted as progress by the engine (which must back off while nothing moves);
* an abandoned host-transfer op whose inner op is "hierarchical" leaks its running phase's
  scratch (an already-matched receive may still write it) instead of returning it to the pool.
"""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import config
from aluminum_py import host_transfer as ht
from aluminum_py.testing.internals import (_waits_anew, addr, host_transfer_allreduce,
                                           scratch_stats, set_scratch_cache)
from conftest import WORLD, all_ranks_ok, wait_for

pytestmark = pytest.mark.mpi
# the tag of the messages (on MPI.COMM_WORLD, not the library's communicators) that hold the
# late ranks back until the early ones have given up on their op: a gate, not a sleep
GATE = 4242


@pytest.fixture
def no_table(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("AL_TUNING_FILE", str(tmp_path_factory.mktemp("none") / "missing.json"))


def test_queued_host_transfer_op_is_abandoned_at_its_deadline(no_table, monkeypatch):
    """Rank 0 starts a "shm" Iallreduce its peers join only once it has given up, then a
    host-transfer op whose host part is "shm" too: the engine holds that op back behind the first (one op over the
    segment at a time).  With AL_HANG_TIMEOUT=0.5 it must fail at about 0.5 s, saying that it
    never started, not when the first op ends; the segment is then unusable on every rank and
    every op ends in an error, no rank waits."""
    if WORLD.size < 2:
        pytest.skip("needs a peer")
    comm = al.Communicator()
    device = ht.CpuDevice()
    stream = device.stream()
    x = np.ones(256, np.float32)
    assert comm.explain(x.nbytes).algorithm == "shm"       # the host part ht_auto runs
    monkeypatch.setattr(config, "_hang_timeout", 0.5)
    problems = []
    WORLD.Barrier()
    if comm.rank != 0:
        WORLD.recv(source=0, tag=GATE)                 # until rank 0 has given up
    first = comm.Iallreduce(np.ones(64, np.float32), algorithm="shm")
    req = ht.allreduce(comm, device, stream, x, algorithm="ht_auto")
    if comm.rank == 0:
        if not wait_for(lambda: req.done, 120.0):      # a hang guard: it ends at 0.5 s
            problems.append("the queued op was not abandoned at its 0.5 s deadline")
        for r in range(1, WORLD.size):
            WORLD.send(None, dest=r, tag=GATE)
    try:
        req.Wait(timeout=30)
        problems.append("no error for the host-transfer op")
    except al.Error as e:
        if comm.rank == 0 and (type(e) is not al.TimeoutError
                               or "host part not complete after 0.5 s" not in str(e)
                               or "not started (queued behind an earlier op" not in str(e)
                               or "segment is now unusable" not in str(e)):
            problems.append(f"rank 0's host-transfer op: {e!r}")
    try:
        first.Wait(timeout=30)
        problems.append("the first op ran over a segment rank 0 gave up")
    except al.Error as e:
        if "segment is unusable: rank 0 abandoned" not in str(e):
            problems.append(f"the first op: {e!r}")
    if not stream.synchronize(timeout=30):
        problems.append("the stream was not released")
    assert all_ranks_ok(not problems), problems
    comm.Free()
    stream.destroy()


def test_a_finished_inner_shm_op_is_not_progress(no_table):
    """The engine counts a poll that published (an shm op began a new wait: its poll count is 1)
    as progress, so it does not back off then.  A host-transfer op whose inner "shm" op has
    finished waits for its copy back, and polling it publishes nothing, whatever poll count the
    inner op ended with (1 when its last wait took one poll, a timing accident).  Its state
    then differs from the completed op's only in the copied-back word, so the completed op is
    asked, with the inner op's count set to 1."""
    if WORLD.size < 2:
        pytest.skip("needs a peer")
    comm = al.Communicator()
    device = ht.CpuDevice()
    stream = device.stream()
    x = np.ones(4096, np.float32)
    req = ht.allreduce(comm, device, stream, x, algorithm="ht_auto")
    req.Wait(timeout=30)
    assert req.algorithm == "ht_shm" and stream.synchronize(timeout=30)
    counted = _waits_anew(req._op, inner_polls=1)
    assert all_ranks_ok(not counted), "a host-transfer op waiting for its copy back is progress"
    comm.Free()
    stream.destroy()


def test_abandoned_hierarchical_inner_op_leaks_its_scratch(no_table, monkeypatch):
    """Three ranks as two emulated nodes (0,0,1).  Rank 2 joins only once the others have given up, so rank 0 waits in
    the inter-node phase of a host-transfer op with a "hierarchical" host part, its receive
    posted into the phase's scratch, when the op is abandoned at 0.5 s.  The receive may have
    been matched already, so that scratch must not go back to the pool (the plain schedule's
    rule); it did, before."""
    if WORLD.size != 3:
        pytest.skip("a layout of two nodes with a node of two ranks: 3 ranks")
    monkeypatch.setenv("AL_NODE_LAYOUT", "0,0,1")
    comm = al.Communicator()
    device = ht.CpuDevice()
    stream = device.stream()
    x = np.ones(1 << 14, np.float32)
    launcher = comm._host.launcher
    problems = []

    code = al.ops.DTYPE_CODES[x.dtype][0]

    def start(timeout):
        return host_transfer_allreduce(launcher, device, stream.handle, addr(x), addr(x),
                                       x.size, code, x.itemsize, al.SUM.code, "hierarchical",
                                       (x,), timeout)

    op = start(-1.0)                                   # it works (and its plan is built)
    assert op.wait(30) and op.error is None, op.error
    assert stream.synchronize(timeout=30) and np.all(x == 3)
    x[:] = 1
    set_scratch_cache(0)                         # empty the pool, then let it cache again
    set_scratch_cache(256 << 20)
    WORLD.Barrier()
    others = [r for r in range(WORLD.size) if r != 2]
    if comm.rank == 2:
        for r in others:                               # until every other rank has given up
            WORLD.recv(source=r, tag=GATE)
    op = start(0.5)
    if not op.wait(30):
        problems.append("the host-transfer op did not end")
    if comm.rank != 2:
        WORLD.send(None, dest=2, tag=GATE)
    cached = scratch_stats()["cached"]
    if comm.rank == 0:
        if "hierarchical at phase 2" not in str(op.error):       # the inter-node phase
            problems.append(f"rank 0: {op.error!r}")
        if cached != 0:
            problems.append(f"{cached} bytes of the abandoned op's scratch went back to the pool")
    if not stream.synchronize(timeout=30):
        problems.append("the stream was not released")
    assert all_ranks_ok(not problems), problems
    comm.Free()
    stream.destroy()


def test_a_communicator_made_after_freeing_one_with_an_abandoned_op_gets_no_stale_message(
        no_table, monkeypatch):
    """Rank 0 abandons a host-transfer ring at 0.5 s (its peers join once it has given up and abandon theirs
    in turn, their sends to rank 0 never received).  Freeing that communicator must not let a
    new one receive those messages: MPI_Comm_free would release the context id for the next
    communicator, whose first ring has the same tag (it got rank 1's stale data: wrong sums)."""
    if WORLD.size < 2:
        pytest.skip("needs a peer")
    problems = []
    comm = al.Communicator()
    device = ht.CpuDevice()
    stream = device.stream()
    x = np.full(1000, 7.0, np.float32)
    monkeypatch.setattr(config, "_hang_timeout", 0.5)
    WORLD.Barrier()
    if comm.rank != 0:
        WORLD.recv(source=0, tag=GATE)                 # until rank 0 has given up
    req = ht.allreduce(comm, device, stream, x, algorithm="ht_ring")
    try:
        req.Wait(timeout=30)
    except al.Error:
        pass
    if comm.rank == 0:
        for r in range(1, WORLD.size):
            WORLD.send(None, dest=r, tag=GATE)
    if not stream.synchronize(timeout=30):
        problems.append("the stream was not released")
    monkeypatch.setattr(config, "_hang_timeout", 30.0)
    WORLD.Barrier()
    if not comm._state.abandoned:
        problems.append("the abandon was not recorded")
    comm.Free()
    fresh = al.Communicator()
    y = np.full(1000, comm.rank + 1.0, np.float32)
    fresh.Iallreduce(y, algorithm="ring").Wait(timeout=30)
    if not np.all(y == WORLD.size * (WORLD.size + 1) / 2):
        problems.append(f"a new communicator's ring: {y[:3]}")
    fresh.Free()
    stream.destroy()
    assert all_ranks_ok(not problems), problems
