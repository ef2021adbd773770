"""The GPU backend: collectives and point-to-point on GPU buffers of one communicator, bound to
one stream; NCCL runs them (:mod:`aluminum_py.nccl`), or, for allreduce, the host-transfer
algorithms (:mod:`.ht_enqueue`). Semantics: docs/gpu.md and docs/semantics.md."""
from __future__ import annotations

import threading
import time

from mpi4py import MPI

from .. import config, nccl, timeline, tuning
from .._core import in_place_form
from ..algorithms import GPU_ALLREDUCE, GPU_CANDIDATES, REGISTRY
from ..buffers import MAX_COUNT, vlayout, vno_overlap
from ..errors import Error, TimeoutError, UnavailableError
from ..gpu import (GpuArray, GpuRequest, InFlight, _retain_if_abandoned, _retire_freed,
                   as_gpu_array, cuda_device, current_device, require_cuda, retire_later,
                   stream_handle)
from ..ops import DTYPE_CODES, Op, as_op, check_op
from ..request import Request
from . import nccl_rules
from .host import collective_algorithm, rank_arg, source_arg
from .ht_enqueue import HostTransfer


class GpuBackend:
    """GPU buffers of one Communicator (made on its first GPU op, or by ``stream=``).

    Args:
        launcher: the communicator's native launcher (``_core.Launcher``): it runs the host
            part of host-transfer ops on the communicator's MPI communicator.
        p2p_comm: the communicator's point-to-point MPI communicator; the backend's control
            communicator (NCCL unique id, tuning data) is duplicated from it on first use.
        rank, size: this rank, the communicator's size.
        topo: where the ranks run (``topology.Topology``, made once by the Communicator):
            the ranks on this node, the node layout that keys the tuning table.
        stream: the bound stream (a cupy/torch stream or a raw handle; None: the default).
        device: the device interface (default: the CUDA device of `current_device()`); the
            tests pass an ``aluminum_py.host_transfer.CpuDevice`` and a CPU stream's handle.
    """

    def __init__(self, launcher, p2p_comm, rank: int, size: int, topo, stream,
                 device=None):
        if device is None:
            require_cuda("GPU communicator")
            device = cuda_device(current_device())
        self.rank, self.size, self.local_size = rank, size, topo.local_size
        self.topology = topo
        self._p2p = p2p_comm
        self._any_source, self._any_tag = MPI.ANY_SOURCE, MPI.ANY_TAG
        self.stream = stream_handle(stream)
        self.device = device
        self._state = launcher.state        # the communicator's: the threading rule
        self.host_transfer = HostTransfer(launcher, device)
        self.inflight = InFlight(device)    # buffers of enqueued ops, until they completed
        self._internal = None
        self._chooser = None                # GPU "auto", made on its first use (collective)
        self._nccl_base = None
        self._nccl_pool: dict = {}
        self._ctl = None                    # control traffic (NCCL id, tuning data)
        self._unreported: list = []         # Requests of blocking host-transfer ops
        self._check = config.check()        # AL_CHECK: v-collectives agree across ranks first
        self._batch: P2PBatch | None = None  # nonblocking point-to-point calls not launched yet
        self._group_depth = 0               # nesting of p2p_group() blocks
        self._batch_lock = threading.Lock()  # launches may come from Wait in another thread

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

    def usable(self, name: str, joins: bool = False) -> None:
        """At every GPU operation: the communicator's rules (the owner thread calls, not freed,
        not broken: CommState.check_usable), then check(); then, unless the op `joins` the
        point-to-point batch, the batch is launched first (inside p2p_group: refused)."""
        if self._state.freed or self._state.owner != threading.get_ident() or self._state.marked:
            self._state.check_usable(name)
        self.check()
        if not joins and (self._batch is not None or self._group_depth):
            self._refuse_in_group(name)
            self.flush()

    def check(self) -> None:
        """At every GPU operation on the communicator: release the buffers of completed ops,
        then raise the first failure, not reported yet, of an earlier host-transfer op whose
        host part has finished (blocking ops, and nonblocking ones whose Wait came first)."""
        self.inflight.retire()
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
            self._ctl = self._p2p.Dup()
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
        flight on it. A pending point-to-point batch is launched first. Returns the first
        unreported failure of a blocking host-transfer op (or of launching the batch, or of
        freeing the pool), for Free to raise once everything is released."""
        launched = None
        try:
            self.flush()
        except Error as e:
            launched = e
        self.inflight.retire()
        if self.inflight.pending:
            retire_later(self.inflight)         # released at a later GPU op, once complete
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
        failure = launched
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
    def nccl_comm(self, min_ctas=None, max_ctas=None) -> nccl.NcclComm:
        min_ctas, max_ctas = nccl_rules.cta_limits(min_ctas, max_ctas)
        if self._nccl_base is None:
            mpi = self.control_comm()
            uid = nccl.get_unique_id() if mpi.Get_rank() == 0 else None
            uid = mpi.bcast(uid, root=0)
            # with AL_HANG_TIMEOUT, a nonblocking communicator: its creation, splits and calls
            # are then waited for with that timeout instead of blocking inside NCCL
            self._nccl_base = nccl.NcclComm(mpi.Get_size(), uid, mpi.Get_rank(),
                                            blocking=nccl_rules.blocking_mode())
        if min_ctas is None and max_ctas is None:
            return self._nccl_base
        key = (min_ctas, max_ctas)
        if key not in self._nccl_pool:      # collective: every rank asks in the same order
            self._nccl_pool[key] = self._nccl_base.split(0, self.rank, min_ctas=min_ctas,
                                                         max_ctas=max_ctas,
                                                         blocking=nccl_rules.blocking_mode())
        return self._nccl_pool[key]

    # -- allreduce
    def choose(self, algorithm: str, nbytes: int, itemsize: int) -> str:
        """`algorithm` itself if it is a GPU algorithm; for "auto": the tuning table's "cuda"
        entries (NCCL vs host transfer, the paper's "minimal" hybrid), else NCCL when it loads,
        else host transfer (docs/gpu.md, "Allreduce algorithms for GPU buffers")."""
        if algorithm != "auto":
            if algorithm in GPU_ALLREDUCE:
                return algorithm
            raise ValueError(f"algorithm: {algorithm!r} is not a GPU algorithm; GPU buffers take "
                             f"{', '.join(GPU_ALLREDUCE)}")
        if self._chooser is None:         # collective, on the first GPU "auto" call
            data = tuning.shared_data(self.control_comm(), "cuda", self.topology.layout)
            # the host cost model knows nothing of NCCL: NCCL where it loads, else host
            # transfer, overridden where the "cuda" entries measured so
            self._chooser = tuning.Chooser.from_data(data, GPU_CANDIDATES, model=tuning.gpu_model)
        return self._chooser.choose(nbytes, itemsize)

    def allreduce(self, sendbuf, recvbuf, op, algorithm: str, blocking: bool,
                  min_ctas=None, max_ctas=None):
        self.usable("allreduce")
        sendbuf, recvbuf = in_place_form(sendbuf, recvbuf)
        s = self._arr(sendbuf, "sendbuf", writable=recvbuf is None)
        r = s if recvbuf is None else self._arr(recvbuf, "recvbuf", writable=True)
        if r.dtype != s.dtype:
            raise TypeError(f"recvbuf has dtype {r.dtype} but sendbuf has dtype {s.dtype}")
        if r.count < s.count:
            raise ValueError(f"recvbuf is too short: {r.count} elements, needs {s.count}")
        op = op if isinstance(op, Op) else as_op(op)
        check_op(op, DTYPE_CODES[s.dtype][0], s.dtype)
        alg = self.choose(algorithm, s.nbytes, s.dtype.itemsize)
        if alg == "nccl" and algorithm == "auto" and (op.name not in nccl_rules.NCCL_OP_NAMES
                                                       or str(s.dtype) not in nccl.DTYPES):
            alg = "ht_auto"                 # NCCL lacks this op or dtype: host transfer can
        keep = (s.obj, r.obj)
        if REGISTRY[alg].backend == "nccl":
            nccl_op = nccl_rules.op_name(op, "; use a host-transfer algorithm")
            comm = self.nccl_comm(min_ctas, max_ctas)
            stream = self.stream if blocking else self._fork()
            t_call = time.monotonic()
            comm.allreduce(s.ptr, r.ptr, s.count, str(s.dtype), nccl_op, stream)
            if timeline.recording():
                timeline.record_enqueued("allreduce/nccl", t_call, stream, s.nbytes,
                                         str(s.dtype), op.name)
            return self._enqueued(stream, blocking, alg, keep)
        stream = self.stream if blocking else self._fork()
        nop = self.host_transfer.allreduce(stream, s.ptr, r.ptr, s.count, DTYPE_CODES[s.dtype][0],
                                           s.dtype.itemsize, op.code, alg, keep)
        req = Request(nop, alg)
        if blocking:            # the engine finishes it; the stream orders later work after it
            self._unreported.append(req)
            return None
        return self._join(stream, alg, keep, host_request=req)

    # -- the other collectives: NCCL's own, grouped send/recv where NCCL has none
    def _call(self, what: str, algorithm, name: str, root=None):
        """What a collective checks before its buffers: `algorithm` (GPU buffers take "mpi",
        and "auto" where the host form has it: NCCL runs both; "shm" is for host buffers) and the root (checked, returned)."""
        if algorithm != "mpi" and algorithm != "auto":     # both run NCCL
            if algorithm == "shm":
                raise ValueError(f"algorithm: 'shm' is for host buffers; {name} is a GPU buffer "
                                 f"(GPU buffers take 'mpi')")
            collective_algorithm(what, algorithm, ("mpi",))
        return None if root is None else rank_arg(root, "root", self.size)

    def _run(self, name: str, blocking: bool, keep, launch):
        self.usable(name)
        comm = self.nccl_comm()
        stream = self.stream if blocking else self._fork()
        t_call = time.monotonic()
        launch(comm, stream)
        if timeline.recording():
            timeline.record_enqueued(name, t_call, stream)
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

    def bcast(self, buf, root: int, blocking: bool, algorithm="mpi"):
        root = self._call("bcast", algorithm, "buf", root)
        b = self._arr(buf, "buf", writable=self.rank != root)
        return self._run("bcast", blocking, (b.obj,), lambda c, st: c.broadcast(
            b.ptr, b.ptr, b.count, str(b.dtype), root, st))

    def reduce(self, sendbuf, recvbuf, op, root: int, blocking: bool, algorithm="mpi"):
        """recvbuf matters at root only, as for host buffers: elsewhere it is not read (NCCL
        ignores the receive pointer there), so a rank's bad recvbuf cannot fail it alone."""
        root = self._call("reduce", algorithm, "sendbuf", root)
        if self.rank == root:
            s, r = self._pair(*in_place_form(sendbuf, recvbuf))
            if r.count < s.count:
                raise ValueError(f"recvbuf is too short: {r.count} elements, needs {s.count}")
        else:
            s = r = self._arr(sendbuf, "sendbuf")
        op = op if isinstance(op, Op) else as_op(op)
        check_op(op, DTYPE_CODES[s.dtype][0], s.dtype)
        nccl_op = nccl_rules.op_name(op)
        return self._run("reduce", blocking, (s.obj, r.obj), lambda c, st: c.reduce(
            s.ptr, r.ptr, s.count, str(s.dtype), nccl_op, root, st))

    def allgather(self, sendbuf, recvbuf, blocking: bool, algorithm="mpi"):
        self._call("allgather", algorithm, "sendbuf")
        sendbuf, recvbuf = in_place_form(sendbuf, recvbuf)
        s, r = self._pair(sendbuf, recvbuf)
        if recvbuf is None and s.count % self.size:
            raise ValueError(f"sendbuf: {s.count} elements is not divisible by the communicator "
                             f"size {self.size} (in place, it holds one block per rank)")
        n = s.count if recvbuf is not None else s.count // self.size
        if r.count < n * self.size:
            raise ValueError(f"recvbuf is too short: {r.count} elements, needs {n * self.size}")
        src = s.ptr if recvbuf is not None else s.ptr + self.rank * n * s.dtype.itemsize
        return self._run("allgather", blocking, (s.obj, r.obj), lambda c, st: c.allgather(
            src, r.ptr, n, str(s.dtype), st))

    def reduce_scatter(self, sendbuf, recvbuf, op, blocking: bool, algorithm="mpi"):
        self._call("reduce_scatter", algorithm, "sendbuf")
        sendbuf, recvbuf = in_place_form(sendbuf, recvbuf)
        s, r = self._pair(sendbuf, recvbuf)
        if s.count % self.size:
            raise ValueError(f"sendbuf: {s.count} elements is not divisible by the communicator "
                             f"size {self.size}")
        n = s.count // self.size
        if r.count < n:
            raise ValueError(f"recvbuf is too short: {r.count} elements, needs {n}")
        op = op if isinstance(op, Op) else as_op(op)
        check_op(op, DTYPE_CODES[s.dtype][0], s.dtype)
        nccl_op = nccl_rules.op_name(op)
        # in place (recvbuf None): NCCL's in-place form writes this rank's block of sendbuf;
        # the host API (MPI_IN_PLACE) puts the result first, so a copy on the stream moves it
        nb = n * s.dtype.itemsize
        dst = r.ptr if recvbuf is not None else s.ptr + self.rank * nb

        def launch(c, st):
            c.reduce_scatter(s.ptr, dst, n, str(s.dtype), nccl_op, st)
            if recvbuf is None and self.rank != 0 and nb:
                self.device.memcpy(s.ptr, dst, nb, st)
        return self._run("reduce_scatter", blocking, (s.obj, r.obj), launch)

    def exchange(self, sends, recvs, blocking: bool, keep, copies=(), name: str = "exchange"):
        """Grouped point-to-point: sends/recvs are lists of (peer, ptr, count, dtype); then
        `copies`, (dst, src, nbytes) device copies on the same stream (a rank's own block)."""
        def launch(c, st):
            with nccl.group():
                for peer, ptr, count, dt in sends:
                    c.send(ptr, count, dt, peer, st)
                for peer, ptr, count, dt in recvs:
                    c.recv(ptr, count, dt, peer, st)
            for dst, src, nbytes in copies:
                self.device.memcpy(dst, src, nbytes, st)
        return self._run(name, blocking, keep, launch)

    def alltoall(self, sendbuf, recvbuf, blocking: bool, algorithm="mpi"):
        self._call("alltoall", algorithm, "sendbuf")
        sendbuf, recvbuf = in_place_form(sendbuf, recvbuf)
        s, r = self._pair(sendbuf, recvbuf)
        p, es = self.size, s.dtype.itemsize
        if recvbuf is None or s.count % p:
            raise ValueError("sendbuf: GPU Alltoall needs a recvbuf and a length divisible by the size")
        n = s.count // p
        if r.count < s.count:
            raise ValueError(f"recvbuf is too short: {r.count} elements, needs {s.count}")
        dt = str(s.dtype)
        return self.exchange([(j, s.ptr + j * n * es, n, dt) for j in range(p)],
                             [(j, r.ptr + j * n * es, n, dt) for j in range(p)], blocking, (s.obj, r.obj))

    def gather(self, sendbuf, recvbuf, root: int, blocking: bool, algorithm="mpi"):
        root = self._call("gather", algorithm, "sendbuf", root)
        s = self._arr(sendbuf, "sendbuf")
        dt, es, p = str(s.dtype), s.dtype.itemsize, self.size
        sends = [(root, s.ptr, s.count, dt)]
        recvs = []
        keep = [s.obj]
        if self.rank == root:
            r = self._arr(recvbuf, "recvbuf", writable=True)
            if r.dtype != s.dtype or r.count < p * s.count:
                raise ValueError(f"recvbuf: needs {p * s.count} elements of {s.dtype}")
            recvs = [(j, r.ptr + j * s.count * es, s.count, dt) for j in range(p)]
            keep.append(r.obj)
        return self.exchange(sends, recvs, blocking, tuple(keep))

    def scatter(self, sendbuf, recvbuf, root: int, blocking: bool, algorithm="mpi"):
        root = self._call("scatter", algorithm, "recvbuf", root)
        r = self._arr(recvbuf, "recvbuf", writable=True)
        dt, es, p = str(r.dtype), r.dtype.itemsize, self.size
        sends, keep = [], [r.obj]
        if self.rank == root:
            s = self._arr(sendbuf, "sendbuf")
            if s.dtype != r.dtype or s.count < p * r.count:
                raise ValueError(f"sendbuf: needs {p * r.count} elements of {r.dtype}")
            sends = [(j, s.ptr + j * r.count * es, r.count, dt) for j in range(p)]
            keep.append(s.obj)
        return self.exchange(sends, [(root, r.ptr, r.count, dt)], blocking, tuple(keep))

    def send(self, buf, dest: int, tag, blocking: bool):
        dest = rank_arg(dest, "dest", self.size)
        nccl_rules.check_p2p_args(tag, None, self._any_source)
        b = self._arr(buf, "buf")
        return self._point_to_point("send", [(dest, b.ptr, b.count, str(b.dtype))], [],
                                    blocking, (b.obj,))

    def recv(self, buf, source: int, tag, blocking: bool):
        source = source_arg(source, self.size)
        nccl_rules.check_p2p_args(tag, source, self._any_source, self._any_tag)
        b = self._arr(buf, "buf", writable=True)
        return self._point_to_point("recv", [], [(source, b.ptr, b.count, str(b.dtype))],
                                    blocking, (b.obj,))

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag, blocking: bool):
        dest = rank_arg(dest, "dest", self.size)
        source = source_arg(source, self.size)
        nccl_rules.check_p2p_args(tag, source, self._any_source)
        if recvbuf is None:
            raise ValueError("recvbuf: Sendrecv needs separate send and receive buffers")
        s, r = self._pair(sendbuf, recvbuf)
        if s.ptr == r.ptr and s.nbytes and r.nbytes:
            raise ValueError("recvbuf: Sendrecv needs separate send and receive buffers")
        return self._point_to_point("sendrecv", [(dest, s.ptr, s.count, str(s.dtype))],
                                    [(source, r.ptr, r.count, str(r.dtype))], blocking,
                                    (s.obj, r.obj))

    # -- point-to-point batches: one NCCL group per batch (docs/gpu.md, "Point-to-point: one
    # NCCL group per batch"). Launched one group per call, a rank's receive would wait on the
    # stream behind its own send, which waits for the peer's receive, behind the peer's send.
    def _point_to_point(self, name: str, sends, recvs, blocking: bool, keep):
        """A point-to-point call: nonblocking ones join the batch and return a GpuRequest that
        is not launched yet; a blocking one joins a pending batch as its last member and
        launches it on the bound stream, or, without one, is a group of its own there."""
        if blocking:
            self._refuse_in_group(name)
            if self._batch is None:
                return self.exchange(sends, recvs, True, keep)
        self.usable(name, joins=True)
        comm = self.nccl_comm()             # collective on first use, as for any NCCL op
        with self._batch_lock:
            b = self._batch
            if b is None:
                b = self._batch = P2PBatch(comm)
            b.add(self.device, self.stream, sends, recvs, keep)
            if blocking:
                self._batch = None
                self._launch(b, self.stream)
                return None
            req = GpuRequest(self, None, "nccl", batch=b)
            b.requests.append(req)
            return req

    def _refuse_in_group(self, name: str) -> None:
        if self._group_depth:
            raise Error(f"{name}: inside comm.p2p_group() only nonblocking point-to-point calls "
                        f"on GPU buffers (Isend, Irecv, Isendrecv) may run: the group launches "
                        f"at the end of the with block, and this call would wait for it")

    def flush(self) -> None:
        """Launch the pending point-to-point batch, if any, as one NCCL group on the internal
        stream (at the next other GPU op, at a Wait or Test of one of its requests, at the end
        of p2p_group, at Free)."""
        with self._batch_lock:
            b, self._batch = self._batch, None
            if b is not None:
                self._launch(b, self.internal_stream())

    def launch_request(self, req, what: str) -> None:
        """`req` (a GpuRequest of a batch) is waited for or tested: launch its batch if it is
        still pending. Raises aluminum_py.Error inside p2p_group, or if the batch failed to
        launch (its failure was raised by the call that launched it)."""
        with self._batch_lock:
            if req._event is None and req._batch is not None and req._batch is self._batch:
                if self._group_depth:
                    raise Error(f"{what} inside comm.p2p_group(): its NCCL group launches at "
                                f"the end of the with block; wait for its requests after it")
                self._batch = None
                self._launch(req._batch, self.internal_stream())
        if req._event is None:
            raise Error(f"{what}: the NCCL group of this request failed to launch "
                        f"({req._failure!r})") from req._failure

    def _launch(self, b: "P2PBatch", st: int) -> None:
        """Enqueue batch `b` on stream `st` as one NCCL group, after the work queued on the
        streams of its calls up to each call; then each request's completion event."""
        dev, t_call = self.device, time.monotonic()
        try:
            for s, ev in b.ready.items():
                if s != st:
                    dev.stream_wait_event(st, ev)
            with nccl.group():
                for is_send, peer, ptr, count, dt in b.members:
                    (b.comm.send if is_send else b.comm.recv)(ptr, count, dt, peer, st)
        except BaseException as e:
            for r in b.requests:
                r._failure, r._batch = e, None
            try:                            # part of the group may be enqueued: keep its buffers
                self.inflight.track(st, tuple(b.keep))
            except Error:
                pass
            raise
        finally:
            for ev in b.ready.values():
                dev.event_destroy(ev)       # CUDA releases them once the waits are satisfied
            b.ready = {}
        self.inflight.track(st, tuple(b.keep))
        if timeline.recording():
            timeline.record_enqueued("exchange", t_call, st)
        for r in b.requests:
            ev = dev.event_create()
            dev.event_record(ev, st)
            r._event, r._batch = ev, None
        b.requests = []

    def p2p_group(self) -> "P2PGroup":
        return P2PGroup(self)

    # ==================================================================================
    # Allgatherv, Gatherv, Scatterv, Alltoallv, Reduce_scatter with per-rank counts,
    # Scan and Exscan on GPU buffers (docs/gpu.md, "V-collectives, Alltoallv and Scan on GPU
    # buffers"). NCCL has no v-collectives: the data-moving ones are grouped ncclSend/ncclRecv
    # of each peer's block and a device copy of the rank's own block, as NCCL users write them
    # (PyTorch's all_to_all_single with splits, Horovod's alltoall). Blocks travel as bytes, so
    # every dtype moves. Counts and displacements are the user's values, checked here by
    # buffers.vlayout against the GPU buffer's element count before anything is enqueued; zero
    # counts enqueue nothing for that peer (both sides know the count).

    # "auto" and "nccl" run NCCL; "mpi", the default algorithm of the host forms of
    # Reduce_scatter and Alltoall (and what al.algorithms(<collective>, "cuda") lists), has
    # always run NCCL for GPU buffers.
    V_ALGORITHMS = ("auto", "nccl", "mpi")

    def _v_algorithm(self, name: str, algorithm) -> None:
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm: expected a str, got {type(algorithm).__name__}")
        if algorithm not in self.V_ALGORITHMS:
            raise ValueError(f"algorithm: {algorithm!r} cannot run {name} on GPU buffers, which "
                             f"take {', '.join(map(repr, self.V_ALGORITHMS))} (NCCL)")

    @staticmethod
    def _apart(s: GpuArray, r: GpuArray, in_place: str = "sendbuf=None") -> None:
        """Send and receive buffers of one dtype that share no memory (MPI forbids aliasing
        them; the in-place form is `in_place`)."""
        if r.dtype != s.dtype:
            raise TypeError(f"recvbuf has dtype {r.dtype} but sendbuf has dtype {s.dtype}")
        if s.nbytes and r.nbytes and s.ptr < r.ptr + r.nbytes and r.ptr < s.ptr + s.nbytes:
            raise ValueError(f"sendbuf and recvbuf overlap; pass {in_place} for the in-place form")

    def _own_count(self, buf: GpuArray, name: str, want: int, counts: str) -> None:
        """This rank's own block: `buf` (`name`) must hold exactly counts[rank] elements."""
        if buf.count != want:
            raise ValueError(f"{name} has {buf.count} elements but {counts}[{self.rank}] is "
                             f"{want} (the count of this rank's block)")

    def _exchange_v(self, name: str, algorithm, plan, blocking: bool):
        """Run `plan` (this rank's checks; returns its sends, receives, device copies and what
        to keep), agreed with the other ranks under AL_CHECK (_agreed), then enqueue it."""
        def checked():
            self._v_algorithm(name, algorithm)
            return plan() + (None,)
        sends, recvs, copies, keep, _ = self._agreed(name, checked)
        return self.exchange(sends, recvs, blocking, keep, copies, name)

    def _agreed(self, name: str, plan):
        """`plan()` -> (sends, recvs, copies, keep, signature), after this rank's checks. With
        AL_CHECK=1, every rank's outcome is gathered on the control communicator first, so that
        no rank enqueues NCCL calls that its peers will never match: a rank's refused
        arguments fail every rank (al.Error naming it there), and so do sends whose byte counts
        differ from what their receivers expect, or signatures (Reduce_scatter's counts, dtype
        and op) that differ between ranks. Without it (the default) nothing crosses ranks here:
        NCCL matches sends with receives by order and expects the same size."""
        if not self._check:
            return plan()
        self.usable(name)                   # before the control communicator: not freed
        try:
            out, failure = plan(), None
        except Exception as e:              # every rank must hear of it, or they would wait
            out, failure = None, e
        mine = (f"{type(failure).__name__}: {failure}" if failure is not None else None,
                None if out is None else {peer: n for peer, _, n, _ in out[0]},
                None if out is None else {peer: n for peer, _, n, _ in out[1]},
                None if out is None else out[4])
        everyone = self.control_comm().allgather(mine)
        if failure is not None:
            raise failure
        for i, (why, _, _, _) in enumerate(everyone):
            if why is not None:
                raise Error(f"{name}: rank {i} refused its arguments ({why}); AL_CHECK stopped "
                            f"every rank before NCCL")
        for i, (_, sends, _, sig) in enumerate(everyone):
            if sig != everyone[0][3]:
                raise Error(f"{name}: rank {i} calls with {sig} but rank 0 with "
                            f"{everyone[0][3]} (AL_CHECK)")
            for j in range(self.size):
                n, m = sends.get(j, 0), everyone[j][2].get(i, 0)
                if n != m:
                    raise Error(f"{name}: rank {i} sends {n} bytes to rank {j}, which expects "
                                f"{m} from it (AL_CHECK: the counts differ between ranks)")
        return out

    def allgatherv(self, sendbuf, recvbuf, counts, displs, blocking: bool, algorithm="auto"):
        """Every rank's block into recvbuf (block j: counts[j] elements at displs[j]); sendbuf
        None: in place, this rank's block already at displs[rank]."""
        def plan():
            r = self._arr(recvbuf, "recvbuf", writable=True)
            c, d = vlayout(counts, displs, self.size, "recvbuf", r.count)
            vno_overlap(c, d, "recvbuf")
            me, es = self.rank, r.dtype.itemsize
            mine, nb = r.ptr + int(d[me]) * es, int(c[me]) * es
            src, copies, keep = mine, [], (r.obj,)
            if sendbuf is not None:
                s = self._arr(sendbuf, "sendbuf")
                self._apart(s, r)
                self._own_count(s, "sendbuf", int(c[me]), "recvcounts")
                src, keep = s.ptr, (s.obj, r.obj)
                if nb:
                    copies.append((mine, s.ptr, nb))
            peers = [j for j in range(self.size) if j != me]
            sends = [(j, src, nb, "uint8") for j in peers if nb]
            recvs = [(j, r.ptr + int(d[j]) * es, int(c[j]) * es, "uint8") for j in peers if c[j]]
            return sends, recvs, copies, keep
        return self._exchange_v("allgatherv", algorithm, plan, blocking)

    def gatherv(self, sendbuf, recvbuf, counts, displs, root: int, blocking: bool,
                algorithm="auto"):
        """sendbuf of every rank into the root's recvbuf (rank j's block: counts[j] elements at
        displs[j]); recvbuf, counts, displs matter at the root only; at the root sendbuf None
        is in place. A rank's sendbuf must hold the root's counts[rank] elements (NCCL sends
        are matched by size; checked across ranks only with AL_CHECK=1)."""
        root = rank_arg(root, "root", self.size)

        def plan():
            if self.rank != root:
                s = self._arr(sendbuf, "sendbuf")
                return [(root, s.ptr, s.nbytes, "uint8")] if s.nbytes else [], [], [], (s.obj,)
            r = self._arr(recvbuf, "recvbuf", writable=True)
            c, d = vlayout(counts, displs, self.size, "recvbuf", r.count)
            vno_overlap(c, d, "recvbuf")
            es, copies, keep = r.dtype.itemsize, [], (r.obj,)
            if sendbuf is not None:
                s = self._arr(sendbuf, "sendbuf")
                self._apart(s, r)
                self._own_count(s, "sendbuf", int(c[root]), "recvcounts")
                keep = (s.obj, r.obj)
                if s.nbytes:
                    copies.append((r.ptr + int(d[root]) * es, s.ptr, s.nbytes))
            recvs = [(j, r.ptr + int(d[j]) * es, int(c[j]) * es, "uint8")
                     for j in range(self.size) if j != root and c[j]]
            return [], recvs, copies, keep
        return self._exchange_v("gatherv", algorithm, plan, blocking)

    def scatterv(self, sendbuf, recvbuf, counts, displs, root: int, blocking: bool,
                 algorithm="auto"):
        """Block j of the root's sendbuf (counts[j] elements at displs[j]) into rank j's
        recvbuf; sendbuf, counts, displs matter at the root only; at the root recvbuf None is
        in place. A rank's recvbuf must hold the root's counts[rank] elements (checked across
        ranks only with AL_CHECK=1)."""
        root = rank_arg(root, "root", self.size)

        def plan():
            if self.rank != root:
                r = self._arr(recvbuf, "recvbuf", writable=True)
                return [], [(root, r.ptr, r.nbytes, "uint8")] if r.nbytes else [], [], (r.obj,)
            s = self._arr(sendbuf, "sendbuf")
            c, d = vlayout(counts, displs, self.size, "sendbuf", s.count)
            es, copies, keep = s.dtype.itemsize, [], (s.obj,)
            if recvbuf is not None:
                r = self._arr(recvbuf, "recvbuf", writable=True)
                self._apart(s, r, in_place="recvbuf=None at the root")
                self._own_count(r, "recvbuf", int(c[root]), "sendcounts")
                keep = (s.obj, r.obj)
                if r.nbytes:
                    copies.append((r.ptr, s.ptr + int(d[root]) * es, r.nbytes))
            sends = [(j, s.ptr + int(d[j]) * es, int(c[j]) * es, "uint8")
                     for j in range(self.size) if j != root and c[j]]
            return sends, [], copies, keep
        return self._exchange_v("scatterv", algorithm, plan, blocking)

    def alltoallv(self, sendbuf, scounts, sdispls, recvbuf, rcounts, rdispls, blocking: bool,
                  algorithm="auto"):
        """Block j of sendbuf (scounts[j] elements at sdispls[j]) to rank j, rank j's block
        into recvbuf (rcounts[j] at rdispls[j]). No in-place form (ValueError)."""
        def plan():
            if sendbuf is None:
                raise ValueError("sendbuf: GPU Alltoallv has no in-place form (NCCL would send "
                                 "each block from the memory it receives into, and the library "
                                 "holds no device scratch memory); pass a separate sendbuf")
            s = self._arr(sendbuf, "sendbuf")
            r = self._arr(recvbuf, "recvbuf", writable=True)
            self._apart(s, r, in_place="a separate sendbuf (GPU Alltoallv has no in-place form)")
            sc, sd = vlayout(scounts, sdispls, self.size, "sendbuf", s.count)
            rc, rd = vlayout(rcounts, rdispls, self.size, "recvbuf", r.count)
            vno_overlap(rc, rd, "recvbuf")
            me, es = self.rank, s.dtype.itemsize
            if sc[me] != rc[me]:
                raise ValueError(f"recvbuf counts: this rank sends itself {int(sc[me])} elements "
                                 f"(sendcounts[{me}]) but receives {int(rc[me])} "
                                 f"(recvcounts[{me}])")
            copies = [(r.ptr + int(rd[me]) * es, s.ptr + int(sd[me]) * es, int(sc[me]) * es)] \
                if sc[me] else []
            peers = [j for j in range(self.size) if j != me]
            sends = [(j, s.ptr + int(sd[j]) * es, int(sc[j]) * es, "uint8")
                     for j in peers if sc[j]]
            recvs = [(j, r.ptr + int(rd[j]) * es, int(rc[j]) * es, "uint8")
                     for j in peers if rc[j]]
            return sends, recvs, copies, (s.obj, r.obj)
        return self._exchange_v("alltoallv", algorithm, plan, blocking)

    def reduce_scatterv(self, sendbuf, recvbuf, counts, op, blocking: bool, algorithm="auto"):
        """MPI_Reduce_scatter: sendbuf holds sum(counts) elements, block i (counts[i]
        elements, in rank order) reduced over the ranks into rank i's recvbuf; recvbuf None:
        in place, the result in the first counts[rank] elements of sendbuf (sendbuf None, the
        Communicator's MPI.IN_PLACE: the same with the data in recvbuf).

        NCCL's ReduceScatter has equal blocks only. This is one ncclReduce per rank (rooted
        there) inside one group, as PyTorch's ProcessGroupNCCL runs a reduce_scatter of uneven
        tensors: each rank sends about sum(counts) elements, needs no scratch memory, and the
        group lets NCCL run the reductions concurrently. An ncclAllReduce of the whole buffer
        and a copy would move about twice the data (2(p-1)/p of it) and need a device buffer
        of sum(counts) elements for the out-of-place form."""
        def plan():
            self._v_algorithm("reduce_scatter", algorithm)
            if sendbuf is None:             # mpi4py's MPI.IN_PLACE form: the data in recvbuf
                if recvbuf is None:
                    raise TypeError("sendbuf: None (in place) needs the data in recvbuf, which "
                                    "is None too")
                s, r = self._arr(recvbuf, "recvbuf", writable=True), None
            else:
                s = self._arr(sendbuf, "sendbuf", writable=recvbuf is None)
                r = None if recvbuf is None else self._arr(recvbuf, "recvbuf", writable=True)
            c, d = vlayout(counts, None, self.size, "recvbuf", MAX_COUNT)
            total, me = int(c.sum()), self.rank
            if total != s.count:
                raise ValueError(f"{'sendbuf' if sendbuf is not None else 'recvbuf'} has "
                                 f"{s.count} elements but the recvcounts add up to "
                                 f"{total} (sendbuf holds recvcounts[i] elements for each rank "
                                 f"i, in rank order)")
            if r is None:
                r = s
            else:
                self._apart(s, r)
                if r.count < c[me]:
                    raise ValueError(f"recvbuf is too short: {r.count} elements, needs "
                                     f"{int(c[me])} (recvcounts[{me}])")
            rop = op if isinstance(op, Op) else as_op(op)
            check_op(rop, DTYPE_CODES[s.dtype][0], s.dtype)
            nccl_op = nccl_rules.op_name(rop)
            nccl._dtype(str(s.dtype))       # TypeError before the group: not an NCCL datatype
            return [], [], [], (s, r, c, d, nccl_op), (tuple(int(v) for v in c), str(s.dtype),
                                                       rop.name)
        _, _, _, (s, r, c, d, nccl_op), _ = self._agreed("reduce_scatter", plan)
        me, dt, es = self.rank, str(s.dtype), s.dtype.itemsize
        blocks = [(j, s.ptr + int(d[j]) * es, int(c[j])) for j in range(self.size) if c[j]]
        at, nbytes = int(d[me]) * es, int(c[me]) * es

        def launch(comm, st):
            # In place, this rank's result must end at the front of sendbuf, where other ranks'
            # blocks are still being read by the group: it is reduced where its block lies and
            # moved down after the group. Where the block is longer than the elements before
            # it, source and destination overlap, which a device copy may not: the result then
            # goes to stream-ordered scratch memory and comes back in one copy.
            moved = r is s and at > 0 and nbytes > 0
            scratch = self._scratch(nbytes, st) if moved and nbytes > at else 0
            mine = r.ptr if r is not s else (scratch or s.ptr + at)
            with nccl.group():
                for j, src, n in blocks:    # the receive pointer matters at the root only
                    comm.reduce(src, mine if j == me else src, n, dt, nccl_op, j, st)
            if scratch:
                self.device.memcpy(s.ptr, scratch, nbytes, st)
                self.device.free_async(scratch, st)
            elif moved:
                self._move_down(s.ptr, s.ptr + at, nbytes, st)
        return self._run("reduce_scatter", blocking, (s.obj, r.obj), launch)

    def _scratch(self, nbytes: int, stream: int) -> int:
        """Device memory of `nbytes` ordered on `stream` (freed by the caller with
        device.free_async on the same stream), or 0 where the device cannot give it (out of
        memory, or no memory pools): the caller then takes the path that needs none."""
        try:
            return self.device.alloc_async(nbytes, stream)
        except Error:
            return 0

    def _move_down(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Move `nbytes` from `src` down to `dst` < `src` on `stream` without scratch memory.
        Device copies may not overlap: where the ranges do, the move is ascending copies of
        (src - dst) bytes, each reading what no earlier one wrote."""
        gap = src - dst
        if not nbytes or not gap:
            return
        for at in range(0, nbytes, gap):
            self.device.memcpy(dst + at, src + at, min(gap, nbytes - at), stream)

    def _no_scan(self, name: str) -> None:
        self.usable(name.lower())
        raise UnavailableError(f"{name} on GPU buffers: NCCL has no prefix reduction and there "
                               f"is no host-transfer {name}; copy the data to host memory (e.g. "
                               f"cupy.asnumpy, tensor.cpu()) and call {name} on the host "
                               f"arrays")

    def scan(self, sendbuf, recvbuf, op, blocking: bool, algorithm="auto"):
        """Unavailable: aluminum_py.UnavailableError, on every rank before anything runs."""
        self._no_scan("Scan")

    def exscan(self, sendbuf, recvbuf, op, blocking: bool, algorithm="auto"):
        """Unavailable: aluminum_py.UnavailableError, on every rank before anything runs."""
        self._no_scan("Exscan")


class P2PBatch:
    """Point-to-point calls of one communicator waiting to be launched as one NCCL group:
    members (is_send, peer, ptr, count, dtype) in call order, the buffers they use, the
    requests to complete, and per stream an event recorded at the latest call (the work the
    group must follow)."""

    __slots__ = ("comm", "members", "keep", "requests", "ready")

    def __init__(self, comm):
        self.comm = comm
        self.members: list = []
        self.keep: list = []
        self.requests: list = []
        self.ready: dict = {}

    def add(self, device, stream: int, sends, recvs, keep) -> None:
        ev = self.ready.get(stream)
        if ev is None:
            ev = self.ready[stream] = device.event_create()
        device.event_record(ev, stream)     # re-recorded: the latest call on that stream
        self.members += [(True, peer, ptr, count, dt) for peer, ptr, count, dt in sends]
        self.members += [(False, peer, ptr, count, dt) for peer, ptr, count, dt in recvs]
        self.keep += keep


class P2PGroup:
    """``with comm.p2p_group(): ...``: the nonblocking GPU point-to-point calls of the block
    launch as one NCCL group when the outermost block ends (also when it ends with an
    exception, as ncclGroupEnd in a finally). Inside, waiting for or testing their requests,
    and any other GPU operation on the communicator, raise aluminum_py.Error."""

    __slots__ = ("_b",)

    def __init__(self, backend: GpuBackend):
        self._b = backend

    def __enter__(self) -> "P2PGroup":
        self._b.usable("p2p_group", joins=True)
        self._b._group_depth += 1
        return self

    def __exit__(self, *exc) -> bool:
        b = self._b
        b._group_depth -= 1
        if b._group_depth == 0:
            b.flush()
        return False
