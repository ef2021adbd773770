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
