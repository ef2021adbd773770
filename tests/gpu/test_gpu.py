"""GPU collectives against numpy, under mpiexec (one device per rank). Skips without a GPU."""
import numpy as np
import pytest

import aluminum_py as al

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
cp = pytest.importorskip("cupy")


@pytest.fixture(scope="module")
def comm():
    from mpi4py import MPI
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    cp.cuda.Device(local % cp.cuda.runtime.getDeviceCount()).use()
    stream = cp.cuda.Stream(non_blocking=True)
    return al.Communicator(stream=stream), stream


def expected_sum(comm, host):
    from mpi4py import MPI
    return np.sum(np.stack(MPI.COMM_WORLD.allgather(host)), axis=0)


@pytest.mark.parametrize("algorithm", ["nccl", "ht_mpi", "ht_recursive_doubling", "ht_rabenseifner",
                                       "ht_ring", "auto"])
@pytest.mark.parametrize("count", [1, 7, 1 << 20])
def test_allreduce_blocking_and_nonblocking(comm, algorithm, count):
    c, stream = comm
    host = np.arange(count, dtype=np.float32) % 17 + c.rank
    with stream:
        x = cp.asarray(host)
        c.Allreduce(x, algorithm=algorithm)
        y = cp.asarray(host)
        req = c.Iallreduce(y, algorithm=algorithm)
        req.Wait()
        out_x, out_y = cp.asnumpy(x, stream=stream), cp.asnumpy(y, stream=stream)
    stream.synchronize()
    exp = expected_sum(c, host)
    assert np.array_equal(out_x, exp) and np.array_equal(out_y, exp)


def test_max_ctas_pool(comm):
    c, stream = comm
    with stream:
        x = cp.ones(1 << 16, dtype=cp.float32)
        c.Allreduce(x, algorithm="nccl", max_ctas=2)
        c.Allreduce(x, algorithm="nccl", max_ctas=2)   # cached split communicator
        out = cp.asnumpy(x, stream=stream)
    stream.synchronize()
    assert np.all(out == c.size ** 2)


def test_other_collectives(comm):
    c, stream = comm
    with stream:
        b = cp.full(10, c.rank, dtype=cp.int32)
        c.Bcast(b, root=0)
        g = cp.empty(10 * c.size, dtype=cp.int32)
        c.Allgather(cp.full(10, c.rank, dtype=cp.int32), g)
        out_b, out_g = cp.asnumpy(b, stream=stream), cp.asnumpy(g, stream=stream)
    stream.synchronize()
    assert np.all(out_b == 0)
    assert np.array_equal(out_g, np.repeat(np.arange(c.size), 10))


def _fresh(stream=None):
    s = stream or cp.cuda.Stream(non_blocking=True)
    return al.Communicator(stream=s), s


def test_device_of_the_current_context(comm):
    from aluminum_py import gpu
    c, _ = comm
    assert al._core.cuda_current_device() == cp.cuda.Device().id == gpu.current_device()
    assert c._gpu.device.ordinal == cp.cuda.Device().id


def test_free_destroys_the_internal_stream_after_its_work():
    c, stream = _fresh()
    with stream:
        x = cp.ones(1 << 20, dtype=cp.float32)
        reqs = [c.Iallreduce(x, algorithm=a) for a in ("nccl", "ht_ring")]
        for r in reqs:
            r.Wait(timeout=60)
        out = cp.asnumpy(x, stream=stream)
    stream.synchronize()
    assert c._gpu._internal is not None
    c.Free()                                   # cuStreamDestroy after the last op on it
    assert c._gpu._internal is None and c._gpu._ctl is None
    assert np.all(out == c.size ** 2)


def test_nonblocking_nccl_communicator_under_hang_timeout(monkeypatch):
    from aluminum_py import config
    monkeypatch.setattr(config, "_hang_timeout", 60.0)
    c, stream = _fresh()
    with stream:
        x = cp.full(1000, 2.0, dtype=cp.float32)
        c.Allreduce(x, algorithm="nccl")
        c.Allreduce(x, algorithm="nccl", max_ctas=2)           # a nonblocking split too
        with al.nccl.group():
            pass
        out = cp.asnumpy(x, stream=stream)
    stream.synchronize()
    assert c._gpu._nccl_base.config["blocking"] is False
    assert np.all(out == 2.0 * c.size ** 2)
    c.Free()


def test_torch_bfloat16_through_dlpack():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    torch.cuda.set_device(cp.cuda.Device().id)
    s = torch.cuda.Stream()
    c = al.Communicator(stream=s)
    with torch.cuda.stream(s):
        x = torch.full((1000,), 1.5, dtype=torch.bfloat16, device="cuda")
        y = x.clone()
        c.Allreduce(x, algorithm="nccl")
        c.Allreduce(y, algorithm="ht_ring")
    s.synchronize()
    assert torch.all(x.float().cpu() == 1.5 * c.size) and torch.all(y.float().cpu() == 1.5 * c.size)
    c.Free()


@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_gradient_synchronizer_gpu(comm, policy):
    """GradientSynchronizer over CuPy gradients: every step's average equals numpy's; policy
    "auto" finishes tuning (device-synchronised step timings) and keeps one candidate."""
    from mpi4py import MPI
    from aluminum_py.overlap import GradientSynchronizer
    c, stream = comm
    shapes = [(300,), (64, 64), (7,), (1 << 16,)]
    with stream:
        grads = [cp.zeros(s, dtype=cp.float32) for s in shapes]
        opts = {"threshold": 1 << 14} if policy == "fixed" else {"tune_steps": (1, 2)}
        sync = GradientSynchronizer(c, grads, policy=policy, **opts)
        for step in range(12):
            host = [(np.arange(np.prod(s), dtype=np.float32).reshape(s) % 13) + c.rank + step
                    for s in shapes]
            for g, h in zip(grads, host):
                g.set(h, stream=stream)
            for i in reversed(range(len(grads))):
                sync.grad_ready(i)
            sync.wait()
            out = [cp.asnumpy(g, stream=stream) for g in grads]
            stream.synchronize()
            for o, h in zip(out, host):
                exp = np.sum(np.stack(MPI.COMM_WORLD.allgather(h)), axis=0) / c.size
                assert np.array_equal(o, exp)
    if policy == "auto":
        assert sync.chosen is not None
