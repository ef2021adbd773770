"""mpi4py's in-place idiom on GPU buffers: ``MPI.IN_PLACE`` as sendbuf runs Allreduce,
Allgather, block Reduce_scatter and Reduce_scatter with counts in place with the data in
recvbuf, as the host forms do; results against numpy built from every rank's inputs.  Skips
without a GPU or CuPy (tests/gpu/conftest.py); runs on the CUDA, NCCL and CuPy stand-ins with
``-p aluminum_py.testing.pytest_standins`` (tests/test_mpi_suite.py::test_gpu_suite_on_standins)."""
import numpy as np
import pytest
from mpi4py import MPI

from test_gpu import comm  # noqa: F401  (the fixture: a communicator bound to a CuPy stream)

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]
WORLD = MPI.COMM_WORLD


def inp(rank, n, dtype):
    return ((np.arange(n) * 5 + rank * 3 + 1) % 13).astype(dtype)


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_block_collectives(comm, dtype):
    import cupy as cp
    comm, stream = comm
    p, me, n = comm.size, comm.rank, 5
    with stream:
        x = cp.asarray(inp(me, n, dtype))
        comm.Allreduce(MPI.IN_PLACE, x)
        got_ar = cp.asnumpy(x, stream=stream)
        y = np.zeros(p * n, dtype)
        y[me * n:(me + 1) * n] = inp(me, n, dtype)
        y = cp.asarray(y)
        comm.Allgather(MPI.IN_PLACE, y)
        got_ag = cp.asnumpy(y, stream=stream)
        z = cp.asarray(inp(me, p * n, dtype))
        comm.Reduce_scatter(MPI.IN_PLACE, z)
        got_rs = cp.asnumpy(z, stream=stream)[:n]
    total = sum(inp(r, p * n, dtype) for r in range(p)).astype(dtype)
    np.testing.assert_array_equal(got_ar, sum(inp(r, n, dtype) for r in range(p)).astype(dtype))
    np.testing.assert_array_equal(got_ag, np.concatenate([inp(r, n, dtype) for r in range(p)]))
    np.testing.assert_array_equal(got_rs, total[me * n:(me + 1) * n])


@pytest.mark.parametrize("form", ["IN_PLACE", "recvbuf=None"])
def test_reduce_scatter_with_counts_in_place(comm, form):
    """The host form's in-place Reduce_scatter with counts, on GPU buffers: the result in the
    first counts[rank] elements of the data's buffer."""
    import cupy as cp
    comm, stream = comm
    p, me = comm.size, comm.rank
    counts = [1 + 3 * r for r in range(p)]
    total = sum(counts)
    with stream:
        x = cp.asarray(inp(me, total, "float32"))
        if form == "IN_PLACE":
            comm.Reduce_scatter(MPI.IN_PLACE, [x, counts])
        else:
            comm.Reduce_scatter(x, None, recvcounts=counts)
        got = cp.asnumpy(x, stream=stream)[:counts[me]]
    want = sum(inp(r, total, "float32") for r in range(p))
    at = sum(counts[:me])
    np.testing.assert_array_equal(got, want[at:at + counts[me]])
