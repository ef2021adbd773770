"""The Communicator: the public API of every collective, blocking and I-prefixed nonblocking.

Every method is one line: pick the backend from the buffer (:mod:`aluminum_py.backends`: host
buffers to the host backend, GPU buffers to the GPU backend, made on first use) and delegate;
the backend checks everything (ranks, roots, tags, buffers, the algorithm). For a numpy array
the host backend's method is the native entry itself (``_core.HostCollectives``), picked with
one type test, so no other Python runs on the latency-critical path.
"""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import numpy as np

from . import _core, config, timeline, topology
from .backends.gpu_backend import GpuBackend
from .backends.host import HostBackend, source_arg
from .backends.ht_enqueue import HostTransfer
from .buffers import _IN_PLACE, unless_in_place, vspec
from .errors import Error, ThreadLevelWarning, TimeoutError
from .gpu import is_gpu_buffer, require_cuda
from .ops import SUM
from .request import Request
from .status import ANY_SOURCE, ANY_TAG, Status, fill, status_arg

if TYPE_CHECKING:
    from .tuning import Choice

_ndarray = np.ndarray

# The duplicates and requests of constructions that timed out: MPI forbids freeing a pending
# nonblocking collective's request, and a late rank's duplicate may still match them.
_TIMED_OUT: list = []


def _duplicate(base, timeout: float | None):
    """Two duplicates of `base` (collective: MPI_Comm_idup, twice), then a barrier over the
    first, every wait bounded by `timeout` seconds (None: no bound).  The barrier is over the
    new communicator, which only this construction's ranks use: a rank that comes after the
    others timed out may complete its duplicates against their abandoned ones, and then times
    out in the barrier instead of going on alone.  MPI's errors (no communicator left) raise
    aluminum_py.Error; a wait past `timeout` raises aluminum_py.TimeoutError."""
    from mpi4py import MPI
    deadline = None if timeout is None else time.monotonic() + timeout
    made, reqs = [], []
    try:
        for _ in range(2):
            c, r = base.Idup()
            made.append(c)
            reqs.append(r)
        _bounded(reqs, deadline, timeout, made, "MPI_Comm_idup")
        reqs = [made[0].Ibarrier()]
        _bounded(reqs, deadline, timeout, made, "the barrier over the duplicates")
    except MPI.Exception as e:
        _TIMED_OUT.append((made, reqs))
        raise Error(f"Communicator(): MPI could not duplicate the communicator: {e} (MPI has "
                    f"no communicator left? Free() the Communicators you no longer use)") from None
    return made


def _bounded(reqs, deadline, timeout, made, what) -> None:
    """Wait for the MPI requests `reqs` until `deadline` (time.monotonic; None: for ever),
    polling with naps of up to 1 ms (Ctrl-C is raised between them)."""
    from mpi4py import MPI
    nap = 0.0
    while not _test_all(MPI, reqs):
        if deadline is not None and time.monotonic() > deadline:
            _TIMED_OUT.append((made, reqs))
            raise TimeoutError(
                f"Communicator(): not every rank of the communicator came within "
                f"AL_HANG_TIMEOUT={timeout:g} s ({what} not complete): a rank is late or does "
                f"not call Communicator(); the communicator passed is now out of step (its "
                f"ranks' collectives no longer match), so end the program")
        time.sleep(nap)
        nap = min(2 * nap or 1e-5, 1e-3)


def _test_all(MPI, reqs) -> bool:
    """MPI_Testall of `reqs`; a failure raises MPI's error of the failed request (MPICH's
    "Too many communicators"), not MPI_ERR_IN_STATUS's generic one."""
    statuses = [MPI.Status() for _ in reqs]
    try:
        return MPI.Request.Testall(reqs, statuses)
    except MPI.Exception as e:
        codes = [c for c in (st.Get_error() for st in statuses) if c != MPI.SUCCESS]
        if e.Get_error_class() == MPI.ERR_IN_STATUS and codes:
            raise MPI.Exception(codes[0]) from None
        raise


class _Held:
    """What a Communicator holds that Free() releases: kept apart from the Communicator, so
    that a Communicator dropped without Free() leaves it to :func:`_reclaim`."""

    __slots__ = ("state", "host", "gpu", "check")

    def __init__(self, state):
        self.state, self.host, self.gpu, self.check = state, None, None, None

    def release(self):
        """Free everything (nothing pending); the first unreported GPU failure, or None."""
        failure = self.gpu.close() if self.gpu is not None else None
        if self.host is not None:
            self.host.close()
        else:                       # construction failed before the backend took them
            self.state.coll_comm.Free()
            self.state.p2p_comm.Free()
        if self.check is not None:
            self.check.Free()
        return failure


_dropped: list = []     # _Held of Communicators dropped without Free(), freed by _reclaim


def _reclaim() -> None:
    """Free what the Communicators dropped without Free() held, at the next construction, once
    none of their ops is pending (those wait for a later one).  Freeing is local (munmap and
    MPI_Comm_free, which MPI libraries implement without communication), so ranks that drop a
    communicator at different times stay safe; the MPI context ids come back for the next
    duplicates.  One with a GPU backend is kept (NCCL's teardown is not for a collector)."""
    keep = []
    while _dropped:
        held = _dropped.pop()
        if held.state.pending or held.gpu is not None:
            keep.append(held)
            continue
        held.state.freed = True
        held.release()
    _dropped.extend(keep)


def _drop(held: _Held) -> None:
    """A Communicator was collected without Free(): no MPI call here (the collector runs at any
    point of any thread); :func:`_reclaim` frees it later."""
    if not held.state.freed:
        _dropped.append(held)


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
        _reclaim()
        self._coll, self._p2p = _duplicate(base, config.hang_timeout())
        self._state = _core.CommState(self._coll, self._p2p)
        held = self._held = _Held(self._state)
        try:
            self._construct(base, stream, held)
        except BaseException as e:
            # every rank fails construction at the same point (settings are compared first)
            self._state.freed = True
            topo = getattr(self, "_topology", None)
            node = topo.take_node_comm() if topo is not None else None
            if node is not None:
                node.Free()
            if not self._state.pending:
                held.release()
            from mpi4py import MPI
            if isinstance(e, MPI.Exception):    # e.g. MPI out of communicators in a split
                raise Error(f"Communicator(): MPI failed during construction (no communicator "
                            f"left? Free() the Communicators you no longer use): {e}") from None
            raise
        # dropped without Free(): its MPI communicators are freed at a later construction
        weakref.finalize(self, _drop, held).atexit = False

    def _construct(self, base, stream, held: _Held) -> None:
        from mpi4py import MPI
        if not _core.thread_multiple():
            _warn_thread_level()
        self.rank: int = self._state.rank
        self.size: int = self._state.size
        self._topology = topology.compute(base)     # where the ranks run: once, collective
        self.local_rank: int = self._topology.local_rank
        self.local_size: int = self._topology.local_size
        self._any_source = MPI.ANY_SOURCE
        held.host = self._host = HostBackend(self._state, base, self._topology, MPI.ANY_SOURCE,
                                             MPI.ANY_TAG)
        self._calls = self._host.calls           # the native entries: numpy arrays' path
        self._allreduce = self._calls.allreduce
        self._gpu = None
        if stream is not None:
            held.gpu = self._gpu = self._make_gpu(stream)
        self._check = None
        if self._host.check_calls:          # AL_CHECK: a communicator for the signatures
            from .check import CallChecker
            held.check = self._check = base.Dup()
            self._host.launcher.checker = CallChecker(self._check, self._state)
        timeline.on_communicator(self)      # recording: the clock sync (collective)

    def _make_gpu(self, stream, device=None) -> GpuBackend:
        return GpuBackend(self._host.launcher, self._p2p, self.rank, self.size, self._topology,
                          stream, device)

    def _backend_for(self, buf, name: str):
        """The backend for `buf`: the GPU backend (made on first use, on the default stream) for
        a GPU buffer, else the host backend."""
        if buf is None or type(buf) is _ndarray or not is_gpu_buffer(buf):
            return self._host
        return self._gpu_backend(f"{name} is a GPU buffer")

    def _gpu_backend(self, what: str) -> GpuBackend:
        """The GPU backend, made on first use (on the default stream)."""
        _core.check_not_forked(what)        # before any CUDA or NCCL call
        if self._gpu is None:
            require_cuda(what)
            self._held.gpu = self._gpu = self._make_gpu(None)
        return self._gpu

    def _bind_gpu(self, device, stream: int) -> None:
        """A GPU backend on `device` bound to `stream` (aluminum_py.host_transfer.bind)."""
        if self._gpu is not None:
            raise ValueError("comm: the communicator already has a GPU backend")
        self._held.gpu = self._gpu = self._make_gpu(stream, device)

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

    @property
    def timeout(self) -> float | None:
        """Seconds this communicator's blocking host calls (and ``Probe``) wait before raising
        aluminum_py.TimeoutError; None (the default): AL_HANG_TIMEOUT (1800 s unless set; 0: no
        limit).
        ``Request.Wait`` takes its own ``timeout``.  Local: set it on every rank (the torch
        backend sets the process group's timeout here)."""
        return self._calls.timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        if seconds is not None:
            seconds = float(seconds)
            if not seconds > 0:
                raise ValueError(f"timeout: expected seconds > 0 or None, got {seconds!r}")
        self._calls.timeout = seconds

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
        failure = self._held.release()
        if failure is not None:
            raise failure

    # ------------------------------------------------------------------ helpers
    def _source(self, source) -> int:
        """`source` as a rank or MPI.ANY_SOURCE (else the error naming it)."""
        return source_arg(source, self.size)

    def explain(self, nbytes: int, dtype="float32") -> "Choice":
        """Which algorithm ``algorithm="auto"`` picks for an Allreduce of `nbytes` bytes of
        `dtype`, and which rule decided: the cost model, a tuning-table override (with its
        measured margin) or, with one choice only, "forced".
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
         self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf").allreduce)(
            sendbuf, recvbuf, op, algorithm, True, min_ctas, max_ctas)

    def Iallreduce(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "auto", *,
                   max_ctas: int | None = None, min_ctas: int | None = None) -> Request:
        """Nonblocking Allreduce: returns a Request at once; the engine progresses it (GPU
        buffers: a GpuRequest whose Wait makes the bound stream wait)."""
        return (self._allreduce if type(sendbuf) is _ndarray else
                self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf").allreduce)(
            sendbuf, recvbuf, op, algorithm, False, min_ctas, max_ctas)

    # ------------------------------------------------------------------ reduce
    def Reduce(self, sendbuf, recvbuf=None, op=SUM, root: int = 0) -> None:
        """Reduce onto `root`. recvbuf matters at root only (None there: in place in sendbuf)."""
        self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf").reduce(sendbuf, recvbuf, op, root, True)

    def Ireduce(self, sendbuf, recvbuf=None, op=SUM, root: int = 0) -> Request:
        return self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf").reduce(sendbuf, recvbuf, op, root, False)

    # ------------------------------------------------------------------ reduce_scatter
    def Reduce_scatter(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "mpi", *,
                       recvcounts=None) -> None:
        """Block reduce-scatter: rank i gets block i (len(sendbuf)//size elements) of the
        reduction. recvbuf None: in place, the result lands in sendbuf[:len//size].
        algorithm: "mpi" (the MPI library's) or "shm" (the shared-memory transport: host
        buffers, ranks of one node; aluminum_py.UnavailableError otherwise); the same on every
        rank. So for every collective below that takes it.
        With per-rank counts (recvcounts=, or recvbuf as [buf, counts]): rank i gets
        recvcounts[i] elements, sendbuf holds sum(recvcounts) (see _reduce_scatterv)."""
        if recvcounts is not None or isinstance(recvbuf, (list, tuple)):
            self._reduce_scatterv(sendbuf, recvbuf, op, recvcounts, True, algorithm)
            return
        (self._calls if type(sendbuf) is _ndarray else self._vbackend(sendbuf, "sendbuf", recvbuf,
                                                                      "recvbuf")
         ).reduce_scatter(sendbuf, recvbuf, op, True, algorithm)

    def Ireduce_scatter(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "mpi", *,
                        recvcounts=None) -> Request:
        if recvcounts is not None or isinstance(recvbuf, (list, tuple)):
            return self._reduce_scatterv(sendbuf, recvbuf, op, recvcounts, False, algorithm)
        return (self._calls if type(sendbuf) is _ndarray else
                self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf")).reduce_scatter(sendbuf, recvbuf, op, False, algorithm)

    # ------------------------------------------------------------------ data movement
    def Allgather(self, sendbuf, recvbuf=None, algorithm: str = "mpi") -> None:
        """Every rank gets every rank's sendbuf, concatenated in rank order.
        recvbuf None: in place, sendbuf holds size blocks with this rank's at block `rank`.
        algorithm: "mpi" or "shm" (as Reduce_scatter's)."""
        (self._calls if type(sendbuf) is _ndarray else
         self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf")).allgather(sendbuf, recvbuf, True, algorithm)

    def Iallgather(self, sendbuf, recvbuf=None, algorithm: str = "mpi") -> Request:
        return (self._calls if type(sendbuf) is _ndarray else
                self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf")).allgather(sendbuf, recvbuf, False, algorithm)

    def Bcast(self, buf, root: int = 0, algorithm: str = "mpi") -> None:
        """Broadcast root's `buf` into `buf` on every rank. algorithm: "mpi" or "shm" (as
        Reduce_scatter's)."""
        (self._calls if type(buf) is _ndarray else self._backend_for(buf, "buf")
         ).bcast(buf, root, True, algorithm)

    def Ibcast(self, buf, root: int = 0, algorithm: str = "mpi") -> Request:
        return (self._calls if type(buf) is _ndarray else self._backend_for(buf, "buf")
                ).bcast(buf, root, False, algorithm)

    def Alltoall(self, sendbuf, recvbuf=None, algorithm: str = "mpi") -> None:
        """Block j of sendbuf goes to rank j; block i of recvbuf comes from rank i. recvbuf
        None: in place. algorithm: "mpi", "shm" (as Reduce_scatter's) or "auto" ("shm" where
        the communicator has a segment and it measured faster at this size:
        algorithms.shm_preferred)."""
        self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf").alltoall(sendbuf, recvbuf, True, algorithm)

    def Ialltoall(self, sendbuf, recvbuf=None, algorithm: str = "mpi") -> Request:
        return self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf").alltoall(sendbuf, recvbuf, False, algorithm)

    def Gather(self, sendbuf, recvbuf=None, root: int = 0) -> None:
        """Concatenate every rank's sendbuf at root. recvbuf matters at root only; None there:
        in place, sendbuf holds size blocks with root's own at block `root`."""
        self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf").gather(sendbuf, recvbuf, root, True)

    def Igather(self, sendbuf, recvbuf=None, root: int = 0) -> Request:
        return self._vbackend(sendbuf, "sendbuf", recvbuf, "recvbuf").gather(sendbuf, recvbuf, root, False)

    def Scatter(self, sendbuf, recvbuf=None, root: int = 0) -> None:
        """Block i of root's sendbuf goes to rank i's recvbuf (whose length sets the count on
        non-roots). At root recvbuf None: in place, root's block stays in sendbuf."""
        self._vbackend(recvbuf, "recvbuf", sendbuf, "sendbuf").scatter(sendbuf, recvbuf, root, True)

    def Iscatter(self, sendbuf, recvbuf=None, root: int = 0) -> Request:
        return self._vbackend(recvbuf, "recvbuf", sendbuf, "sendbuf").scatter(sendbuf, recvbuf, root, False)

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

    def _recv(self, buf, source, tag, blocking, status):
        status_arg(status)                      # the backend checks source and tag
        backend = self._backend_for(buf, "buf")
        if backend is not self._host:
            if status is not None:
                raise ValueError("status: not available for a GPU buffer (the receive "
                                 "completes on the stream, after the call returns)")
            if tag == ANY_TAG:      # NCCL has no tags: every message has the one it matches
                tag = 0
        got = backend.recv(buf, source, tag, blocking)
        return fill(status, got) if isinstance(got, Status) else got

    def Recv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG,
             status: Status | None = None) -> Status | None:
        """Receive into `buf` from rank `source` (or al.ANY_SOURCE) with tag `tag` (or
        al.ANY_TAG); the message may be shorter than `buf` (Status.count says how long), not
        longer (aluminum_py.MPIError naming both lengths).

        Returns:
            The receive's aluminum_py.Status (source, tag, count in elements), also written
            into `status` if given (host buffers; a GPU buffer returns None).
        """
        return self._recv(buf, source, tag, True, status)

    def Irecv(self, buf, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        """Nonblocking Recv: the Request's Wait(status=) / Test(status=) fill a Status, and
        ``request.status`` holds it once complete."""
        return self._recv(buf, source, tag, False, None)

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag, blocking, sendtag, recvtag,
                  status):
        status_arg(status)                      # the backend checks dest, source and tags
        backend = self._backend_for(sendbuf, "sendbuf")
        if backend is not self._host:
            if sendtag is not None:
                tag = sendtag
            if status is not None or recvtag not in (None, ANY_TAG, tag):
                raise ValueError(f"{'status' if status is not None else 'recvtag'}: not "
                                 f"available for GPU buffers (NCCL: no tags, no status)")
            return backend.sendrecv(sendbuf, dest, recvbuf, source, tag, blocking)
        got = backend.sendrecv(sendbuf, dest, recvbuf, source, tag, blocking, recvtag, sendtag)
        if not isinstance(got, Status):
            return got
        if status is not None:
            fill(status, got)
        return None

    def Sendrecv(self, sendbuf, dest: int, recvbuf, source: int = ANY_SOURCE, tag: int = 0, *,
                 sendtag: int | None = None, recvtag: int | None = None,
                 status: Status | None = None) -> None:
        """Send to `dest` and receive from `source` at once (no deadlock in a ring).
        `tag` is both tags; `sendtag` / `recvtag` set them apart (recvtag may be al.ANY_TAG,
        source al.ANY_SOURCE). `status`: filled with the receive's Status (host buffers)."""
        return self._sendrecv(sendbuf, dest, recvbuf, source, tag, True, sendtag, recvtag,
                              status)

    # ------------------------------------------------------------------ v-collectives
    # Allgatherv, Gatherv, Scatterv, Alltoallv and Reduce_scatter with per-rank counts:
    # mpi4py's argument forms ([buf, counts], [buf, counts, displs], [buf, (counts, displs)],
    # or buf with the keywords) split once (buffers.vspec, whose usual forms are _core.vsplit's),
    # MPI.IN_PLACE and None both mean in place; the backend of the first buffer given checks
    # everything else.  Counts and displacements are in elements; displs None: the blocks
    # packed in rank order.

    def _vbackend(self, a, aname: str, b, bname: str):
        """The backend of `a`, or of `b` where `a` is None or MPI.IN_PLACE (in place: the
        data in `b`)."""
        if type(a) is _ndarray:             # the usual case, without a call
            return self._host
        return (self._backend_for(a, aname) if a is not None and a is not _IN_PLACE
                else self._backend_for(b, bname))

    def _allgatherv(self, sendbuf, recvbuf, recvcounts, displs, algorithm, blocking):
        rbuf, counts, displs = vspec(recvbuf, "recvbuf", recvcounts, displs)
        s = unless_in_place(sendbuf)
        return self._vbackend(s, "sendbuf", rbuf, "recvbuf").allgatherv(
            s, rbuf, counts, displs, blocking, algorithm)

    def Allgatherv(self, sendbuf, recvbuf, *, recvcounts=None, displs=None,
                   algorithm: str = "auto") -> None:
        """Every rank's sendbuf lands in every rank's recvbuf, rank i's block at displs[i]
        with recvcounts[i] elements (recvbuf: buf, [buf, counts] or [buf, counts, displs]).
        sendbuf None or MPI.IN_PLACE: in place, this rank's block already at displs[rank].
        Out of place, len(sendbuf) must equal recvcounts[rank].  algorithm: "mpi", "shm" (the
        node's segment) or "auto" ("shm" where there is a segment)."""
        self._allgatherv(sendbuf, recvbuf, recvcounts, displs, algorithm, True)

    def Iallgatherv(self, sendbuf, recvbuf, *, recvcounts=None, displs=None,
                    algorithm: str = "auto") -> Request:
        return self._allgatherv(sendbuf, recvbuf, recvcounts, displs, algorithm, False)

    def _gatherv(self, sendbuf, recvbuf, root, recvcounts, displs, blocking):
        rbuf, counts, displs = vspec(recvbuf, "recvbuf", recvcounts, displs)
        s = unless_in_place(sendbuf)
        return self._vbackend(s, "sendbuf", rbuf, "recvbuf").gatherv(
            s, rbuf, counts, displs, root, blocking)

    def Gatherv(self, sendbuf, recvbuf=None, root: int = 0, *, recvcounts=None,
                displs=None) -> None:
        """Every rank's sendbuf lands in root's recvbuf, rank i's block at displs[i] with
        recvcounts[i] elements. recvbuf and its counts matter at root only; at root sendbuf
        None or MPI.IN_PLACE: in place, root's block already at displs[root]."""
        self._gatherv(sendbuf, recvbuf, root, recvcounts, displs, True)

    def Igatherv(self, sendbuf, recvbuf=None, root: int = 0, *, recvcounts=None,
                 displs=None) -> Request:
        return self._gatherv(sendbuf, recvbuf, root, recvcounts, displs, False)

    def _scatterv(self, sendbuf, recvbuf, root, sendcounts, displs, blocking):
        sbuf, counts, displs = vspec(sendbuf, "sendbuf", sendcounts, displs)
        r = unless_in_place(recvbuf)
        return self._vbackend(r, "recvbuf", sbuf, "sendbuf").scatterv(
            sbuf, r, counts, displs, root, blocking)

    def Scatterv(self, sendbuf, recvbuf, root: int = 0, *, sendcounts=None,
                 displs=None) -> None:
        """Block i of root's sendbuf (sendcounts[i] elements at displs[i]) lands in rank i's
        recvbuf, whose length is the count received off the root. sendbuf and its counts
        matter at root only; at root recvbuf None or MPI.IN_PLACE: in place, root's block
        stays in sendbuf."""
        self._scatterv(sendbuf, recvbuf, root, sendcounts, displs, True)

    def Iscatterv(self, sendbuf, recvbuf, root: int = 0, *, sendcounts=None,
                  displs=None) -> Request:
        return self._scatterv(sendbuf, recvbuf, root, sendcounts, displs, False)

    def _alltoallv(self, sendbuf, recvbuf, sendcounts, sdispls, recvcounts, rdispls, algorithm,
                   blocking):
        """numpy arrays in mpi4py's usual forms are split and run natively (alltoallv_msg: a
        small call costs about what mpi4py's does); what it leaves, the other forms and GPU
        buffers, is split in Python and run on the buffers' backend."""
        req = self._host.alltoallv_msg(sendbuf, recvbuf, sendcounts, sdispls, recvcounts,
                                       rdispls, blocking, algorithm)
        if req is not NotImplemented:
            return req
        sbuf, scounts, sdispls = vspec(unless_in_place(sendbuf), "sendbuf", sendcounts, sdispls)
        rbuf, rcounts, rdispls = vspec(recvbuf, "recvbuf", recvcounts, rdispls)
        return self._vbackend(sbuf, "sendbuf", rbuf, "recvbuf").alltoallv(
            sbuf, scounts, sdispls, rbuf, rcounts, rdispls, blocking, algorithm)

    def Alltoallv(self, sendbuf, recvbuf, *, sendcounts=None, sdispls=None, recvcounts=None,
                  rdispls=None, algorithm: str = "auto") -> None:
        """Block j of sendbuf (sendcounts[j] elements at sdispls[j]) goes to rank j; block i of
        recvbuf (recvcounts[i] at rdispls[i]) comes from rank i (each buffer: buf,
        [buf, counts] or [buf, counts, displs]). sendbuf None or MPI.IN_PLACE: in place,
        recvbuf's layout for both sides.  algorithm: "mpi", "shm" (the node's segment) or
        "auto" (= "mpi": algorithms.shm_preferred)."""
        self._alltoallv(sendbuf, recvbuf, sendcounts, sdispls, recvcounts, rdispls, algorithm,
                        True)

    def Ialltoallv(self, sendbuf, recvbuf, *, sendcounts=None, sdispls=None, recvcounts=None,
                   rdispls=None, algorithm: str = "auto") -> Request:
        return self._alltoallv(sendbuf, recvbuf, sendcounts, sdispls, recvcounts, rdispls,
                               algorithm, False)

    def _reduce_scatterv(self, sendbuf, recvbuf, op, recvcounts, blocking, algorithm):
        """Reduce_scatter with per-rank counts: rank i gets recvcounts[i] elements of the
        reduction of every rank's sendbuf (exactly sum(recvcounts) elements). In place:
        sendbuf MPI.IN_PLACE or None (the data in recvbuf), or recvbuf None (the data in
        sendbuf); the result lands at the start of the data's buffer."""
        rbuf, counts, displs = vspec(recvbuf, "recvbuf", recvcounts)
        if displs is not None:
            raise TypeError("recvbuf: Reduce_scatter takes counts, not displacements")
        s = unless_in_place(sendbuf)
        return self._vbackend(s, "sendbuf", rbuf, "recvbuf").reduce_scatterv(
            s, rbuf, counts, op, blocking, algorithm=algorithm)

    # ------------------------------------------------------------------ point to point
    def Isendrecv(self, sendbuf, dest: int, recvbuf, source: int = ANY_SOURCE, tag: int = 0, *,
                  sendtag: int | None = None, recvtag: int | None = None) -> Request:
        return self._sendrecv(sendbuf, dest, recvbuf, source, tag, False, sendtag, recvtag,
                              None)

    def p2p_group(self):
        """``with comm.p2p_group(): ...``: the nonblocking point-to-point calls on GPU buffers
        in the block (Isend, Irecv, Isendrecv) launch as one NCCL group when it ends; inside
        it, waiting for their requests or any other GPU operation on the communicator raises
        aluminum_py.Error. Without it, consecutive such calls are one group already, launched
        at the first Wait/Test of one of them or the next other GPU operation (docs/gpu.md,
        "Point-to-point: one NCCL group per batch"). Needs a CUDA device."""
        return self._gpu_backend("p2p_group").p2p_group()

    # ------------------------------------------------------------------ scans
    def _scan(self, kind, sendbuf, recvbuf, op, blocking, algorithm):
        if unless_in_place(sendbuf) is None:    # mpi4py's form: in place in recvbuf
            sendbuf, recvbuf = recvbuf, None
        return getattr(self._backend_for(sendbuf, "sendbuf"), kind)(sendbuf, recvbuf, op,
                                                                    blocking,
                                                                    algorithm=algorithm)

    def Scan(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "auto") -> None:
        """Inclusive prefix reduction: rank r gets op over ranks 0..r's sendbufs (MPI_Scan).
        recvbuf None (or sendbuf None / MPI.IN_PLACE, mpi4py's form): in place. AVG: the sum over ranks 0..r divided by r + 1.
        algorithm: "auto" or "mpi" (the MPI library's own)."""
        self._scan("scan", sendbuf, recvbuf, op, True, algorithm)

    def Iscan(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "auto") -> Request:
        return self._scan("scan", sendbuf, recvbuf, op, False, algorithm)

    def Exscan(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "auto") -> None:
        """Exclusive prefix reduction: rank r > 0 gets op over ranks 0..r-1's sendbufs
        (MPI_Exscan). Rank 0's recvbuf (in place: its sendbuf), which MPI leaves undefined, is
        left untouched. AVG: the sum over ranks 0..r-1 divided by r."""
        self._scan("exscan", sendbuf, recvbuf, op, True, algorithm)

    def Iexscan(self, sendbuf, recvbuf=None, op=SUM, algorithm: str = "auto") -> Request:
        return self._scan("exscan", sendbuf, recvbuf, op, False, algorithm)

    # ------------------------------------------------------------------ probe
    def _probe(self, source, tag, status, blocking, timeout, name):
        source = self._source(source)
        status_arg(status)
        found = self._host.probe(source, tag, blocking, timeout, name)
        return None if found is None else fill(status, found)

    def Probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
              status: Status | None = None, timeout: float | None = None) -> Status:
        """Wait until a message from `source` with `tag` (wildcards allowed) can be received,
        without receiving it; its Status (count in bytes: ``Get_count(dtype)`` gives
        elements), also written into `status`. A Recv from ``status.source`` with
        ``status.tag`` then receives that message.

        Raises:
            aluminum_py.TimeoutError: none came within `timeout` seconds (None:
                AL_HANG_TIMEOUT, 1800 s unless set; 0: wait forever).
        """
        return self._probe(source, tag, status, True, timeout, "Probe")

    def Iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG,
               status: Status | None = None) -> Status | None:
        """Probe without waiting: the Status of a matching message, or None if there is none
        yet (`status` is filled only when there is one)."""
        return self._probe(source, tag, status, False, None, "Iprobe")
