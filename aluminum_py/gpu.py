"""CUDA devices and GPU buffers: probing devices, parsing GPU buffers (DLPack and
``__cuda_array_interface__``), stream handles, and what outlives a GPU op (its request, the
buffers kept until its completion event has fired).

The GPU backend that runs ops on them is :mod:`aluminum_py.backends.gpu_backend`; the semantics
are in docs/gpu.md and docs/semantics.md.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from . import _core, _dlpack, config
from .errors import Error, UnavailableError
from .ops import dtype_named, known_dtype

CUDA_DLPACK_DEVICES = {2, 3, 13}   # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


def dlpack_device_type(obj) -> int | None:
    """The DLDeviceType of a DLPack producer (``__dlpack_device__()[0]``), else None."""
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is None or isinstance(obj, np.ndarray):
        return None
    try:
        return int(dev()[0])
    except Exception:
        return None


def is_gpu_buffer(obj) -> bool:
    """An object with __cuda_array_interface__, or a DLPack producer on a CUDA device (DLPack
    producers on the CPU, such as PyTorch CPU tensors, are host buffers)."""
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    return dlpack_device_type(obj) in CUDA_DLPACK_DEVICES


_device_count = None
_devices: dict = {}         # ordinal -> _core.CudaDevice, one per device for the process


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 without a driver); probed once, with cuInit and
    cuDeviceGetCount only: no context is created or retained (AL_CUDA_LIBRARY selects the
    driver library, e.g. the stand-in of aluminum_py.testing.cuda_standin)."""
    global _device_count
    if _device_count is None:
        _device_count = _core.cuda_device_count(config.cuda_driver())
    return _device_count


def cuda_device(ordinal: int):
    """The device interface of CUDA device `ordinal`, shared by every communicator on it (one
    pinned-buffer pool per device; its primary context is retained once)."""
    dev = _devices.get(ordinal)
    if dev is None:
        dev = _devices[ordinal] = _core.CudaDevice(ordinal, config.cuda_driver())
    return dev


def release_pinned_pools(timeout: float | None = None) -> bool:
    """At exit, after the progress engine has stopped: free every device's cached pinned
    buffers (after a device synchronize). The synchronize waits for whatever the program left
    queued on its streams, so it runs in a helper thread, given at most `timeout` seconds
    (default AL_EXIT_GRACE); past that the buffers are left to the process's end. Returns True
    if every pool was released."""
    import threading
    if not _devices:
        return True

    def release():
        for dev in list(_devices.values()):
            try:
                dev.release_pinned()
            except Error:
                pass
    t = threading.Thread(target=release, name="aluminum_py-pinned-release", daemon=True)
    t.start()
    t.join(config.exit_grace() if timeout is None else timeout)
    return not t.is_alive()


def current_device() -> int:
    """The CUDA device this rank uses: the device of the calling thread's current CUDA context
    (``torch.cuda.set_device``, ``cupy.cuda.Device(i).use()`` and ``cudaSetDevice`` make one
    current), else CuPy's current device if CuPy imports, else 0."""
    try:
        ordinal = _core.cuda_current_device(config.cuda_driver())
        if ordinal is not None:
            return ordinal
    except Error:
        pass                                # no driver, or it failed: the fallbacks decide
    try:
        import cupy
        return int(cupy.cuda.Device().id)
    except Exception:
        return 0


def require_cuda(what: str) -> None:
    if cuda_device_count() == 0:
        raise UnavailableError(f"{what}: no CUDA device is available")


def threads_to_ctas(threads: int, nthreads_per_cta: int | None = None) -> int:
    """A thread budget (e.g. from a LIBRA plan) as NCCL's maxCTAs, with NCCL_NTHREADS threads
    per CTA (env NCCL_NTHREADS, default 512: ``config.nccl_nthreads``)."""
    per = nthreads_per_cta or config.nccl_nthreads()
    return max(1, math.ceil(threads / per))


@dataclass
class GpuArray:
    """A parsed GPU buffer: device pointer, element count, dtype, and the object kept alive."""

    ptr: int
    count: int
    dtype: np.dtype
    readonly: bool
    obj: object
    device: int | None = None       # the CUDA device ordinal of device memory, when known

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def _dlpack_dtype(t, name: str) -> np.dtype:
    """The numpy dtype of a DLPack tensor (kDLBfloat, 16 bits: bfloat16)."""
    dtype = dtype_named(t.dtype_name)
    if dtype is None:
        hint = " (bfloat16 needs ml_dtypes)" if t.dtype_name == "bfloat16" else ""
        raise TypeError(f"{name}: DLPack dtype {t.dtype_name} is not supported{hint}")
    return dtype


def dlpack_array(t, name: str, writable: bool = False) -> GpuArray:
    """A consumed DLPack tensor (an ``aluminum_py._dlpack.DLPackBuffer``, on any device) as a
    checked GpuArray that keeps the tensor (and so the producer's buffer) alive."""
    dtype = _dlpack_dtype(t, name)
    strides = None if t.strides is None else tuple(st * dtype.itemsize for st in t.strides)
    arr = _checked(name, t.ptr, t.shape, strides, dtype, t.readonly, writable, t)
    if t.device_type == _dlpack.CUDA:
        arr.device = int(t.device_id)
    return arr


def as_gpu_array(obj, name: str, writable: bool = False, stream: int | None = None) -> GpuArray:
    """Parse a GPU buffer.

    A DLPack producer on a CUDA device (``__dlpack__`` and a ``__dlpack_device__`` of CUDA,
    CUDA host or CUDA managed memory; PyTorch and CuPy arrays are such) is read natively
    (aluminum_py._dlpack), with `stream` (the consumer's stream handle) passed to
    ``__dlpack__`` so that the producer orders its pending work before it (DLPack's 1 for the
    legacy default stream 0; None: -1, no synchronisation). Else ``__cuda_array_interface__``.
    """
    dev = dlpack_device_type(obj)
    if dev in CUDA_DLPACK_DEVICES and hasattr(obj, "__dlpack__"):
        if dev == _dlpack.CUDA_HOST:
            ask = None                               # DLPack: streams are for device memory
        else:
            ask = -1 if stream is None else (1 if stream == 0 else stream)
        t = _dlpack.read(obj, stream=ask)
        if t.device_type not in CUDA_DLPACK_DEVICES:
            raise TypeError(f"{name}: __dlpack_device__ says CUDA but the DLPack tensor is on "
                            f"device type {t.device_type}")
        return dlpack_array(t, name, writable)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"{name}: not a GPU buffer")
    ptr, readonly = cai["data"]
    dtype = np.dtype(cai["typestr"])
    own = getattr(obj, "dtype", None)
    if dtype.kind == "V" and own is not None:
        # the interface has no typestr for bfloat16 (it says "|V2"); the array's own dtype does
        own = np.dtype(own) if not isinstance(own, np.dtype) else own
        if own.itemsize == dtype.itemsize:
            dtype = own
    return _checked(name, ptr, tuple(cai["shape"]), cai.get("strides"), dtype, readonly,
                    writable, obj)


def _checked(name, ptr, shape, strides, dtype, readonly, writable, keep) -> GpuArray:
    """The checks every GPU buffer passes: C order (strides in bytes; None is C order),
    writability, a supported dtype."""
    count = int(np.prod(shape)) if shape else 1
    if strides is not None and count > 1:
        expected, step = [], dtype.itemsize           # C-contiguous strides for this shape
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if any(d > 1 and st != ex for d, st, ex in zip(shape, strides, reversed(expected))):
            raise ValueError(f"{name} is not C-contiguous")
    if writable and readonly:
        raise ValueError(f"{name} is read-only but is written by this operation")
    if not known_dtype(dtype):
        raise TypeError(f"{name}: dtype {dtype} is not supported")
    return GpuArray(int(ptr), count, dtype, bool(readonly), keep)


def stream_handle(stream) -> int:
    """A cupy.cuda.Stream, a torch.cuda.Stream, or a raw handle (int) -> the handle."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("ptr", "cuda_stream"):
        h = getattr(stream, attr, None)
        if h is not None:
            return int(h)
    raise TypeError(f"stream: expected a cupy.cuda.Stream, a torch.cuda.Stream or an int handle, "
                    f"got {type(stream).__name__}")


class GpuRequest:
    """Completion of a nonblocking GPU op: ``Wait`` makes the bound stream wait on the op's
    completion event; ``Test`` queries it. For a host-transfer op, both also report a failure
    of the op's host part (al.MPIError, or al.TimeoutError after AL_HANG_TIMEOUT) once it is
    known; ``Wait(timeout=t)`` waits at most `t` seconds for the host part to finish. The op's
    buffers are kept alive until it has completed on the device, whether or not the request
    is kept. A point-to-point request whose batch is not launched yet (no event) launches it
    at its first ``Wait`` or ``Test``."""

    def __init__(self, backend, event: int | None, algorithm: str, host_request=None,
                 batch=None):
        self._b, self._event, self.algorithm = backend, event, algorithm
        self._host = host_request
        self._batch, self._failure = batch, None

    def Wait(self, timeout: float | None = None) -> None:
        """Make the bound stream wait for the op (the host does not block).

        Args:
            timeout: None: never block the host. Seconds (host-transfer ops only): block until
                the host part has finished, at most that long. NCCL ops ignore it.
        Raises:
            aluminum_py.TimeoutError: the host part did not finish within `timeout` (it stays
                pending), or the engine abandoned it at AL_HANG_TIMEOUT.
            aluminum_py.MPIError: the host part failed.
        """
        _core.check_not_forked("GpuRequest.Wait")          # before any driver call
        if self._event is None:
            self._b.launch_request(self, "GpuRequest.Wait")
        if self._host is not None:
            if timeout is not None:
                try:
                    self._b.report(self._host, float(timeout))
                except Error:
                    raise
                except BaseException:       # a signal's exception (Ctrl-C): report it later
                    if self._host not in self._b._unreported:
                        self._b._unreported.append(self._host)
                    raise
            elif self._host.done:
                self._b.report(self._host, 0.0)
            elif self._host not in self._b._unreported:
                self._b._unreported.append(self._host)    # its failure: at the next GPU op / Free
        self._b.device.stream_wait_event(self._b.stream, self._event)

    def _wait(self, timeout=None) -> None:   # al.Waitall
        self.Wait(timeout)

    def Test(self) -> bool:
        """True once the op has completed on the device (raises its host part's failure)."""
        _core.check_not_forked("GpuRequest.Test")
        if self._event is None:
            self._b.launch_request(self, "GpuRequest.Test")
        if self._host is not None and self._host.done:
            self._b.report(self._host, 0.0)
        return self._b.device.event_query(self._event)

    def __del__(self):
        if self._event is None:
            return
        try:
            self._b.device.event_destroy(self._event)
        except Exception:
            pass

    @property
    def done(self) -> bool:
        return self.Test()


class InFlight:
    """The buffers of GPU ops enqueued on streams, kept alive until each op's completion event
    has fired: the caller may drop its array right after a call (CuPy or PyTorch then reuse
    the memory, possibly for work on another stream) while NCCL or a copy still reads it.
    One queue per stream (events complete in stream order); events are reused."""

    def __init__(self, device):
        self.device = device
        self.queues: dict = {}              # stream handle -> deque of (event, keep)
        self.free_events: list = []

    def track(self, stream: int, keep) -> None:
        """Record an event on `stream` after the op just enqueued there; keep `keep` until it
        has fired."""
        ev = self.free_events.pop() if self.free_events else self.device.event_create()
        try:
            self.device.event_record(ev, stream)
        except BaseException:
            self.free_events.append(ev)
            raise
        self.queues.setdefault(stream, deque()).append((ev, keep))

    def retire(self) -> None:
        """Drop the buffers of the ops that have completed."""
        for q in self.queues.values():
            while q and self.device.event_query(q[0][0]):
                self.free_events.append(q.popleft()[0])

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def destroy_events(self) -> None:
        """After every op has completed: destroy the events."""
        for ev in self.free_events:
            self.device.event_destroy(ev)
        self.free_events.clear()


_RETIRING: list = []    # InFlight of freed communicators whose ops had not completed at Free


def retire_later(inflight: InFlight) -> None:
    """Keep what a freed communicator's ops still use until they have completed."""
    _RETIRING.append(inflight)


def _retire_freed() -> None:
    """Release what freed communicators still held, once their ops have completed."""
    if not _RETIRING:
        return
    keep = []
    for f in _RETIRING:
        f.retire()
        if f.pending:
            keep.append(f)
        else:
            f.destroy_events()
    _RETIRING[:] = keep


_ABANDONED: list = []     # host requests abandoned at AL_HANG_TIMEOUT, kept with their buffers


def _retain_if_abandoned(r) -> None:
    """Keep an abandoned host-transfer op (and through it the user's buffers) alive for the
    life of the process: the engine gave up on it, but its stream may still run the copies
    queued for it, into those buffers (as its pinned buffer is leaked)."""
    err = r._op.error
    if err is not None and err[0] == _core.ERR_TIMEOUT:
        _ABANDONED.append(r)
