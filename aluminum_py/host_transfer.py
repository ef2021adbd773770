"""The host-transfer allreduce on the CPU device: :class:`CpuDevice` (streams are worker
threads), a communicator's host-transfer allreduce on it, and a GPU backend bound to it, so that
the GPU code paths run without a GPU (tests/mpi/test_host_transfer.py,
tests/mpi/test_gpu_backend_cpu.py). The algorithm is in docs/gpu.md, "The host-transfer
allreduce step by step"; the backend that runs it is :mod:`aluminum_py.backends.ht_enqueue`.
"""
from __future__ import annotations

import numpy as np

from . import _core
from .algorithms import HOST_TRANSFER as HT_ALGORITHMS
from .algorithms import host_algorithm
from .buffers import as_array, at_least, same_dtype
from .ops import DTYPE_CODES, SUM, Op, as_op, check_op
from .request import Request

__all__ = ["CpuDevice", "HT_ALGORITHMS", "allreduce", "bind", "host_algorithm", "phase_times"]

CpuDevice = _core.CpuDevice


def allreduce(comm, device, stream, sendbuf: np.ndarray, recvbuf: np.ndarray | None = None,
              op: Op = SUM, algorithm: str = "ht_auto") -> Request:
    """Host-transfer allreduce of CPU-device "device buffers" (numpy arrays) on `stream`.

    Returns a Request at once; the work is ordered after what was queued on `stream` before and
    before what is queued after. ``Request.Wait()`` waits for the host part and the final copy.
    """
    s = as_array(sendbuf, "sendbuf", writable=recvbuf is None)
    r = s if recvbuf is None else as_array(recvbuf, "recvbuf", writable=True)
    if r is not s:
        same_dtype(s, r, "sendbuf", "recvbuf")
        at_least(r, s.size, "recvbuf", "one element per sendbuf element")
    op = op if isinstance(op, Op) else as_op(op)
    code = DTYPE_CODES[s.dtype][0]
    check_op(op, code, s.dtype)
    nop = comm._host_transfer(device).allreduce(stream.handle, _core.addr(s), _core.addr(r),
                                                s.size, code, s.itemsize, op.code, algorithm, (s, r))
    return Request(nop, "ht_" + nop.name.split("/ht_")[1])


def bind(comm, device, stream) -> None:
    """Give `comm` a GPU backend on `device` (a :class:`CpuDevice`) bound to `stream` (one of
    its streams), instead of the CUDA device: objects with ``__cuda_array_interface__`` over
    host memory then run the communicator's GPU code paths (host-transfer algorithms, events,
    the internal stream, error reporting) on the CPU. For tests; call it right after creating
    the communicator."""
    if not isinstance(device, CpuDevice):
        raise TypeError(f"device: expected a host_transfer.CpuDevice, got {type(device).__name__}")
    comm._bind_gpu(device, stream.handle)


def phase_times(request: Request) -> tuple[float, float, float, float]:
    """(copy-out seen, host algorithm done, flag written, copy-back seen) for a completed
    host-transfer request, on the monotonic clock (for ordering checks)."""
    return _core.ht_times(request._op)
