"""The Communicator: the public API of every collective, blocking and I-prefixed nonblocking.

Every method is one line: pick the backend from the buffer (:mod:`aluminum_py.backends`: host
buffers to the host backend, GPU buffers to the GPU backend, made on first use) and delegate;
the backend checks everything (ranks, roots, tags, buffers, the algorithm). For a numpy array
the host backend's method is the native entry itself (``_core.HostCollectives``), picked with
one type test, so no other Python runs on the latency-critical path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import _core, config, timeline
from .backends.gpu import GpuBackend
from .backends.host import HostBackend, rank_arg, source_arg
from .backends.host_transfer import HostTransfer
from .errors import Error, ThreadLevelWarning
from .gpu import is_gpu_buffer, require_cuda
from .ops import SUM
from .request import Request

if TYPE_CHECKING:
    from .tuning import Choice

_ndarray = np.ndarray


def _warn_thread_level() -> None:
    import warnings
    from mpi4py import MPI
    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
    level = _core.thread_level()
    warnings.warn(f"aluminum_py: MPI provides {names.get(level, level)}, not "
                  f"MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level lowered, or the MPI library "
                  f"cannot provide it): nonblocking operations (I-calls) and blocking calls "
                  f"that must queue or time out will raise aluminum_py.Error, and no two "
                  f"threads may call the library (or MPI) at the same time",
                  ThreadLevelWarning, stacklevel=3)


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
        _core.check_not_forked("Communicator()")
        if stream is not None:
            require_cuda("stream=: a GPU communicator")
        if isinstance(comm, Communicator):
            if comm._state.freed:
                raise ValueError("comm: the aluminum_py.Communicator has been freed")
            comm = comm._coll
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Comm):
            raise TypeError(f"comm: expected an mpi4py communicator, got {type(base).__name__}")
        if base == MPI.COMM_NULL:
            raise ValueError("comm: MPI.COMM_NULL is not a communicator")
        if base.Is_inter():         # local: every rank refuses, before any communication
            raise TypeError("comm: an intercommunicator is not supported (collectives here run "
                            "within one group); pass an intracommunicator, e.g. "
                            "intercomm.Merge()")
        self._coll = base.Dup()
        self._p2p = base.Dup()
        self._state = _core.CommState(self._coll, self._p2p)
        if not _core.thread_multiple():
            _warn_thread_level()
        self.rank: int = self._state.rank
        self.size: int = self._state.size
        node = base.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = node.Get_rank()
        self.local_size: int = node.Get_size()
        self._any_source = MPI.ANY_SOURCE
        self._host = HostBackend(self._state, base, self.local_size, MPI.ANY_SOURCE, MPI.ANY_TAG,
                                 node)          # kept for "shm" on one node, else freed
        self._calls = self._host.calls           # the native entries: numpy arrays' path
        self._allreduce = self._calls.allreduce
        self._gpu = None if stream is None else self._make_gpu(stream)
        self._check = None
        if self._host.check_calls:          # AL_CHECK: a communicator for the signatures
            from .check import CallChecker
            self._check = base.Dup()
            self._host.launcher.checker = CallChecker(self._check, self._state)
        timeline.on_communicator(self)      # recording: the clock sync (collective)

    def _make_gpu(self, stream, device=None) -> GpuBackend:
        return GpuBackend(self._host.launcher, self._p2p, self.rank, self.size, self.local_size,
                          stream, device)

    def _backend_for(self, buf, name: str):
        """The backend for `buf`: the GPU backend (made on first use, on the default stream) for
        a GPU buffer, else the host backend."""
        if buf is None or type(buf) is _ndarray or not is_gpu_buffer(buf):
            return self._host
        _core.check_not_forked(f"{name} is a GPU buffer")    # before any CUDA or NCCL call
        if self._gpu is None:
            require_cuda(f"{name} is a GPU buffer")
            self._gpu = self._make_gpu(None)
        return self._gpu

    def _bind_gpu(self, device, stream: int) -> None:
        """A GPU backend on `device` bound to `stream` (aluminum_py.host_transfer.bind)."""
        if self._gpu is not None:
            raise ValueError("comm: the communicator already has a GPU backend")
        self._gpu = self._make_gpu(stream, device)

    def _host_transfer(self, device) -> HostTransfer:
        """The host-transfer allreduce of this communicator on `device`
        (aluminum_py.host_transfer.allreduce)."""
        return HostTransfer(self._host.launcher, device)

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

    def bind_thread(self) -> None:
        """Make the calling thread the communicator's owner: from now on only this thread may
        start calls on it (collectives, point-to-point, Free; ``Wait``/``Test`` of requests
        and reading attributes are allowed from any thread).  The thread that constructed the
        communicator owns it first.  Local: no communication; every rank hands over on its own.
        Raises aluminum_py.Error while another thread is inside a blocking call on it (only an
        erroneous program sees that).  See docs/semantics.md, "Threads"."""
        self._state.bind_thread()

    def Free(self) -> None:
        """Free the duplicated MPI communicators and the GPU backend's resources (collective; a
        second call does nothing). It first waits for the host parts of blocking host-transfer GPU
        ops (at most AL_HANG_TIMEOUT each); other pending ops (nonblocking host-transfer GPU ops
        included) are an error, and so is a call in progress in another thread (aluminum_py.Error:
        the shared memory is never unmapped under a running op). Only the owner thread may call
        it (bind_thread). Any later op on this communicator raises aluminum_py.Error. A
        failure of a blocking host-transfer op that no GPU op has reported yet is raised after
        everything is freed."""
        if self._state.freed:
            return
        self._state.check_free("Free")
        if self._gpu is not None:
            self._gpu.drain(config.hang_timeout())
        if self._state.pending:
            raise Error(f"Free: {self._state.pending} operations are still pending")
        self._state.freed = True
        failure = self._gpu.close() if self._gpu is not None else None
        self._host.close()
        if self._check is not None:
            self._check.Free()
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------ helpers
    def _rank_arg(self, value, name: str) -> int:
        return rank_arg(value, name, self.size)

    def _source(self, source) -> int:
        """`source` as a rank or MPI.ANY_SOURCE (else the error naming it)."""
        return source_arg(source, self.size)

    def explain(self, nbytes: int, dtype="float32") -> "Choice":
        """Which algorithm ``algorithm="auto"`` picks for an Allreduce of `nbytes` bytes of
        `dtype`, and why (a tuning-table entry, an extrapolation, or the cost model).
        Local: no communication."""
        return self._host.explain(int(nbytes), np.dtype(dtype).itemsize)

    # ------------------------------------------------------------------ allreduce
    def Allreduce(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "auto", *,
                  max_ctas: int | None = None, min_ctas: int | None = None) -> None:
        """Reduce `sendbuf` over all ranks into `recvbuf` on every rank (None: in place).

        Args:
            sendbuf: numpy array or C-contiguous buffer.
            recvbuf: output with at least sendbuf's element count and the same dtype, or None.
            op: al.SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR or AVG.
            algorithm: "auto", "mpi", "recursive_doubling", "rabenseifner", "ring",
                "hierarchical", "shm" (ranks of one node only) or "hierarchical_p2p"
                ("hierarchical" without the nodes' shared memory); for GPU buffers "auto",
                "nccl" or "ht_*" (aluminum_py.gpu).
            max_ctas, min_ctas: GPU buffers with NCCL only: limits on the thread blocks NCCL
                uses (default AL_NCCL_MAX_CTAS / AL_NCCL_MIN_CTAS).
        Raises:
            TypeError / ValueError: bad arguments (before any communication).
            aluminum_py.UnavailableError: "shm" on a communicator spanning nodes.
            aluminum_py.TimeoutError: AL_HANG_TIMEOUT passed.  aluminum_py.MPIError: MPI failed.
        """
        (self._allreduce if type(sendbuf) is _ndarray else
         self._backend_for(sendbuf, "sendbuf").allreduce)(sendbuf, recvbuf, op, algorithm, True,
                                                          min_ctas, max_ctas)

    def Iallreduce(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "auto", *,
                   max_ctas: int | None = None, min_ctas: int | None = None) -> Request:
        """Nonblocking Allreduce: returns a Request at once; the engine progresses it (GPU
        buffers: a GpuRequest whose Wait makes the bound stream wait)."""
        return (self._allreduce if type(sendbuf) is _ndarray else
                self._backend_for(sendbuf, "sendbuf").allreduce)(sendbuf, recvbuf, op, algorithm,
                                                                 False, min_ctas, max_ctas)

    # ------------------------------------------------------------------ reduce
    def Reduce(self, sendbuf, recvbuf=None, op=SUM, root: int = 0) -> None:
        """Reduce onto `root`. recvbuf matters at root only (None there: in place in sendbuf)."""
        self._backend_for(sendbuf, "sendbuf").reduce(sendbuf, recvbuf, op, root, True)

    def Ireduce(self, sendbuf, recvbuf=None, op=SUM, root: int = 0) -> Request:
        return self._backend_for(sendbuf, "sendbuf").reduce(sendbuf, recvbuf, op, root, False)

    # ------------------------------------------------------------------ reduce_scatter
    def Reduce_scatter(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "mpi") -> None:
        """Block reduce-scatter: rank i gets block i (len(sendbuf)//size elements) of the
        reduction. recvbuf None: in place, the result lands in sendbuf[:len//size].
        algorithm: "mpi" (the MPI library's) or "shm" (the shared-memory transport: host
        buffers, ranks of one node; aluminum_py.UnavailableError otherwise); the same on every
        rank. So for every collective below that takes it."""
        (self._calls if type(sendbuf) is _ndarray else self._backend_for(sendbuf, "sendbuf")
         ).reduce_scatter(sendbuf, recvbuf, op, True, algorithm)

    def Ireduce_scatter(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "mpi") -> Request:
        return (self._calls if type(sendbuf) is _ndarray else self._backend_for(sendbuf, "sendbuf")
                ).reduce_scatter(sendbuf, recvbuf, op, False, algorithm)

    # ------------------------------------------------------------------ data movement
    def Allgather(self, sendbuf, recvbuf=None, algorithm: str = "mpi") -> None:
        """Every rank gets every rank's sendbuf, concatenated in rank order.
        recvbuf None: in place, sendbuf holds size blocks with this rank's at block `rank`.
        algorithm: "mpi" or "shm" (as Reduce_scatter's)."""
        (self._calls if type(sendbuf) is _ndarray else self._backend_for(sendbuf, "sendbuf")
         ).allgather(sendbuf, recvbuf, True, algorithm)

    def Iallgather(self, sendbuf, recvbuf=None, algorithm: str = "mpi") -> Request:
        return (self._calls if type(sendbuf) is _ndarray else self._backend_for(sendbuf, "sendbuf")
                ).allgather(sendbuf, recvbuf, False, algorithm)

    def Bcast(self, buf, root: int = 0, algorithm: str = "mpi") -> None:
        """Broadcast root's `buf` into `buf` on every rank. algorithm: "mpi" or "shm" (as
        Reduce_scatter's)."""
        (self._calls if type(buf) is _ndarray else self._backend_for(buf, "buf")
         ).bcast(buf, root, True, algorithm)

    def Ibcast(self, buf, root: int = 0, algorithm: str = "mpi") -> Request:
        return (self._calls if type(buf) is _ndarray else self._backend_for(buf, "buf")
                ).bcast(buf, root, False, algorithm)

    def Alltoall(self, sendbuf, recvbuf=None) -> None:
        """Block j of sendbuf goes to rank j; block i of recvbuf comes from rank i."""
        self._backend_for(sendbuf, "sendbuf").alltoall(sendbuf, recvbuf, True)

    def Ialltoall(self, sendbuf, recvbuf=None) -> Request:
        return self._backend_for(sendbuf, "sendbuf").alltoall(sendbuf, recvbuf, False)

    def Gather(self, sendbuf, recvbuf=None, root: int = 0) -> None:
        """Concatenate every rank's sendbuf at root. recvbuf matters at root only; None there:
        in place, sendbuf holds size blocks with root's own at block `root`."""
        self._backend_for(sendbuf, "sendbuf").gather(sendbuf, recvbuf, root, True)

    def Igather(self, sendbuf, recvbuf=None, root: int = 0) -> Request:
        return self._backend_for(sendbuf, "sendbuf").gather(sendbuf, recvbuf, root, False)

    def Scatter(self, sendbuf, recvbuf=None, root: int = 0) -> None:
        """Block i of root's sendbuf goes to rank i's recvbuf (whose length sets the count on
        non-roots). At root recvbuf None: in place, root's block stays in sendbuf."""
        self._backend_for(recvbuf, "recvbuf").scatter(sendbuf, recvbuf, root, True)

    def Iscatter(self, sendbuf, recvbuf=None, root: int = 0) -> Request:
        return self._backend_for(recvbuf, "recvbuf").scatter(sendbuf, recvbuf, root, False)

    def Barrier(self, algorithm: str = "mpi") -> None:
        """Wait until every rank called it. algorithm: "mpi" or "shm" (as Reduce_scatter's)."""
        self._host.barrier(True, algorithm)

    def Ibarrier(self, algorithm: str = "mpi") -> Request:
        return self._host.barrier(False, algorithm)

    # ------------------------------------------------------------------ point to point
    def Send(self, buf, dest: int, tag: int = 0) -> None:
        """Send `buf` to rank `dest` (messages on this communicator never match collectives)."""
        self._backend_for(buf, "buf").send(buf, dest, tag, True)

    def Isend(self, buf, dest: int, tag: int = 0) -> Request:
        return self._backend_for(buf, "buf").send(buf, dest, tag, False)

    def Recv(self, buf, source: int, tag: int = 0) -> None:
        """Receive into `buf` from rank `source` (or MPI.ANY_SOURCE); tag may be MPI.ANY_TAG."""
        self._backend_for(buf, "buf").recv(buf, source, tag, True)

    def Irecv(self, buf, source: int, tag: int = 0) -> Request:
        return self._backend_for(buf, "buf").recv(buf, source, tag, False)

    def Sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        """Send to `dest` and receive from `source` at once (no deadlock in a ring)."""
        self._backend_for(sendbuf, "sendbuf").sendrecv(sendbuf, dest, recvbuf, source, tag, True)

    def Isendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> Request:
        return self._backend_for(sendbuf, "sendbuf").sendrecv(sendbuf, dest, recvbuf, source, tag,
                                                              False)
