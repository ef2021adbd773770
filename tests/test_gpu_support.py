"""GPU support that can be checked without a GPU: buffer parsing, stream handles, CTA mapping,
and the clear errors when no CUDA device is available."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import gpu


class FakeCudaArray:
    """Looks like a CuPy array to __cuda_array_interface__ readers."""

    def __init__(self, shape, typestr="<f4", ptr=0x7000_0000, readonly=False, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, readonly), "strides": strides, "version": 3}


def test_parse_cuda_array_interface():
    a = gpu.as_gpu_array(FakeCudaArray((4, 5)), "sendbuf")
    assert a.ptr == 0x7000_0000 and a.count == 20 and a.dtype == np.float32 and a.nbytes == 80
    with pytest.raises(ValueError, match="recvbuf is read-only"):
        gpu.as_gpu_array(FakeCudaArray((3,), readonly=True), "recvbuf", writable=True)
    with pytest.raises(ValueError, match="sendbuf is not C-contiguous"):
        gpu.as_gpu_array(FakeCudaArray((4, 5), strides=(4, 16)), "sendbuf")
    with pytest.raises(TypeError, match="sendbuf: dtype"):
        gpu.as_gpu_array(FakeCudaArray((3,), typestr="|b1"), "sendbuf")
    with pytest.raises(TypeError, match="not a GPU buffer"):
        gpu.as_gpu_array(np.ones(3), "sendbuf")


def test_stream_handles_and_ctas():
    class CupyLike:
        ptr = 1234

    class TorchLike:
        cuda_stream = 99

    assert gpu.stream_handle(None) == 0 and gpu.stream_handle(7) == 7
    assert gpu.stream_handle(CupyLike()) == 1234 and gpu.stream_handle(TorchLike()) == 99
    with pytest.raises(TypeError, match="stream"):
        gpu.stream_handle("s")
    assert gpu.threads_to_ctas(2048, 512) == 4 and gpu.threads_to_ctas(100, 512) == 1
    assert gpu.threads_to_ctas(1025, 512) == 3


@pytest.mark.skipif(gpu.cuda_device_count() > 0, reason="a CUDA device is present")
def test_no_cuda_device_errors():
    with pytest.raises(al.UnavailableError, match="no CUDA device is available"):
        al.Communicator(stream=0)
    with pytest.raises(al.UnavailableError, match="no CUDA driver|no CUDA device"):
        al._core.CudaDevice(0)
    comm = al.Communicator()
    with pytest.raises(al.UnavailableError, match="^sendbuf is a GPU buffer: no CUDA device"):
        comm.Allreduce(FakeCudaArray((4,)))
    with pytest.raises(al.UnavailableError, match="^buf is a GPU buffer: no CUDA device"):
        comm.Ibcast(FakeCudaArray((4,)))
    with pytest.raises(al.UnavailableError, match="^algorithm.*no CUDA device"):
        comm.Allreduce(np.ones(4, np.float32), algorithm="nccl")
    with pytest.raises(ValueError, match="max_ctas"):
        comm.Allreduce(np.ones(4, np.float32), max_ctas=2)
    x = np.ones(4)
    comm.Allreduce(x)                    # the communicator still works
    assert np.all(x == 1)
    comm.Free()


def test_nccl_point_to_point_argument_rules():
    from mpi4py import MPI
    from aluminum_py.communicator import _nccl_p2p_args
    _nccl_p2p_args(0, 1, MPI.ANY_SOURCE)
    with pytest.raises(ValueError, match="^tag"):
        _nccl_p2p_args(3, 1, MPI.ANY_SOURCE)
    with pytest.raises(ValueError, match="^source"):
        _nccl_p2p_args(0, MPI.ANY_SOURCE, MPI.ANY_SOURCE)


def test_device_count_is_probed_once():
    n = gpu.cuda_device_count()
    assert gpu._device_count == n and gpu.cuda_device_count() == n
