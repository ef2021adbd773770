"""The Communicator: every collective, blocking and I-prefixed nonblocking.

Every method has the same shape: normalise and check the buffers (``buffers``), check op and
dtype (``ops``), pick the algorithm, build one native op (``_core.make_op``), then ``_launch``
runs it in the caller (blocking, GIL released) or hands it to the progress engine (nonblocking).
"""
from __future__ import annotations

import operator

import numpy as np

from . import _core, config, schedules, tuning
from .algorithms import GPU_ALLREDUCE, HOST_ALLREDUCE, Selector
from .buffers import addr, as_array, at_least, no_overlap, no_partial_overlap, same_dtype
from .errors import Error, TimeoutError, UnavailableError
from .ops import AVG, DTYPE_CODES, OPS, OPS_FOR_KIND, SUM, Op, as_op, check_op
from .request import Request, _check
from .buffers import is_gpu_buffer
from .gpu import GpuBackend, cuda_device_count, require_cuda

K = _core.KINDS
_ndarray = np.ndarray
_MAX_COUNT = 2**31 - 1


class _Hooks:
    """What the native call path calls back for: unusual buffers, and every error message."""

    as_array = staticmethod(as_array)
    same_dtype = staticmethod(same_dtype)
    at_least = staticmethod(at_least)
    no_partial_overlap = staticmethod(no_partial_overlap)

    @staticmethod
    def fail(message):
        raise Error(message)

    @staticmethod
    def unavailable(message):
        raise UnavailableError(message)

    @staticmethod
    def request(op, algorithm):
        return Request(op, algorithm)

    @staticmethod
    def raise_error(op):
        _check(op)

    @staticmethod
    def raise_timeout(op, timeout):
        raise TimeoutError(f"{op.describe()}: not complete after {timeout:g} s "
                           f"(AL_HANG_TIMEOUT; a peer that never joined?)")

    @staticmethod
    def bad_algorithm(algorithm):
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm: expected a str, got {type(algorithm).__name__}")
        if algorithm in GPU_ALLREDUCE and cuda_device_count() == 0:
            raise UnavailableError(f"algorithm: {algorithm!r} is for GPU buffers and no CUDA "
                                   f"device is available")
        if algorithm in GPU_ALLREDUCE:
            raise ValueError(f"algorithm: {algorithm!r} is for GPU buffers; host buffers take "
                             f"{', '.join(HOST_ALLREDUCE)}")
        raise ValueError(f"algorithm: unknown algorithm {algorithm!r}; choose from "
                         f"{', '.join(HOST_ALLREDUCE)}")

    @staticmethod
    def check_op(opcode, code, dtype):
        check_op(OPS[opcode], code, dtype)

    @staticmethod
    def too_many(n, name):
        Communicator._count(n, name)


_core.configure(_Hooks(), {dt: c for dt, (c, _) in DTYPE_CODES.items()},
                [(c, o.code) for c, kind in DTYPE_CODES.values() for o in OPS_FOR_KIND[kind]])


_largest_local_size = 0


def _set_engine_yield(local_size: int) -> None:
    """The engine's polling policy: AL_ENGINE_YIELD, else by whether ranks outnumber cores
    (judged from the largest communicator created so far on this node)."""
    global _largest_local_size
    _largest_local_size = max(_largest_local_size, local_size)
    every = config.engine_yield()
    _core.set_poll_yield(config.default_engine_yield(_largest_local_size) if every is None else every)


def _nccl_p2p_args(tag, source, any_source) -> None:
    """GPU point-to-point goes through NCCL, which has neither tags nor wildcard sources."""
    if tag != 0:
        raise ValueError("tag: GPU buffers go through NCCL, which has no tags; use tag=0")
    if source is not None and source == any_source:
        raise ValueError("source: NCCL cannot receive from MPI.ANY_SOURCE; name the rank")


def tuning_data(base, size: int, local_size: int, buffer: str):
    """(exact entries, fitted parameters, model parameters) for `buffer` ("host"/"cuda"): rank
    0 reads the tuning table and broadcasts it, so every rank decides alike (collective; an
    error on rank 0 is raised on every rank, or the others would wait forever)."""
    data = None
    if base.Get_rank() == 0:
        try:
            table = tuning.load()
            exact, fitted = tuning.find_data(table, size, local_size, buffer, tuning.mpi_version())
            data = (exact, fitted, config.model_params())
        except Exception as e:
            data = e
    data = base.bcast(data, root=0)
    if isinstance(data, Exception):
        raise data
    return data


def _decider(base, size: int, local_size: int):
    """auto's decider for host buffers."""
    exact, fitted, params = tuning_data(base, size, local_size, "host")
    return tuning.Decider(size, exact, fitted, params, HOST_ALLREDUCE[1:])


class Communicator:
    """An MPI-style communicator for host (numpy / buffer-protocol) arrays.

    Duplicates the given mpi4py communicator (default ``MPI.COMM_WORLD``) twice: one copy for
    collectives and the library's own algorithm traffic, one for the user's Send/Recv, so neither
    can match the other's messages.  Construction is collective.

    Example (``mpiexec -n 4 python prog.py``)::

        import numpy as np, aluminum_py as al
        comm = al.Communicator()
        x = np.full(1000, comm.rank, dtype=np.float32)
        comm.Allreduce(x)                      # in place: x == sum(range(size))
        req = comm.Iallreduce(x, algorithm="ring"); ...; req.Wait()
    """

    def __init__(self, comm=None, *, stream=None):
        from mpi4py import MPI
        if stream is not None:
            require_cuda("stream=: a GPU communicator")
        if isinstance(comm, Communicator):
            comm = comm._coll
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Comm):
            raise TypeError(f"comm: expected an mpi4py communicator, got {type(base).__name__}")
        if base == MPI.COMM_NULL:
            raise ValueError("comm: MPI.COMM_NULL is not a communicator")
        self._coll = base.Dup()
        self._p2p = base.Dup()
        self._state = _core.CommState(self._coll, self._p2p)
        self.rank: int = self._state.rank
        self.size: int = self._state.size
        node = base.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = node.Get_rank()
        self.local_size: int = node.Get_size()
        node.Free()
        _set_engine_yield(self.local_size)
        self._selector = Selector(self.size, _decider(base, self.size, self.local_size))
        self._launcher = _core.Launcher(self._state, self._selector.choose, self._build_schedule,
                                        HOST_ALLREDUCE)
        self._any_source = MPI.ANY_SOURCE
        self._any_tag = MPI.ANY_TAG
        self._gpu = None if stream is None else GpuBackend(self, stream)

    def _gpu_for(self, buf, name: str):
        """The GPU backend if `buf` is a GPU buffer (created on first use), else None."""
        if buf is None or type(buf) is _ndarray or not is_gpu_buffer(buf):
            return None
        if self._gpu is None:
            require_cuda(f"{name} is a GPU buffer")
            self._gpu = GpuBackend(self, None)       # the default stream
        return self._gpu

    @property
    def stream(self):
        """The bound stream's handle (GPU communicators), else None."""
        return None if self._gpu is None else self._gpu.stream

    def __repr__(self) -> str:
        return f"<aluminum_py.Communicator rank {self.rank} of {self.size}>"

    @property
    def mpi_comm(self):
        """The mpi4py communicator used for collectives (do not send on it)."""
        return self._coll

    def Free(self) -> None:
        """Free the duplicated MPI communicators and the GPU backend's resources (collective; a
        second call does nothing). It first waits for the host parts of blocking host-transfer GPU
        ops (at most AL_HANG_TIMEOUT each); other pending ops (nonblocking host-transfer GPU ops
        included) are an error. Any later op on this communicator raises aluminum_py.Error. A
        failure of a blocking host-transfer op that no GPU op has reported yet is raised after
        everything is freed."""
        if self._state.freed:
            return
        if self._gpu is not None:
            self._gpu.drain(config.hang_timeout())
        if self._state.pending:
            raise Error(f"Free: {self._state.pending} operations are still pending")
        self._state.freed = True
        failure = self._gpu.close() if self._gpu is not None else None
        self._coll.Free()
        self._p2p.Free()
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------ helpers
    def _rank_arg(self, value, name: str) -> int:
        try:
            v = operator.index(value)
        except TypeError:
            raise TypeError(f"{name}: expected an int rank, got {type(value).__name__}") from None
        if not 0 <= v < self.size:
            raise ValueError(f"{name}: rank {v} is out of range for a communicator of size {self.size}")
        return v

    def _tag_arg(self, tag, allow_any: bool) -> int:
        try:
            t = operator.index(tag)
        except TypeError:
            raise TypeError(f"tag: expected an int, got {type(tag).__name__}") from None
        if allow_any and t == self._any_tag:
            return t
        if not 0 <= t <= 32767:
            raise ValueError(f"tag: {t} is out of range (0..32767)")
        return t

    @staticmethod
    def _count(n: int, name: str) -> int:
        if n > _MAX_COUNT:
            raise ValueError(f"{name}: {n} elements exceeds the limit of 2**31-1 per operation")
        return n

    def explain(self, nbytes: int, dtype="float32") -> "tuning.Choice":
        """Which algorithm ``algorithm="auto"`` picks for an Allreduce of `nbytes` bytes of
        `dtype`, and why (a tuning-table entry, an extrapolation, or the cost model).
        Local: no communication."""
        import numpy as np
        return self._selector.explain(int(nbytes), np.dtype(dtype).itemsize)

    def _build_schedule(self, alg: str, count: int, inplace: bool):
        steps, tmp = schedules.build(alg, self.size, self.rank, count, inplace)
        return _core.Schedule(steps, tmp)

    def _launch(self, op, blocking: bool, algorithm: str):
        return self._launcher.launch(op, blocking, config.hang_timeout_native(), algorithm)

    def _reduction(self, op, arr):
        op = as_op(op)
        code = DTYPE_CODES[arr.dtype][0]
        check_op(op, code, arr.dtype)
        return op, code

    # ------------------------------------------------------------------ allreduce
    def Allreduce(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "auto", *,
                  max_ctas: int | None = None, min_ctas: int | None = None) -> None:
        """Reduce `sendbuf` over all ranks into `recvbuf` on every rank (None: in place).

        Args:
            sendbuf: numpy array or C-contiguous buffer.
            recvbuf: output with at least sendbuf's element count and the same dtype, or None.
            op: al.SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR or AVG.
            algorithm: "auto", "mpi", "recursive_doubling", "rabenseifner" or "ring"; for GPU
                buffers "auto", "nccl" or "ht_*" (aluminum_py.gpu).
            max_ctas, min_ctas: GPU buffers with NCCL only: limits on the thread blocks NCCL
                uses (default AL_NCCL_MAX_CTAS / AL_NCCL_MIN_CTAS).
        Raises:
            TypeError / ValueError: bad arguments (before any communication).
            aluminum_py.TimeoutError: AL_HANG_TIMEOUT passed.  aluminum_py.MPIError: MPI failed.
        """
        if type(sendbuf) is not _ndarray:
            gpu = self._gpu_for(sendbuf, "sendbuf")
            if gpu is not None:
                gpu.allreduce(sendbuf, recvbuf, op, algorithm, True, min_ctas, max_ctas)
                return
        if max_ctas is not None or min_ctas is not None:
            raise ValueError("max_ctas/min_ctas: only for GPU buffers (NCCL thread-block limits)")
        self._launcher.allreduce(sendbuf, recvbuf, op.code if type(op) is Op else as_op(op).code,
                                 algorithm, True, config.hang_timeout_native())

    def Iallreduce(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "auto", *,
                   max_ctas: int | None = None, min_ctas: int | None = None) -> Request:
        """Nonblocking Allreduce: returns a Request at once; the engine progresses it (GPU
        buffers: a GpuRequest whose Wait makes the bound stream wait)."""
        if type(sendbuf) is not _ndarray:
            gpu = self._gpu_for(sendbuf, "sendbuf")
            if gpu is not None:
                return gpu.allreduce(sendbuf, recvbuf, op, algorithm, False, min_ctas, max_ctas)
        if max_ctas is not None or min_ctas is not None:
            raise ValueError("max_ctas/min_ctas: only for GPU buffers (NCCL thread-block limits)")
        return self._launcher.allreduce(sendbuf, recvbuf,
                                        op.code if type(op) is Op else as_op(op).code,
                                        algorithm, False, config.hang_timeout_native())

    # ------------------------------------------------------------------ reduce
    def _reduce(self, sendbuf, recvbuf, op, root, blocking):
        root = self._rank_arg(root, "root")
        gpu = self._gpu_for(sendbuf, "sendbuf")
        if gpu is not None:
            return gpu.reduce(sendbuf, recvbuf, op, root, blocking)
        at_root = self.rank == root
        s = as_array(sendbuf, "sendbuf", writable=at_root and recvbuf is None)
        op, code = self._reduction(op, s)
        count = self._count(s.size, "sendbuf")
        sp, rp, r = addr(s), 0, None
        if at_root:
            if recvbuf is None:
                r, sp = s, 0
            else:
                r = as_array(recvbuf, "recvbuf", writable=True)
                same_dtype(s, r, "sendbuf", "recvbuf")
                at_least(r, count, "recvbuf", "one element per sendbuf element")
                if no_partial_overlap(s, r, "sendbuf", "recvbuf"):
                    sp = 0
            rp = addr(r)
        avg = float(self.size) if (op is AVG and at_root) else 0.0
        nop = _core.make_op(self._state, K["reduce"], "reduce", sp, rp, count, code, s.itemsize,
                            op.code, root=root, avg_div=avg, avg_buf=rp, avg_cnt=count,
                            keep=(s, r))
        return self._launch(nop, blocking, "mpi")

    def Reduce(self, sendbuf, recvbuf=None, op=SUM, root: int = 0) -> None:
        """Reduce onto `root`. recvbuf matters at root only (None there: in place in sendbuf)."""
        self._reduce(sendbuf, recvbuf, op, root, True)

    def Ireduce(self, sendbuf, recvbuf=None, op=SUM, root: int = 0) -> Request:
        return self._reduce(sendbuf, recvbuf, op, root, False)

    # ------------------------------------------------------------------ reduce_scatter
    def _reduce_scatter(self, sendbuf, recvbuf, op, blocking):
        gpu = self._gpu_for(sendbuf, "sendbuf")
        if gpu is not None:
            return gpu.reduce_scatter(sendbuf, recvbuf, op, blocking)
        s = as_array(sendbuf, "sendbuf", writable=recvbuf is None)
        if s.size % self.size:
            raise ValueError(f"sendbuf: {s.size} elements is not divisible by the communicator "
                             f"size {self.size}")
        op, code = self._reduction(op, s)
        n = self._count(s.size // self.size, "recvbuf")
        if recvbuf is None:
            r, sp = s, 0
        else:
            r = as_array(recvbuf, "recvbuf", writable=True)
            same_dtype(s, r, "sendbuf", "recvbuf")
            at_least(r, n, "recvbuf", "len(sendbuf) // size")
            sp = 0 if no_partial_overlap(s, r, "sendbuf", "recvbuf") else addr(s)
        rp = addr(r)
        avg = float(self.size) if op is AVG else 0.0
        nop = _core.make_op(self._state, K["reduce_scatter"], "reduce_scatter", sp, rp, n, code,
                            s.itemsize, op.code, avg_div=avg, avg_buf=rp, avg_cnt=n, keep=(s, r))
        return self._launch(nop, blocking, "mpi")

    def Reduce_scatter(self, sendbuf, recvbuf=None, op=SUM) -> None:
        """Block reduce-scatter: rank i gets block i (len(sendbuf)//size elements) of the
        reduction. recvbuf None: in place, the result lands in sendbuf[:len//size]."""
        self._reduce_scatter(sendbuf, recvbuf, op, True)

    def Ireduce_scatter(self, sendbuf, recvbuf=None, op=SUM) -> Request:
        return self._reduce_scatter(sendbuf, recvbuf, op, False)

    # ------------------------------------------------------------------ data movement
    def _blocks_in_place(self, buf, name):
        """In-place form of a gather-like op: `buf` holds `size` blocks."""
        b = as_array(buf, name, writable=True)
        if b.size % self.size:
            raise ValueError(f"{name}: {b.size} elements is not divisible by the communicator "
                             f"size {self.size}")
        return b, b.size // self.size

    def _move(self, kind, name, s, r, n, blocking, root=0):
        """Launch a data-movement op: s/r are arrays or None (None sendbuf: MPI_IN_PLACE)."""
        arr = s if s is not None else r
        code = DTYPE_CODES[arr.dtype][0]
        nop = _core.make_op(self._state, K[kind], name, 0 if s is None else addr(s),
                            0 if r is None else addr(r), self._count(n, "count"), code,
                            arr.itemsize, 0, root=root, keep=(s, r))
        return self._launch(nop, blocking, "mpi")

    def _allgather(self, sendbuf, recvbuf, blocking):
        gpu = self._gpu_for(sendbuf, "sendbuf")
        if gpu is not None:
            return gpu.allgather(sendbuf, recvbuf, blocking)
        if recvbuf is None:
            r, n = self._blocks_in_place(sendbuf, "sendbuf")
            return self._move("allgather", "allgather", None, r, n, blocking)
        s = as_array(sendbuf, "sendbuf")
        r = as_array(recvbuf, "recvbuf", writable=True)
        same_dtype(s, r, "sendbuf", "recvbuf")
        at_least(r, self.size * s.size, "recvbuf", "size * len(sendbuf)")
        no_overlap(s, r, "sendbuf", "recvbuf")
        return self._move("allgather", "allgather", s, r, s.size, blocking)

    def Allgather(self, sendbuf, recvbuf=None) -> None:
        """Every rank gets every rank's sendbuf, concatenated in rank order.
        recvbuf None: in place, sendbuf holds size blocks with this rank's at block `rank`."""
        self._allgather(sendbuf, recvbuf, True)

    def Iallgather(self, sendbuf, recvbuf=None) -> Request:
        return self._allgather(sendbuf, recvbuf, False)

    def _bcast(self, buf, root, blocking):
        root = self._rank_arg(root, "root")
        gpu = self._gpu_for(buf, "buf")
        if gpu is not None:
            return gpu.bcast(buf, root, blocking)
        b = as_array(buf, "buf", writable=self.rank != root)
        nop = _core.make_op(self._state, K["bcast"], "bcast", 0, addr(b), self._count(b.size, "buf"),
                            DTYPE_CODES[b.dtype][0], b.itemsize, 0, root=root, keep=(b,))
        return self._launch(nop, blocking, "mpi")

    def Bcast(self, buf, root: int = 0) -> None:
        """Broadcast root's `buf` into `buf` on every rank."""
        self._bcast(buf, root, True)

    def Ibcast(self, buf, root: int = 0) -> Request:
        return self._bcast(buf, root, False)

    def _alltoall(self, sendbuf, recvbuf, blocking):
        gpu = self._gpu_for(sendbuf, "sendbuf")
        if gpu is not None:
            return gpu.alltoall(sendbuf, recvbuf, blocking)
        if recvbuf is None:
            r, n = self._blocks_in_place(sendbuf, "sendbuf")
            return self._move("alltoall", "alltoall", None, r, n, blocking)
        s = as_array(sendbuf, "sendbuf")
        if s.size % self.size:
            raise ValueError(f"sendbuf: {s.size} elements is not divisible by the communicator "
                             f"size {self.size}")
        r = as_array(recvbuf, "recvbuf", writable=True)
        same_dtype(s, r, "sendbuf", "recvbuf")
        at_least(r, s.size, "recvbuf", "len(sendbuf)")
        no_overlap(s, r, "sendbuf", "recvbuf")
        return self._move("alltoall", "alltoall", s, r, s.size // self.size, blocking)

    def Alltoall(self, sendbuf, recvbuf=None) -> None:
        """Block j of sendbuf goes to rank j; block i of recvbuf comes from rank i."""
        self._alltoall(sendbuf, recvbuf, True)

    def Ialltoall(self, sendbuf, recvbuf=None) -> Request:
        return self._alltoall(sendbuf, recvbuf, False)

    def _gather(self, sendbuf, recvbuf, root, blocking):
        root = self._rank_arg(root, "root")
        gpu = self._gpu_for(sendbuf, "sendbuf")
        if gpu is not None:
            return gpu.gather(sendbuf, recvbuf, root, blocking)
        if self.rank != root:
            s = as_array(sendbuf, "sendbuf")
            return self._move("gather", "gather", s, None, s.size, blocking, root)
        if recvbuf is None:
            r, n = self._blocks_in_place(sendbuf, "sendbuf")
            return self._move("gather", "gather", None, r, n, blocking, root)
        s = as_array(sendbuf, "sendbuf")
        r = as_array(recvbuf, "recvbuf", writable=True)
        same_dtype(s, r, "sendbuf", "recvbuf")
        at_least(r, self.size * s.size, "recvbuf", "size * len(sendbuf)")
        no_overlap(s, r, "sendbuf", "recvbuf")
        return self._move("gather", "gather", s, r, s.size, blocking, root)

    def Gather(self, sendbuf, recvbuf=None, root: int = 0) -> None:
        """Concatenate every rank's sendbuf at root. recvbuf matters at root only; None there:
        in place, sendbuf holds size blocks with root's own at block `root`."""
        self._gather(sendbuf, recvbuf, root, True)

    def Igather(self, sendbuf, recvbuf=None, root: int = 0) -> Request:
        return self._gather(sendbuf, recvbuf, root, False)

    def _scatter(self, sendbuf, recvbuf, root, blocking):
        root = self._rank_arg(root, "root")
        gpu = self._gpu_for(recvbuf, "recvbuf")
        if gpu is not None:
            return gpu.scatter(sendbuf, recvbuf, root, blocking)
        if self.rank != root:
            if recvbuf is None:
                raise TypeError("recvbuf: required on non-root ranks")
            r = as_array(recvbuf, "recvbuf", writable=True)
            nop_s = r   # sendbuf is not significant here
            return self._move("scatter", "scatter", nop_s, r, r.size, blocking, root)
        s = as_array(sendbuf, "sendbuf")
        if s.size % self.size:
            raise ValueError(f"sendbuf: {s.size} elements is not divisible by the communicator "
                             f"size {self.size}")
        n = s.size // self.size
        if recvbuf is None:
            return self._move("scatter", "scatter", s, None, n, blocking, root)
        r = as_array(recvbuf, "recvbuf", writable=True)
        same_dtype(s, r, "sendbuf", "recvbuf")
        at_least(r, n, "recvbuf", "len(sendbuf) // size")
        no_overlap(s, r, "sendbuf", "recvbuf")
        return self._move("scatter", "scatter", s, r, n, blocking, root)

    def Scatter(self, sendbuf, recvbuf=None, root: int = 0) -> None:
        """Block i of root's sendbuf goes to rank i's recvbuf (whose length sets the count on
        non-roots). At root recvbuf None: in place, root's block stays in sendbuf."""
        self._scatter(sendbuf, recvbuf, root, True)

    def Iscatter(self, sendbuf, recvbuf=None, root: int = 0) -> Request:
        return self._scatter(sendbuf, recvbuf, root, False)

    def _barrier(self, blocking):
        nop = _core.make_op(self._state, K["barrier"], "barrier", 0, 0, 0, 0, 1, 0)
        return self._launch(nop, blocking, "mpi")

    def Barrier(self) -> None:
        self._barrier(True)

    def Ibarrier(self) -> Request:
        return self._barrier(False)

    # ------------------------------------------------------------------ point to point
    def _send(self, buf, dest, tag, blocking):
        dest = self._rank_arg(dest, "dest")
        gpu = self._gpu_for(buf, "buf")
        if gpu is not None:
            _nccl_p2p_args(tag, None, self._any_source)
            return gpu.send(buf, dest, blocking)
        b = as_array(buf, "buf")
        nop = _core.make_op(self._state, K["send"], "send", addr(b), 0, self._count(b.size, "buf"),
                            DTYPE_CODES[b.dtype][0], b.itemsize, 0, root=dest,
                            tag=self._tag_arg(tag, False), keep=(b,))
        return self._launch(nop, blocking, "mpi")

    def Send(self, buf, dest: int, tag: int = 0) -> None:
        """Send `buf` to rank `dest` (messages on this communicator never match collectives)."""
        self._send(buf, dest, tag, True)

    def Isend(self, buf, dest: int, tag: int = 0) -> Request:
        return self._send(buf, dest, tag, False)

    def _source(self, source):
        try:
            v = operator.index(source)
        except TypeError:
            raise TypeError(f"source: expected an int rank or MPI.ANY_SOURCE, got "
                            f"{type(source).__name__}") from None
        if v == self._any_source:
            return v
        return self._rank_arg(v, "source")

    def _recv(self, buf, source, tag, blocking):
        source = self._source(source)
        gpu = self._gpu_for(buf, "buf")
        if gpu is not None:
            _nccl_p2p_args(tag, source, self._any_source)
            return gpu.recv(buf, source, blocking)
        b = as_array(buf, "buf", writable=True)
        nop = _core.make_op(self._state, K["recv"], "recv", 0, addr(b), self._count(b.size, "buf"),
                            DTYPE_CODES[b.dtype][0], b.itemsize, 0, root=source,
                            tag=self._tag_arg(tag, True), keep=(b,))
        return self._launch(nop, blocking, "mpi")

    def Recv(self, buf, source: int, tag: int = 0) -> None:
        """Receive into `buf` from rank `source` (or MPI.ANY_SOURCE); tag may be MPI.ANY_TAG."""
        self._recv(buf, source, tag, True)

    def Irecv(self, buf, source: int, tag: int = 0) -> Request:
        return self._recv(buf, source, tag, False)

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag, blocking):
        dest = self._rank_arg(dest, "dest")
        source = self._source(source)
        gpu = self._gpu_for(sendbuf, "sendbuf")
        if gpu is not None:
            _nccl_p2p_args(tag, source, self._any_source)
            return gpu.sendrecv(sendbuf, dest, recvbuf, source, blocking)
        s = as_array(sendbuf, "sendbuf")
        r = as_array(recvbuf, "recvbuf", writable=True)
        same_dtype(s, r, "sendbuf", "recvbuf")
        no_overlap(s, r, "sendbuf", "recvbuf", "Sendrecv needs separate send and receive buffers")
        nop = _core.make_op(self._state, K["sendrecv"], "sendrecv", addr(s), addr(r),
                            self._count(s.size, "sendbuf"), DTYPE_CODES[s.dtype][0], s.itemsize, 0,
                            root=dest, count2=self._count(r.size, "recvbuf"), peer2=source,
                            tag=self._tag_arg(tag, False), keep=(s, r))
        return self._launch(nop, blocking, "mpi")

    def Sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        """Send to `dest` and receive from `source` at once (no deadlock in a ring)."""
        self._sendrecv(sendbuf, dest, recvbuf, source, tag, True)

    def Isendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> Request:
        return self._sendrecv(sendbuf, dest, recvbuf, source, tag, False)
