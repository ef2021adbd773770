"""GPU buffers: stream-bound communicators, NCCL and host-transfer algorithms.

Semantics (DESIGN.md, "GPU buffers"): a Communicator is bound to one stream. An op waits for
the work already queued on that stream, and later work on the stream waits for the op; the host
is never blocked, not even by "blocking" ops.

* ``algorithm="nccl"``: blocking ops are enqueued on the bound stream. Nonblocking ops run on
  an internal stream that first waits on an event recorded on the bound stream; ``Wait`` makes
  the bound stream wait on the completion event (host not blocked); ``Test`` queries it.
* ``"ht_mpi"``, ``"ht_recursive_doubling"``, ``"ht_rabenseifner"``, ``"ht_ring"``: the host-
  transfer allreduce (aluminum_py.host_transfer), driven by the progress engine.
* ``max_ctas=`` / ``min_ctas=`` (default ``AL_NCCL_MAX_CTAS`` / ``AL_NCCL_MIN_CTAS``): NCCL runs
  the op on a communicator split from the base one with that ``ncclConfig_t`` (cached per
  communicator, created collectively in call order, hence identically on every rank). NCCL
  launches at most ``max_ctas`` thread blocks per collective, each of ``NCCL_NTHREADS`` threads
  (default 512 on recent GPUs), so a LIBRA plan's thread budget T maps to
  ``max_ctas = ceil(T / NCCL_NTHREADS)``.

GPU buffers are CUDA DLPack producers (PyTorch, CuPy, ...; read by the native reader
``aluminum_py._dlpack``) or objects with ``__cuda_array_interface__`` (Numba, ...). Without a
CUDA device every GPU call raises :class:`aluminum_py.UnavailableError` ("no CUDA device is
available") before communicating.

Host-transfer ops finish in the progress engine: failures of blocking ones are raised at the
communicator's next GPU op (``GpuBackend.check``) or by ``Free``; AL_HANG_TIMEOUT bounds their
host part (docs/gpu.md, "Failures, hang timeout and pending operations").
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from . import _core, _dlpack, config, nccl, tuning
from .buffers import CUDA_DLPACK_DEVICES, dlpack_device_type
from .errors import Error, TimeoutError, UnavailableError
from .ops import AVG, DTYPE_CODES, Op, as_op, check_op

GPU_ALGORITHMS = ("auto", "nccl", "ht_mpi", "ht_recursive_doubling", "ht_rabenseifner", "ht_ring")
_NCCL_OPS = {"SUM": "sum", "PROD": "prod", "MIN": "min", "MAX": "max", "AVG": "avg"}


_device_count = None
_devices: dict = {}         # ordinal -> _core.CudaDevice, one per device for the process


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 without a driver); probed once, with cuInit and
    cuDeviceGetCount only: no context is created or retained (AL_CUDA_LIBRARY selects the
    driver library, e.g. the stand-in of aluminum_py.testing.cuda_standin)."""
    global _device_count
    if _device_count is None:
        _device_count = _core.cuda_device_count()
    return _device_count


def cuda_device(ordinal: int):
    """The device interface of CUDA device `ordinal`, shared by every communicator on it (one
    pinned-buffer pool per device; its primary context is retained once)."""
    dev = _devices.get(ordinal)
    if dev is None:
        dev = _devices[ordinal] = _core.CudaDevice(ordinal)
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
        ordinal = _core.cuda_current_device()
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
    per CTA (env NCCL_NTHREADS, default 512)."""
    per = nthreads_per_cta or int(os.environ.get("NCCL_NTHREADS", "512"))
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


_DTYPES_BY_NAME = {str(dt): dt for dt in DTYPE_CODES}


def _dlpack_dtype(t, name: str) -> np.dtype:
    """The numpy dtype of a DLPack tensor (kDLBfloat, 16 bits: bfloat16)."""
    dtype = _DTYPES_BY_NAME.get(t.dtype_name)
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
    if dtype not in DTYPE_CODES:
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
    is kept."""

    def __init__(self, backend: "GpuBackend", event: int, algorithm: str, host_request=None):
        self._b, self._event, self.algorithm = backend, event, algorithm
        self._host = host_request

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
        if self._host is not None:
            if timeout is not None:
                self._b.report(self._host, float(timeout))
            elif self._host.done:
                self._b.report(self._host, 0.0)
            elif self._host not in self._b._unreported:
                self._b._unreported.append(self._host)    # its failure: at the next GPU op / Free
        self._b.device.stream_wait_event(self._b.stream, self._event)

    def _wait(self, timeout=None) -> None:   # al.Waitall
        self.Wait(timeout)

    def Test(self) -> bool:
        """True once the op has completed on the device (raises its host part's failure)."""
        if self._host is not None and self._host.done:
            self._b.report(self._host, 0.0)
        return self._b.device.event_query(self._event)

    def __del__(self):
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


def _retire_freed() -> None:
    """Release what freed communicators still held, once their ops have completed."""
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


class GpuBackend:
    """The GPU side of one Communicator (created on its first GPU op or by ``stream=``)."""

    def __init__(self, comm, stream, device=None):
        """`device`: the device interface (default: the CUDA device of `current_device()`);
        the tests pass an ``aluminum_py.host_transfer.CpuDevice`` and a CPU stream's handle."""
        if device is None:
            require_cuda("GPU communicator")
            device = cuda_device(current_device())
        self.comm = comm
        self.stream = stream_handle(stream)
        self.device = device
        self.inflight = InFlight(device)    # buffers of enqueued ops, until they completed
        self._internal = None
        self._decider = None
        self._nccl_base = None
        self._nccl_pool: dict = {}
        self._ctl = None                    # control traffic (NCCL id, tuning data)
        self._unreported: list = []         # Requests of blocking host-transfer ops

    def _arr(self, obj, name: str, writable: bool = False) -> GpuArray:
        """as_gpu_array with this backend's stream (DLPack producers sync to it); device memory
        must be on the communicator's device."""
        a = as_gpu_array(obj, name, writable, stream=self.stream)
        ordinal = getattr(self.device, "ordinal", None)
        if a.device is not None and ordinal is not None and a.device != ordinal:
            raise ValueError(f"{name} is on CUDA device {a.device} but the communicator uses CUDA "
                             f"device {ordinal} (the device current when its GPU backend was "
                             f"made: torch.cuda.set_device / cupy.cuda.Device(i).use() first)")
        return a

    # -- failures of blocking host-transfer ops
    def report(self, r, timeout: float) -> None:
        """Wait up to `timeout` for host request `r` and raise its failure (once: it leaves
        the unreported list). An op the engine abandoned at AL_HANG_TIMEOUT is retained for
        the life of the process: its stream may still copy into its buffers."""
        try:
            r._wait(timeout)
        except Error:
            if r.done:
                if r in self._unreported:
                    self._unreported.remove(r)
                _retain_if_abandoned(r)
            raise

    def check(self) -> None:
        """At every GPU operation on the communicator: release the buffers of completed ops,
        then raise the first failure, not reported yet, of an earlier host-transfer op whose
        host part has finished (blocking ops, and nonblocking ones whose Wait came first)."""
        self.inflight.retire()
        if _RETIRING:
            _retire_freed()
        keep, failure = [], None
        for r in self._unreported:
            done = r.done                   # read once: the engine may finish r meanwhile
            if failure is None and done:
                try:
                    r._wait(0.0)
                except Error as e:
                    failure = e
                    _retain_if_abandoned(r)
            elif not done or failure is not None:
                keep.append(r)
        self._unreported = keep
        if failure is not None:
            raise failure

    def drain(self, timeout: float | None) -> None:
        """Wait until the host parts of the blocking host-transfer ops have finished, for
        Communicator.Free. `timeout`: AL_HANG_TIMEOUT (None: no limit). The engine abandons
        each host part `timeout` after its call, so this waits at most about that long; the
        limit here leaves the engine time to notice. Failures stay unreported here (close()
        returns them)."""
        limit = -1.0 if timeout is None else 2.0 * timeout + 1.0
        deadline = time.monotonic() + limit
        for r in self._unreported:
            left = -1.0 if limit < 0 else max(0.0, deadline - time.monotonic())
            if not r._op.wait(left):
                raise TimeoutError(f"Free: {r._op.describe()}: the host part of a blocking "
                                   f"host-transfer op did not finish within {limit:g} s")

    # -- control traffic: a private duplicate, so it never interleaves with the engine's ops
    def control_comm(self):
        """The MPI communicator for the GPU backend's own control messages (the NCCL unique id,
        the tuning data): a duplicate of the communicator's point-to-point MPI communicator,
        made on first use. That first use is collective (the first NCCL or "auto" GPU op).
        The engine never runs a collective there, so a bcast on it cannot be matched with a
        collective that the engine starts later on the collective communicator."""
        if self._ctl is None:
            self._ctl = self.comm._p2p.Dup()
        return self._ctl

    # -- streams and events
    def internal_stream(self) -> int:
        if self._internal is None:
            self._internal = self.device.stream_create()
        return self._internal

    def _fork(self) -> int:
        """The internal stream, made to wait for the work queued so far on the bound stream."""
        ev = self.device.event_create()
        self.device.event_record(ev, self.stream)
        s = self.internal_stream()
        self.device.stream_wait_event(s, ev)
        self.device.event_destroy(ev)       # CUDA releases it once the wait is satisfied
        return s

    def _join(self, stream: int, algorithm: str, keep, host_request=None) -> GpuRequest:
        ev = self.device.event_create()
        self.device.event_record(ev, stream)
        self.inflight.track(stream, keep)
        return GpuRequest(self, ev, algorithm, host_request)

    def _enqueued(self, stream: int, blocking: bool, algorithm: str, keep):
        """After an op was enqueued on `stream`: keep its buffers until it has completed; a
        request for nonblocking ops."""
        if blocking:
            self.inflight.track(stream, keep)
            return None
        return self._join(stream, algorithm, keep)

    def close(self) -> Error | None:
        """Communicator.Free (no host-transfer op is pending then): destroy the NCCL
        communicators, the internal stream (CUDA releases it once its queued work has run) and
        the control communicator; buffers of ops still running on the device stay referenced
        until they complete; the device's pinned pool is freed if no host-transfer op is in
        flight on it. Returns the first unreported failure of a blocking host-transfer op (or of
        freeing the pool), for Free to raise once everything is released."""
        self.inflight.retire()
        if self.inflight.pending:
            _RETIRING.append(self.inflight)     # released at a later GPU op, once complete
        else:
            self.inflight.destroy_events()
        for c in list(self._nccl_pool.values()) + [self._nccl_base]:
            if c is not None:
                c.destroy()
        self._nccl_pool.clear()
        self._nccl_base = None
        if self._internal is not None:
            s, self._internal = self._internal, None
            self.device.stream_destroy(s)
        if self._ctl is not None:
            self._ctl.Free()
            self._ctl = None
        failure = None
        if self.device.pinned_stats()["taken"] == 0:
            try:            # no host-transfer op in flight on the device: free the pool
                self.device.release_pinned()
            except Error as e:
                failure = e
        try:
            self.check()
        except Error as e:
            failure = failure or e
        return failure

    # -- NCCL communicators: the base one and the CTA-limited pool split from it
    @staticmethod
    def _nccl_blocking():
        """ncclConfig_t.blocking: 0 when AL_HANG_TIMEOUT is set (else NCCL's default, 1)."""
        return False if config.hang_timeout() is not None else None

    def nccl_comm(self, min_ctas=None, max_ctas=None) -> nccl.NcclComm:
        if min_ctas is None and os.environ.get("AL_NCCL_MIN_CTAS"):
            min_ctas = int(os.environ["AL_NCCL_MIN_CTAS"])
        if max_ctas is None and os.environ.get("AL_NCCL_MAX_CTAS"):
            max_ctas = int(os.environ["AL_NCCL_MAX_CTAS"])
        if self._nccl_base is None:
            mpi = self.control_comm()
            uid = nccl.get_unique_id() if mpi.Get_rank() == 0 else None
            uid = mpi.bcast(uid, root=0)
            # with AL_HANG_TIMEOUT, a nonblocking communicator: its creation, splits and calls
            # are then waited for with that timeout instead of blocking inside NCCL
            self._nccl_base = nccl.NcclComm(mpi.Get_size(), uid, mpi.Get_rank(),
                                            blocking=self._nccl_blocking())
        if min_ctas is None and max_ctas is None:
            return self._nccl_base
        key = (min_ctas, max_ctas)
        if key not in self._nccl_pool:      # collective: every rank asks in the same order
            self._nccl_pool[key] = self._nccl_base.split(0, self.comm.rank, min_ctas=min_ctas,
                                                         max_ctas=max_ctas,
                                                         blocking=self._nccl_blocking())
        return self._nccl_pool[key]

    # -- allreduce
    def choose(self, nbytes: int, itemsize: int) -> str:
        """auto for GPU buffers: the tuning table's "cuda" entries (NCCL vs host transfer, the
        paper's "minimal" hybrid), else NCCL when it loads, else host transfer."""
        if self._decider is None:         # collective, on the first GPU "auto" call
            from .communicator import tuning_data
            exact, _, params = tuning_data(self.control_comm(), self.comm.size,
                                           self.comm.local_size, "cuda")
            # only measured entries: the host cost model knows nothing of NCCL
            self._decider = tuning.Decider(self.comm.size, exact, {}, params, GPU_ALGORITHMS[1:])
        choice = self._decider.decide(nbytes, itemsize)
        if choice.source.startswith("table"):
            return choice.algorithm
        return "nccl" if nccl.available() else "ht_auto"

    def allreduce(self, sendbuf, recvbuf, op, algorithm: str, blocking: bool,
                  min_ctas=None, max_ctas=None):
        self.check()
        s = self._arr(sendbuf, "sendbuf", writable=recvbuf is None)
        r = s if recvbuf is None else self._arr(recvbuf, "recvbuf", writable=True)
        if r.dtype != s.dtype:
            raise TypeError(f"recvbuf has dtype {r.dtype} but sendbuf has dtype {s.dtype}")
        if r.count < s.count:
            raise ValueError(f"recvbuf is too short: {r.count} elements, needs {s.count}")
        op = op if isinstance(op, Op) else as_op(op)
        check_op(op, DTYPE_CODES[s.dtype][0], s.dtype)
        if algorithm not in GPU_ALGORITHMS:
            raise ValueError(f"algorithm: {algorithm!r} is not a GPU algorithm; GPU buffers take "
                             f"{', '.join(GPU_ALGORITHMS)}")
        alg = self.choose(s.nbytes, s.dtype.itemsize) if algorithm == "auto" else algorithm
        if alg == "nccl" and algorithm == "auto" and (op.name not in _NCCL_OPS
                                                       or str(s.dtype) not in nccl.DTYPES):
            alg = "ht_auto"                 # NCCL lacks this op or dtype: host transfer can
        keep = (s.obj, r.obj)
        if alg == "nccl":
            if op.name not in _NCCL_OPS:
                raise TypeError(f"op: NCCL has no {op.name}; use a host-transfer algorithm")
            comm = self.nccl_comm(min_ctas, max_ctas)
            stream = self.stream if blocking else self._fork()
            comm.allreduce(s.ptr, r.ptr, s.count, str(s.dtype), _NCCL_OPS[op.name], stream)
            return self._enqueued(stream, blocking, alg, keep)
        from .host_transfer import host_algorithm
        stream = self.stream if blocking else self._fork()
        nop = self.comm._launcher.host_transfer_allreduce(
            self.device, stream, s.ptr, r.ptr, s.count, DTYPE_CODES[s.dtype][0], s.dtype.itemsize,
            op.code, host_algorithm(alg), keep, config.hang_timeout_native())
        from .request import Request
        req = Request(nop, alg)
        if blocking:            # the engine finishes it; the stream orders later work after it
            self._unreported.append(req)
            return None
        return self._join(stream, alg, keep, host_request=req)

    # -- the other collectives: NCCL's own, grouped send/recv where NCCL has none
    def _run(self, name: str, blocking: bool, keep, launch):
        self.check()
        comm = self.nccl_comm()
        stream = self.stream if blocking else self._fork()
        launch(comm, stream)
        return self._enqueued(stream, blocking, "nccl", keep)

    def _pair(self, sendbuf, recvbuf, send_name="sendbuf"):
        """The send and receive buffers; recvbuf None: in place, so sendbuf is written (it must
        be writable). Distinct buffers must not overlap."""
        s = self._arr(sendbuf, send_name, writable=recvbuf is None)
        r = s if recvbuf is None else self._arr(recvbuf, "recvbuf", writable=True)
        if r.dtype != s.dtype:
            raise TypeError(f"recvbuf has dtype {r.dtype} but {send_name} has dtype {s.dtype}")
        if r is not s and r.ptr != s.ptr and s.ptr < r.ptr + r.nbytes and r.ptr < s.ptr + s.nbytes:
            raise ValueError(f"{send_name} and recvbuf overlap partially")
        return s, r

    def bcast(self, buf, root: int, blocking: bool):
        b = self._arr(buf, "buf", writable=self.comm.rank != root)
        return self._run("bcast", blocking, (b.obj,), lambda c, st: c.broadcast(
            b.ptr, b.ptr, b.count, str(b.dtype), root, st))

    def reduce(self, sendbuf, recvbuf, op, root: int, blocking: bool):
        """recvbuf matters at root only, as for host buffers: elsewhere it is not read (NCCL
        ignores the receive pointer there), so a rank's bad recvbuf cannot fail it alone."""
        if self.comm.rank == root:
            s, r = self._pair(sendbuf, recvbuf)
            if r.count < s.count:
                raise ValueError(f"recvbuf is too short: {r.count} elements, needs {s.count}")
        else:
            s = r = self._arr(sendbuf, "sendbuf")
        op = op if isinstance(op, Op) else as_op(op)
        check_op(op, DTYPE_CODES[s.dtype][0], s.dtype)
        if op.name not in _NCCL_OPS:
            raise TypeError(f"op: NCCL has no {op.name}")
        return self._run("reduce", blocking, (s.obj, r.obj), lambda c, st: c.reduce(
            s.ptr, r.ptr, s.count, str(s.dtype), _NCCL_OPS[op.name], root, st))

    def allgather(self, sendbuf, recvbuf, blocking: bool):
        s, r = self._pair(sendbuf, recvbuf)
        if recvbuf is None and s.count % self.comm.size:
            raise ValueError(f"sendbuf: {s.count} elements is not divisible by the communicator "
                             f"size {self.comm.size} (in place, it holds one block per rank)")
        n = s.count if recvbuf is not None else s.count // self.comm.size
        if r.count < n * self.comm.size:
            raise ValueError(f"recvbuf is too short: {r.count} elements, needs {n * self.comm.size}")
        src = s.ptr if recvbuf is not None else s.ptr + self.comm.rank * n * s.dtype.itemsize
        return self._run("allgather", blocking, (s.obj, r.obj), lambda c, st: c.allgather(
            src, r.ptr, n, str(s.dtype), st))

    def reduce_scatter(self, sendbuf, recvbuf, op, blocking: bool):
        s, r = self._pair(sendbuf, recvbuf)
        if s.count % self.comm.size:
            raise ValueError(f"sendbuf: {s.count} elements is not divisible by the communicator "
                             f"size {self.comm.size}")
        n = s.count // self.comm.size
        if r.count < n:
            raise ValueError(f"recvbuf is too short: {r.count} elements, needs {n}")
        op = op if isinstance(op, Op) else as_op(op)
        check_op(op, DTYPE_CODES[s.dtype][0], s.dtype)
        if op.name not in _NCCL_OPS:
            raise TypeError(f"op: NCCL has no {op.name}")
        # in place (recvbuf None): NCCL's in-place form writes this rank's block of sendbuf;
        # the host API (MPI_IN_PLACE) puts the result first, so a copy on the stream moves it
        nb = n * s.dtype.itemsize
        dst = r.ptr if recvbuf is not None else s.ptr + self.comm.rank * nb

        def launch(c, st):
            c.reduce_scatter(s.ptr, dst, n, str(s.dtype), _NCCL_OPS[op.name], st)
            if recvbuf is None and self.comm.rank != 0 and nb:
                self.device.memcpy(s.ptr, dst, nb, st)
        return self._run("reduce_scatter", blocking, (s.obj, r.obj), launch)

    def exchange(self, sends, recvs, blocking: bool, keep):
        """Grouped point-to-point: sends/recvs are lists of (peer, ptr, count, dtype)."""
        def launch(c, st):
            with nccl.group():
                for peer, ptr, count, dt in sends:
                    c.send(ptr, count, dt, peer, st)
                for peer, ptr, count, dt in recvs:
                    c.recv(ptr, count, dt, peer, st)
        return self._run("exchange", blocking, keep, launch)

    def alltoall(self, sendbuf, recvbuf, blocking: bool):
        s, r = self._pair(sendbuf, recvbuf)
        p, es = self.comm.size, s.dtype.itemsize
        if recvbuf is None or s.count % p:
            raise ValueError("sendbuf: GPU Alltoall needs a recvbuf and a length divisible by the size")
        n = s.count // p
        if r.count < s.count:
            raise ValueError(f"recvbuf is too short: {r.count} elements, needs {s.count}")
        dt = str(s.dtype)
        return self.exchange([(j, s.ptr + j * n * es, n, dt) for j in range(p)],
                             [(j, r.ptr + j * n * es, n, dt) for j in range(p)], blocking, (s.obj, r.obj))

    def gather(self, sendbuf, recvbuf, root: int, blocking: bool):
        s = self._arr(sendbuf, "sendbuf")
        dt, es, p = str(s.dtype), s.dtype.itemsize, self.comm.size
        sends = [(root, s.ptr, s.count, dt)]
        recvs = []
        keep = [s.obj]
        if self.comm.rank == root:
            r = self._arr(recvbuf, "recvbuf", writable=True)
            if r.dtype != s.dtype or r.count < p * s.count:
                raise ValueError(f"recvbuf: needs {p * s.count} elements of {s.dtype}")
            recvs = [(j, r.ptr + j * s.count * es, s.count, dt) for j in range(p)]
            keep.append(r.obj)
        return self.exchange(sends, recvs, blocking, tuple(keep))

    def scatter(self, sendbuf, recvbuf, root: int, blocking: bool):
        r = self._arr(recvbuf, "recvbuf", writable=True)
        dt, es, p = str(r.dtype), r.dtype.itemsize, self.comm.size
        sends, keep = [], [r.obj]
        if self.comm.rank == root:
            s = self._arr(sendbuf, "sendbuf")
            if s.dtype != r.dtype or s.count < p * r.count:
                raise ValueError(f"sendbuf: needs {p * r.count} elements of {r.dtype}")
            sends = [(j, s.ptr + j * r.count * es, r.count, dt) for j in range(p)]
            keep.append(s.obj)
        return self.exchange(sends, [(root, r.ptr, r.count, dt)], blocking, tuple(keep))

    def send(self, buf, dest: int, blocking: bool):
        b = self._arr(buf, "buf")
        return self.exchange([(dest, b.ptr, b.count, str(b.dtype))], [], blocking, (b.obj,))

    def recv(self, buf, source: int, blocking: bool):
        b = self._arr(buf, "buf", writable=True)
        return self.exchange([], [(source, b.ptr, b.count, str(b.dtype))], blocking, (b.obj,))

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, blocking: bool):
        if recvbuf is None:
            raise ValueError("recvbuf: Sendrecv needs separate send and receive buffers")
        s, r = self._pair(sendbuf, recvbuf)
        if s.ptr == r.ptr and s.nbytes and r.nbytes:
            raise ValueError("recvbuf: Sendrecv needs separate send and receive buffers")
        return self.exchange([(dest, s.ptr, s.count, str(s.dtype))],
                             [(source, r.ptr, r.count, str(r.dtype))], blocking, (s.obj, r.obj))
