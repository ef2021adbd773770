"""Host-transfer allreduce (Aluminum paper section IV, Figs. 5-6) over a device interface.

For a buffer in device memory, on the communicator's stream: copy device -> pinned host memory,
record an event, block the stream on a host-written flag (``cuStreamWaitValue32``), copy
pinned -> device. The progress engine polls the event without the GIL, runs a host allreduce
algorithm (``ht_<alg>``: any of the host algorithms, in place on the pinned buffer), writes the
flag, polls the final copy's event and only then frees the pinned buffer. The host thread never
waits for the device: "blocking" and nonblocking calls both return once the work is enqueued.

The state machine is written against the small device interface of ``ext/al_device.h``.
:class:`CpuDevice` implements it on the CPU (streams are worker threads), which is how the
ordering is tested under real MPI ranks without a GPU (tests/mpi/test_host_transfer.py).
"""
from __future__ import annotations

import numpy as np

from . import _core, config
from .algorithms import HOST_ALLREDUCE
from .buffers import as_array, at_least, same_dtype
from .ops import DTYPE_CODES, SUM, Op, as_op, check_op
from .request import Request

CpuDevice = _core.CpuDevice
HT_ALGORITHMS = tuple("ht_" + a for a in HOST_ALLREDUCE)     # ht_auto, ht_mpi, ht_ring, ...


def host_algorithm(algorithm: str) -> str:
    """'ht_ring' -> 'ring' (and 'auto' -> 'auto')."""
    if algorithm == "auto":
        return "auto"
    if algorithm in HT_ALGORITHMS:
        return algorithm[3:]
    raise ValueError(f"algorithm: {algorithm!r} is not a host-transfer algorithm; choose from "
                     f"{', '.join(HT_ALGORITHMS)}")


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
    alg = host_algorithm(algorithm)
    nop = comm._launcher.host_transfer_allreduce(device, stream.handle, _core.addr(s), _core.addr(r),
                                                 s.size, code, s.itemsize, op.code, alg, (s, r),
                                                 config.hang_timeout_native())
    return Request(nop, "ht_" + nop.name.split("/ht_")[1])


def bind(comm, device, stream) -> None:
    """Give `comm` a GPU backend on `device` (a :class:`CpuDevice`) bound to `stream` (one of
    its streams), instead of the CUDA device: objects with ``__cuda_array_interface__`` over
    host memory then run the communicator's GPU code paths (host-transfer algorithms, events,
    the internal stream, error reporting) on the CPU. For tests; call it right after creating
    the communicator."""
    from .gpu import GpuBackend
    if comm._gpu is not None:
        raise ValueError("comm: the communicator already has a GPU backend")
    if not isinstance(device, CpuDevice):
        raise TypeError(f"device: expected a host_transfer.CpuDevice, got {type(device).__name__}")
    comm._gpu = GpuBackend(comm, stream.handle, device=device)


def phase_times(request: Request) -> tuple[float, float, float, float]:
    """(copy-out seen, host algorithm done, flag written, copy-back seen) for a completed
    host-transfer request, on the monotonic clock (for ordering checks)."""
    return _core.ht_times(request._op)
