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

GPU buffers are objects with ``__cuda_array_interface__`` (CuPy, PyTorch CUDA tensors, Numba)
or a CUDA DLPack capsule (converted through CuPy). Without a CUDA device every GPU call raises
:class:`aluminum_py.UnavailableError` ("no CUDA device is available") before communicating.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from . import _core, nccl, tuning
from .errors import UnavailableError
from .ops import AVG, DTYPE_CODES, Op, as_op, check_op

GPU_ALGORITHMS = ("auto", "nccl", "ht_mpi", "ht_recursive_doubling", "ht_rabenseifner", "ht_ring")
_NCCL_OPS = {"SUM": "sum", "PROD": "prod", "MIN": "min", "MAX": "max", "AVG": "avg"}


_device_count = None


def cuda_device_count() -> int:
    """CUDA devices visible to this process (0 without a driver); probed once."""
    global _device_count
    if _device_count is None:
        try:
            import cupy
            _device_count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception:
            try:
                _core.CudaDevice(0)
                _device_count = 1
            except Exception:
                _device_count = 0
    return _device_count


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

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


def as_gpu_array(obj, name: str, writable: bool = False) -> GpuArray:
    """Parse a GPU buffer (__cuda_array_interface__, or DLPack through CuPy)."""
    from .buffers import is_gpu_buffer
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is None and is_gpu_buffer(obj):             # a CUDA DLPack producer
        try:
            import cupy
        except ImportError:
            raise TypeError(f"{name}: a DLPack GPU buffer needs CuPy to be read") from None
        obj = cupy.from_dlpack(obj)
        cai = obj.__cuda_array_interface__
    if cai is None:
        raise TypeError(f"{name}: not a GPU buffer")
    dtype = np.dtype(cai["typestr"])
    shape = tuple(cai["shape"])
    count = int(np.prod(shape)) if shape else 1
    strides = cai.get("strides")
    if strides is not None and count > 1:
        expected, step = [], dtype.itemsize           # C-contiguous strides for this shape
        for dim in reversed(shape):
            expected.append(step)
            step *= dim
        if any(d > 1 and st != ex for d, st, ex in zip(shape, strides, reversed(expected))):
            raise ValueError(f"{name} is not C-contiguous")
    ptr, readonly = cai["data"]
    if writable and readonly:
        raise ValueError(f"{name} is read-only but is written by this operation")
    if dtype not in DTYPE_CODES:
        raise TypeError(f"{name}: dtype {dtype} is not supported")
    return GpuArray(int(ptr), count, dtype, bool(readonly), obj)


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
    completion event (the host does not block); ``Test`` queries the event."""

    def __init__(self, backend: "GpuBackend", event: int, algorithm: str, keep, host_request=None):
        self._b, self._event, self.algorithm, self._keep = backend, event, algorithm, keep
        self._host = host_request

    def Wait(self, timeout=None) -> None:
        if self._host is not None:          # engine-side failures of a host-transfer op
            if self._host.done:
                self._host.Wait(timeout=0)
        self._b.device.stream_wait_event(self._b.stream, self._event)

    def _wait(self, timeout=None) -> None:   # al.Waitall
        self.Wait(timeout)

    def Test(self) -> bool:
        return self._b.device.event_query(self._event)

    def __del__(self):
        try:
            self._b.device.event_destroy(self._event)
        except Exception:
            pass

    @property
    def done(self) -> bool:
        return self.Test()


class GpuBackend:
    """The GPU side of one Communicator (created on its first GPU op or by ``stream=``)."""

    def __init__(self, comm, stream):
        require_cuda("GPU communicator")
        try:
            import cupy
            ordinal = cupy.cuda.Device().id
        except Exception:
            ordinal = 0
        self.comm = comm
        self.stream = stream_handle(stream)
        self.device = _core.CudaDevice(ordinal)
        self._internal = None
        self._decider = None
        self._nccl_base = None
        self._nccl_pool: dict = {}

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
        return GpuRequest(self, ev, algorithm, keep, host_request)

    def close(self) -> None:
        """Destroy the NCCL communicators (Communicator.Free)."""
        for c in list(self._nccl_pool.values()) + [self._nccl_base]:
            if c is not None:
                c.destroy()
        self._nccl_pool.clear()
        self._nccl_base = None

    # -- NCCL communicators: the base one and the CTA-limited pool split from it
    def nccl_comm(self, min_ctas=None, max_ctas=None) -> nccl.NcclComm:
        if min_ctas is None and os.environ.get("AL_NCCL_MIN_CTAS"):
            min_ctas = int(os.environ["AL_NCCL_MIN_CTAS"])
        if max_ctas is None and os.environ.get("AL_NCCL_MAX_CTAS"):
            max_ctas = int(os.environ["AL_NCCL_MAX_CTAS"])
        if self._nccl_base is None:
            mpi = self.comm.mpi_comm
            uid = nccl.get_unique_id() if mpi.Get_rank() == 0 else None
            uid = mpi.bcast(uid, root=0)
            self._nccl_base = nccl.NcclComm(mpi.Get_size(), uid, mpi.Get_rank())
        if min_ctas is None and max_ctas is None:
            return self._nccl_base
        key = (min_ctas, max_ctas)
        if key not in self._nccl_pool:      # collective: every rank asks in the same order
            self._nccl_pool[key] = self._nccl_base.split(0, self.comm.rank, min_ctas=min_ctas,
                                                         max_ctas=max_ctas)
        return self._nccl_pool[key]

    # -- allreduce
    def choose(self, nbytes: int, itemsize: int) -> str:
        """auto for GPU buffers: the tuning table's "cuda" entries (NCCL vs host transfer, the
        paper's "minimal" hybrid), else NCCL when it loads, else host transfer."""
        if self._decider is None:         # collective, on the first GPU "auto" call
            from .communicator import tuning_data
            exact, _, params = tuning_data(self.comm.mpi_comm, self.comm.size,
                                           self.comm.local_size, "cuda")
            # only measured entries: the host cost model knows nothing of NCCL
            self._decider = tuning.Decider(self.comm.size, exact, {}, params, GPU_ALGORITHMS[1:])
        choice = self._decider.decide(nbytes, itemsize)
        if choice.source.startswith("table"):
            return choice.algorithm
        return "nccl" if nccl.available() else "ht_auto"

    def allreduce(self, sendbuf, recvbuf, op, algorithm: str, blocking: bool,
                  min_ctas=None, max_ctas=None):
        s = as_gpu_array(sendbuf, "sendbuf", writable=recvbuf is None)
        r = s if recvbuf is None else as_gpu_array(recvbuf, "recvbuf", writable=True)
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
            return None if blocking else self._join(stream, alg, keep)
        from .host_transfer import host_algorithm
        stream = self.stream if blocking else self._fork()
        nop = self.comm._launcher.host_transfer_allreduce(
            self.device, stream, s.ptr, r.ptr, s.count, DTYPE_CODES[s.dtype][0], s.dtype.itemsize,
            op.code, host_algorithm(alg), keep)
        from .request import Request
        req = Request(nop, alg)
        if blocking:
            return None         # the engine finishes it; the stream orders later work after it
        return self._join(stream, alg, keep, host_request=req)

    # -- the other collectives: NCCL's own, grouped send/recv where NCCL has none
    def _run(self, name: str, blocking: bool, keep, launch):
        comm = self.nccl_comm()
        stream = self.stream if blocking else self._fork()
        launch(comm, stream)
        return None if blocking else self._join(stream, "nccl", keep)

    def _pair(self, sendbuf, recvbuf, send_name="sendbuf"):
        s = as_gpu_array(sendbuf, send_name)
        r = s if recvbuf is None else as_gpu_array(recvbuf, "recvbuf", writable=True)
        if r.dtype != s.dtype:
            raise TypeError(f"recvbuf has dtype {r.dtype} but {send_name} has dtype {s.dtype}")
        return s, r

    def bcast(self, buf, root: int, blocking: bool):
        b = as_gpu_array(buf, "buf", writable=self.comm.rank != root)
        return self._run("bcast", blocking, (b.obj,), lambda c, st: c.broadcast(
            b.ptr, b.ptr, b.count, str(b.dtype), root, st))

    def reduce(self, sendbuf, recvbuf, op, root: int, blocking: bool):
        s, r = self._pair(sendbuf, recvbuf)
        if self.comm.rank == root and r.count < s.count:
            raise ValueError(f"recvbuf is too short: {r.count} elements, needs {s.count}")
        op = op if isinstance(op, Op) else as_op(op)
        check_op(op, DTYPE_CODES[s.dtype][0], s.dtype)
        if op.name not in _NCCL_OPS:
            raise TypeError(f"op: NCCL has no {op.name}")
        return self._run("reduce", blocking, (s.obj, r.obj), lambda c, st: c.reduce(
            s.ptr, r.ptr, s.count, str(s.dtype), _NCCL_OPS[op.name], root, st))

    def allgather(self, sendbuf, recvbuf, blocking: bool):
        s, r = self._pair(sendbuf, recvbuf)
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
        s = as_gpu_array(sendbuf, "sendbuf")
        dt, es, p = str(s.dtype), s.dtype.itemsize, self.comm.size
        sends = [(root, s.ptr, s.count, dt)]
        recvs = []
        keep = [s.obj]
        if self.comm.rank == root:
            r = as_gpu_array(recvbuf, "recvbuf", writable=True)
            if r.dtype != s.dtype or r.count < p * s.count:
                raise ValueError(f"recvbuf: needs {p * s.count} elements of {s.dtype}")
            recvs = [(j, r.ptr + j * s.count * es, s.count, dt) for j in range(p)]
            keep.append(r.obj)
        return self.exchange(sends, recvs, blocking, tuple(keep))

    def scatter(self, sendbuf, recvbuf, root: int, blocking: bool):
        r = as_gpu_array(recvbuf, "recvbuf", writable=True)
        dt, es, p = str(r.dtype), r.dtype.itemsize, self.comm.size
        sends, keep = [], [r.obj]
        if self.comm.rank == root:
            s = as_gpu_array(sendbuf, "sendbuf")
            if s.dtype != r.dtype or s.count < p * r.count:
                raise ValueError(f"sendbuf: needs {p * r.count} elements of {r.dtype}")
            sends = [(j, s.ptr + j * r.count * es, r.count, dt) for j in range(p)]
            keep.append(s.obj)
        return self.exchange(sends, [(root, r.ptr, r.count, dt)], blocking, tuple(keep))

    def send(self, buf, dest: int, blocking: bool):
        b = as_gpu_array(buf, "buf")
        return self.exchange([(dest, b.ptr, b.count, str(b.dtype))], [], blocking, (b.obj,))

    def recv(self, buf, source: int, blocking: bool):
        b = as_gpu_array(buf, "buf", writable=True)
        return self.exchange([], [(source, b.ptr, b.count, str(b.dtype))], blocking, (b.obj,))

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, blocking: bool):
        s, r = self._pair(sendbuf, recvbuf)
        return self.exchange([(dest, s.ptr, s.count, str(s.dtype))],
                             [(source, r.ptr, r.count, str(r.dtype))], blocking, (s.obj, r.obj))
