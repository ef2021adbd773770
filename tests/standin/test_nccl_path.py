"""The NCCL path on the stand-ins, checked through what reaches NCCL: the stand-in records
every launch (aluminum_py.testing.nccl_launches), so thread limits (max_ctas/min_ctas, the
cached split communicators), nonblocking communicators and NCCL's config checks are observed at
the NCCL call, next to results against gathered numpy. (A LIBRA plan's per-bucket limits are
checked the same way by tests/gpu/test_gpu.py::test_libra_plan_limits_each_bucket.)

Run by tests/test_mpi_suite.py::test_gpu_suite_on_standins, with the pytest plugin
aluminum_py.testing.pytest_standins (AL_CUDA_LIBRARY and AL_NCCL_LIBRARY name the stand-in,
``import cupy`` gives aluminum_py.testing.cupy_standin). The rest of the NCCL path (every
collective x op x dtype, blocking and nonblocking, nccl and auto) is tests/gpu, run the same
way."""

import numpy as np
import pytest
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import config, nccl
from aluminum_py.testing import cuda_standin as cs
from aluminum_py.testing import nccl_launches, reset_nccl_launches

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("standins")]
WORLD = MPI.COMM_WORLD




@pytest.fixture
def bound(standins):
    cp = standins
    stream = cp.cuda.Stream(non_blocking=True)
    comm = al.Communicator(stream=stream)
    reset_nccl_launches()
    yield comm, stream, cp
    stream.synchronize()
    comm.Free()


def summed(host):
    return np.sum(np.stack(WORLD.allgather(host)), axis=0)


def allreduces():
    return [l for l in nccl_launches() if l.coll == "AllReduce"]


def test_launch_records_what_was_called(bound):
    comm, stream, cp = bound
    host = np.arange(1000, dtype=np.float64) % 7 + comm.rank
    with stream:
        x = cp.asarray(host)
        comm.Allreduce(x, op=al.MAX, algorithm="nccl")
        comm.Bcast(x, root=comm.size - 1)
        out = cp.asnumpy(x, stream=stream)
    launches = nccl_launches()
    assert [l.coll for l in launches] == ["AllReduce", "Broadcast"]
    ar, bc = launches
    assert (ar.count, ar.dtype, ar.op, ar.root, ar.nranks, ar.rank) == \
        (1000, "float64", "max", None, comm.size, comm.rank)
    assert (bc.coll, bc.root, bc.op) == ("Broadcast", comm.size - 1, None)
    assert ar.stream == bc.stream == stream.ptr and ar.comm == bc.comm
    assert ar.min_ctas is None and ar.max_ctas is None and not ar.grouped
    np.testing.assert_array_equal(out, np.max(np.stack(WORLD.allgather(host)), axis=0))


@pytest.mark.parametrize("min_ctas,max_ctas", [(None, 1), (None, 8), (2, 4), (3, None)])
def test_cta_limits_reach_the_launch(bound, min_ctas, max_ctas):
    """min_ctas/max_ctas become the split communicator's ncclConfig_t, and every launch on it
    carries them; the split is cached: a second call with the same limits reuses it (no new
    communicator), other limits make another one."""
    comm, stream, cp = bound
    host = np.arange(4096, dtype=np.float32) % 5 + comm.rank
    kw = {"min_ctas": min_ctas, "max_ctas": max_ctas}
    with stream:
        x, y = cp.asarray(host), cp.asarray(host)
        comm.Allreduce(x, algorithm="nccl", **kw)
        comm.Iallreduce(y, algorithm="nccl", **kw).Wait()
        comm.Allreduce(x, algorithm="nccl")                    # the base communicator
        out_x, out_y = cp.asnumpy(x, stream=stream), cp.asnumpy(y, stream=stream)
    first, second, base = allreduces()
    want_max = max_ctas if max_ctas is not None else max(min_ctas, nccl.MAX_CHANNELS)
    for l in (first, second):
        assert (l.min_ctas, l.max_ctas) == (min_ctas, want_max), l
    assert first.comm == second.comm != base.comm              # cached split, not the base
    assert (base.min_ctas, base.max_ctas) == (None, None)
    assert second.stream != first.stream                       # the I-call's internal stream
    exp = summed(host)
    np.testing.assert_array_equal(out_y, exp)
    np.testing.assert_array_equal(out_x, exp * comm.size)


def test_pool_makes_one_communicator_per_limit(bound):
    comm, stream, cp = bound
    with stream:
        x = cp.ones(100, dtype=cp.float32)
        for m in (2, 4, 2, 4, 2):
            comm.Allreduce(x, algorithm="nccl", max_ctas=m)
        out = cp.asnumpy(x, stream=stream)
    by_limit = {}
    for l in allreduces():
        by_limit.setdefault(l.max_ctas, set()).add(l.comm)
    assert {k: len(v) for k, v in by_limit.items()} == {2: 1, 4: 1}
    assert len(comm._gpu._nccl_pool) == 2
    assert np.all(out == comm.size ** 5)


def test_environment_limits_apply_to_every_nccl_call(bound, monkeypatch):
    comm, stream, cp = bound
    monkeypatch.setenv("AL_NCCL_MAX_CTAS", "3")
    with stream:
        x = cp.ones(10, dtype=cp.float32)
        comm.Allreduce(x, algorithm="nccl")
        comm.Allreduce(x, algorithm="auto")
    assert [l.max_ctas for l in allreduces()] == [3, 3]


def test_nonblocking_communicator_settles_every_call(bound, monkeypatch):
    """With AL_HANG_TIMEOUT the NCCL communicators are nonblocking: creation, split and
    operations answer ncclInProgress (the stand-in holds it for a few queries) and are
    settled; ncclCommSplit answers ncclSuccess yet writes the child later, as NCCL 2.28 does."""
    comm, stream, cp = bound
    monkeypatch.setattr(config, "_hang_timeout", 30.0)
    host = np.arange(64, dtype=np.int32) + comm.rank
    with stream:
        x = cp.asarray(host)
        comm.Allreduce(x, algorithm="nccl")
        comm.Allreduce(x, algorithm="nccl", max_ctas=2)         # a nonblocking split
        with nccl.group():
            comm.Bcast(x, root=0)
        out = cp.asnumpy(x, stream=stream)
    assert comm._gpu._nccl_base.config["blocking"] is False
    assert comm._gpu._nccl_pool[(None, 2)].config["blocking"] is False
    assert [l.coll for l in nccl_launches()] == ["AllReduce", "AllReduce", "Broadcast"]
    assert nccl_launches()[-1].grouped
    np.testing.assert_array_equal(out, summed(host) * comm.size)


def test_a_communicator_that_never_settles_times_out(standins, monkeypatch):
    """AL_HANG_TIMEOUT bounds the wait for a nonblocking communicator: one whose creation
    never settles (a peer that never joins) raises al.TimeoutError, on every rank."""
    cp = standins
    monkeypatch.setattr(config, "_hang_timeout", 1.0)
    stream = cp.cuda.Stream(non_blocking=True)
    comm = al.Communicator(stream=stream)
    cs.nccl_stall(True)
    try:
        with stream:
            x = cp.ones(8, dtype=cp.float32)
            with pytest.raises(al.TimeoutError, match="still in progress"):
                comm.Allreduce(x, algorithm="nccl")
    finally:
        cs.nccl_stall(False)
    WORLD.Barrier()
    comm.Free()


def test_config_checks_are_ncclinvalidargument(standins):
    """NCCL's own config checks, met through the binding (the Python layer normally catches
    these first): minCTAs with maxCTAs unset, minCTAs > maxCTAs, blocking not 0/1."""
    from aluminum_py import _nccl
    uid = nccl.get_unique_id()
    for kw in ({"min_ctas": 4}, {"min_ctas": 8, "max_ctas": 2}, {"blocking": 1}):
        fields = _nccl.config_fields(**{k: v for k, v in kw.items() if k != "blocking"})
        assert fields["minCTAs"] == kw.get("min_ctas", fields["minCTAs"])
    with pytest.raises(al.NcclError, match="ncclInvalidArgument.*min/max channels"):
        _nccl.comm_init_rank(1, uid, 0, min_ctas=4)
    with pytest.raises(al.NcclError, match="ncclInvalidArgument"):
        _nccl.comm_init_rank(1, uid, 0, min_ctas=8, max_ctas=2)
    with pytest.raises(ValueError, match="min_ctas"):
        nccl.NcclComm(1, uid, 0, min_ctas=8, max_ctas=2)       # caught before NCCL


def test_direct_nccl_communicator_over_mpi(standins):
    """aluminum_py.nccl on its own: a unique id broadcast over MPI, then NCCL calls on a
    stand-in stream; sums against numpy, and the communicator's queries."""
    cp = standins
    uid = WORLD.bcast(nccl.get_unique_id() if WORLD.rank == 0 else None, root=0)
    c = nccl.NcclComm(WORLD.size, uid, WORLD.rank)
    assert (c.count, c.user_rank, c.device) == (WORLD.size, WORLD.rank, 0)
    stream = cp.cuda.Stream(non_blocking=True)
    host = np.arange(10, dtype=np.float16) + WORLD.rank
    with stream:
        x = cp.asarray(host)
    stream.synchronize()
    c.allreduce(x.__cuda_array_interface__["data"][0], x.__cuda_array_interface__["data"][0],
                10, "float16", "avg", stream.ptr)
    out = cp.asnumpy(x, stream=stream)
    np.testing.assert_allclose(out.astype(np.float64),
                               np.mean(np.stack(WORLD.allgather(host)).astype(np.float64), axis=0),
                               atol=2 ** -8 * 12)
    c.destroy()
