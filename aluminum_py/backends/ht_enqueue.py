"""The enqueue of the host-transfer allreduce (Aluminum paper section IV, Figs. 5-6) on one
device: copy to pinned host memory on the stream, a host allreduce algorithm run by the progress
engine, copy back (docs/gpu.md, "The host-transfer allreduce step by step"). The state machine
is native (``ext/core/ht_op.pxi``, enqueued by ``_core.host_transfer_allreduce``),
written against the device interface of ``ext/al_device.h``; the device is a CUDA device or the
CPU device of the tests.  The public CPU-device entry points are :mod:`aluminum_py.host_transfer`."""
from __future__ import annotations

from .. import _core, config
from ..algorithms import host_algorithm


class HostTransfer:
    """Host-transfer allreduce for one communicator (its native `launcher`, which runs the host
    algorithm on its MPI communicator) on one `device`."""

    def __init__(self, launcher, device):
        self.launcher = launcher
        self.device = device

    def allreduce(self, stream: int, sendptr: int, recvptr: int, count: int, code: int,
                  itemsize: int, opcode: int, algorithm: str, keep):
        """Enqueue the allreduce of `count` elements at device address `sendptr` into `recvptr`
        on `stream` and hand its host part to the engine; `algorithm` is an ``ht_*`` name (or
        "auto": the host "auto" inside). `keep`: what must live until it completes. Returns the
        native op (submitted)."""
        return _core.host_transfer_allreduce(
            self.launcher, self.device, stream, sendptr, recvptr, count, code, itemsize, opcode,
            host_algorithm(algorithm), keep, config.hang_timeout_native())
