"""The torch.distributed backend ``"aluminum"`` (docs/torch.md): a ``ProcessGroup`` whose
collectives run on an :class:`aluminum_py.Communicator`.

    import aluminum_py.torch                      # registers "aluminum" and mpi://
    torch.distributed.init_process_group("aluminum", init_method="mpi://")

How torch reaches it: C++ callers (DDP's reducer, functional collectives, DTensor, FSDP2)
through torch's ``PyProcessGroup`` trampoline, by the C++ method's Python name (``allreduce``,
``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``, ``alltoall_base``,
...); ``torch.distributed``'s Python functions by their own names (``all_gather_single``,
``reduce_scatter_single``, ``all_to_all_single``, ``recv_anysource``, ...).  Both lead to the
same methods here.

One call: the tensors become buffers sharing their memory (:func:`buffer`), the Communicator
call runs -- blocking in the caller when torch does not ask for async work (``opts.asyncOp``
False: ``dist.all_reduce(t)``), else nonblocking -- and the call returns a :class:`Work`.
A Work's Future is completed by this side: by the thread that calls ``wait()``, or, once
someone holds the Future (``get_future()``: DDP), by the waiter thread (:mod:`.completion`);
never left for a ``wait()`` nobody calls.  A failure fails the Work and its Future (DDP raises
it from ``backward()``).
CUDA tensors run on a communicator bound to torch's current stream (the GPU backend: NCCL or
host transfer), as :func:`aluminum_py.torch.allreduce_hook` does.
"""
from __future__ import annotations

import datetime
import time
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from .. import (AVG, BAND, BOR, BXOR, MAX, MIN, PROD, SUM, Communicator)
from ..errors import Error, TimeoutError as _AlTimeout
from ..status import ANY_SOURCE
from . import completion, cuda, rendezvous
from .hooks import buffer

NAME = "aluminum"

_R = dist.ReduceOp
# torch's ReduceOp -> ours; for bool tensors (reduced as bytes holding 0 or 1) the logical one
_OPS = ((_R.SUM, SUM, BOR), (_R.AVG, AVG, None), (_R.PRODUCT, PROD, BAND), (_R.MIN, MIN, BAND),
        (_R.MAX, MAX, BOR), (_R.BAND, BAND, BAND), (_R.BOR, BOR, BOR), (_R.BXOR, BXOR, BXOR))


def reduce_op(op, dtype: torch.dtype):
    """Our op for torch's ReduceOp `op` on tensors of `dtype` (ValueError for the ones we cannot
    do: PREMUL_SUM, AVG of bool)."""
    if op is _R.SUM and dtype is not torch.bool:
        return SUM                      # the default argument: no comparisons
    for theirs, ours, logical in _OPS:
        if op == theirs:
            if dtype != torch.bool:
                return ours
            if logical is None:
                raise ValueError(f"aluminum: ReduceOp.{theirs.name} of bool tensors is not defined")
            return logical
    if op == _R.PREMUL_SUM:
        raise ValueError("aluminum: ReduceOp.PREMUL_SUM is not supported: multiply the tensor "
                         "by the factor, then reduce with ReduceOp.SUM")
    raise ValueError(f"aluminum: unknown ReduceOp {op!r}")


def _seconds(timeout) -> float | None:
    """A torch timeout (timedelta; negative or zero: unset) in seconds, or None."""
    if timeout is None or (type(timeout) is datetime.timedelta and timeout.days < 0):
        return None                     # torch's "unset" is -1 ms
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return s if s > 0 else None


def _is_block(part: torch.Tensor, whole: torch.Tensor, index: int) -> bool:
    """Whether `part` is exactly block `index` of `whole` (same memory, len(part) elements)."""
    return (part.dtype == whole.dtype and part.device == whole.device
            and whole.numel() % max(part.numel(), 1) == 0
            and part.data_ptr() == whole.data_ptr() + index * part.numel() * part.element_size())


# ---------------------------------------------------------------------------------- calls
class Method(NamedTuple):
    """A Communicator method in its blocking and nonblocking forms (``Allreduce``,
    ``Iallreduce``): what a call of the backend runs."""
    run: Callable
    start: Callable


_C = Communicator
ALLREDUCE, REDUCE = Method(_C.Allreduce, _C.Iallreduce), Method(_C.Reduce, _C.Ireduce)
REDUCE_SCATTER = Method(_C.Reduce_scatter, _C.Ireduce_scatter)
ALLGATHER, BCAST = Method(_C.Allgather, _C.Iallgather), Method(_C.Bcast, _C.Ibcast)
ALLTOALL, ALLTOALLV = Method(_C.Alltoall, _C.Ialltoall), Method(_C.Alltoallv, _C.Ialltoallv)
GATHER, SCATTER = Method(_C.Gather, _C.Igather), Method(_C.Scatter, _C.Iscatter)
BARRIER = Method(_C.Barrier, _C.Ibarrier)
SEND, RECV = Method(_C.Send, _C.Isend), Method(_C.Recv, _C.Irecv)
_NO_KWARGS: dict = {}


# ---------------------------------------------------------------------------------- Work
class Work(dist.Work):
    """A started call: ``wait(timeout)`` (raises the call's error), ``get_future()``,
    ``is_completed()``, ``is_success()``, ``exception()``, ``result()``, ``synchronize()``; for
    a receive ``_source_rank()`` (what ``dist.recv`` without ``src`` returns).  The Future's
    value is the list of output tensors.

    Host tensors: completed by a :class:`~aluminum_py.torch.completion.Completion`, by
    ``wait()`` in the calling thread, or, once ``get_future()`` handed it out, by the waiter
    thread, bounded by the group's timeout.  CUDA tensors: the call is enqueued on its device's
    collective stream (:class:`~aluminum_py.torch.cuda.Enqueued`); ``wait()`` and
    ``synchronize()`` make the then-current stream wait for its end, ``is_completed()`` asks
    the end's event, and the Future is completed on the collective stream."""

    # The state of a call that ran to completion in the caller (what most calls are): an
    # instance sets only what differs, as setting attributes on a torch class costs time.
    _source = _handed = _enqueued = _completion = None
    _queued = False
    _by_waiter = False                  # profiled: the waiter thread completes it

    def __init__(self, group: "ProcessGroupAluminum", what: str, requests: list,
                 finish: Callable[[], None] | None, result: list, receive=None,
                 enqueued: cuda.Enqueued | None = None):
        super().__init__()
        self._what, self._outputs = what, result
        if enqueued is not None:        # on a stream
            self._enqueued = enqueued
            return
        if not requests:                # ran to completion
            if finish is not None:
                finish()
            return

        def done() -> list:
            if receive is not None:
                self._source = receive.status.source
            if finish is not None:
                finish()
            return result
        self._completion = completion.Completion(
            requests, torch.futures.Future(), done, group._op_timeout,
            lambda e, limit: group._failure(what, e, limit))

    def _settled(self) -> completion.Completion:
        """The Completion (made now, already settled, for a call that ran to completion)."""
        c = self._completion
        if c is None:
            c = self._completion = completion.Completion([], torch.futures.Future(),
                                                         lambda: self._outputs)
        return c

    def wait(self, timeout=None) -> bool:
        if self._enqueued is not None:
            self._enqueued.wait()
            return True
        c = self._completion
        if c is not None:
            if not self._by_waiter:
                c.run(_seconds(timeout))
            c.future.wait()             # raises the call's error; returns at once otherwise
        return True

    synchronize = wait

    def get_future(self) -> torch.futures.Future:
        """The Future of the outputs, completed by this side (host tensors: the waiter thread;
        CUDA tensors: on the collective stream).  A failure is an error of that Future, as
        C++ reads it (:func:`~aluminum_py.torch.completion.value`)."""
        if self._handed is None:
            if self._enqueued is not None:
                self._enqueued.settle()
                self._handed = self._enqueued.future
                return self._handed
            c = self._settled()
            if not c.future.done() and not self._queued:
                self._queued = True
                completion.waiter.submit(c)
            self._handed = c.future.then(completion.value)
        return self._handed

    def is_completed(self) -> bool:
        if self._enqueued is not None:
            return self._enqueued.query()
        if self._by_waiter:
            return self._completion.future.done()
        return self._completion is None or self._completion.ready()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        if self._enqueued is not None:
            self._enqueued.settle()
            return self._enqueued.error
        f = self._settled().future
        if not f.done():
            return None
        try:
            f.value()
        except Exception as e:          # noqa: BLE001
            return e
        return None

    def result(self) -> list:
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        self.wait()
        if self._source is None:
            raise ValueError(f"aluminum: {self._what} has no source rank (only a receive does)")
        return self._source

    source_rank = _source_rank


def _backend_error(what: str, e: BaseException) -> BaseException:
    """`e` as torch's DistBackendError naming the call (argument errors stay what they are)."""
    if isinstance(e, (TypeError, ValueError, dist.DistBackendError)):
        return e
    err = dist.DistBackendError(f"aluminum: {what} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


# ---------------------------------------------------------------------------------- the group
class ProcessGroupAluminum(dist.ProcessGroup):
    """A torch.distributed process group over an :class:`aluminum_py.Communicator` (created by
    torch through the registered backend; see :func:`create`).

    Attributes:
        comm: the Communicator (its ranks are the group's).
        timeout: seconds an operation may take before its Work fails with DistBackendError
            (init_process_group's / new_group's ``timeout``; a call's ``opts.timeout`` wins).
    """

    def __init__(self, comm: Communicator, timeout: float | None, store=None,
                 global_ranks: list[int] | None = None):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        comm.timeout = timeout          # bounds the blocking calls
        self._op_timeout = timeout
        self._store = store
        self._global_ranks = list(range(comm.size)) if global_ranks is None else global_ranks
        self._name, self._desc = "", ""
        self._broken: BaseException | None = None
        self._coalesced: list | None = None
        self._devices = cuda.DeviceComms(comm)      # CUDA tensors: a communicator per device
        self._quiet = 0                 # > 0: the parts of a coalesced call (one event)
        self._left_behind: list = []    # monitored_barrier's receives of ranks that were late

    # --- identity (torch sets the name after creating the group; DeviceMesh, functional
    # collectives and FSDP2 look the group up by it)
    def getBackendName(self) -> str:
        return NAME

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def timeout(self) -> float | None:
        return self._op_timeout

    def __repr__(self) -> str:
        return (f"ProcessGroupAluminum(rank={self.comm.rank}, size={self.comm.size}, "
                f"name={self._name!r})")

    # --- one mechanism for every call
    def _failure(self, what: str, e: BaseException, timeout) -> BaseException:
        """What a failed call raises: DistBackendError; after a timeout the group is broken."""
        if isinstance(e, _AlTimeout):
            return self._timed_out(what, timeout, e)
        return _backend_error(what, e)

    def _timed_out(self, what: str, timeout, cause) -> BaseException:
        err = dist.DistBackendError(
            f"aluminum: {what} timed out after {timeout:g} s on rank {self.comm.rank}, the "
            f"group's timeout (a rank that never made the matching call?); this process group "
            f"is unusable now: destroy it (and usually end the job)")
        err.__cause__ = cause
        self._broken = err
        return err

    def _usable(self, what: str) -> None:
        if self._broken is not None:
            raise dist.DistBackendError(f"aluminum: {what}: this process group failed before "
                                        f"and is unusable: {self._broken}")

    def _start(self, what: str, opts, tensor: torch.Tensor, calls: list,
               result: list, finish: Callable[[], None] | None = None,
               receive: bool = False, p2p: bool = False, shown=None) -> Work:
        """Run `calls` (``(Method, args, kwargs)``) on the group's communicator, or for a CUDA
        `tensor` on its device's (:mod:`.cuda`); `finish` runs once they completed (copies out
        of temporary buffers).  Host tensors: blocking in this thread when torch waits anyway
        (``opts.asyncOp`` False, no ``opts.timeout``), else nonblocking.  CUDA tensors:
        collectives are enqueued on the device's collective stream at once; point-to-point
        calls (`p2p`) start nonblocking, so consecutive ones form one group, and are waited
        for on that stream when the Work is first waited for or asked about.  Under torch's
        profiler the call is the event ``aluminum:<what>`` with the shapes of `shown` (default:
        `tensor`): for host tensors from the call to the op's completion, for CUDA tensors the
        enqueue (as ProcessGroupNCCL's, which ends its event once the op is on the stream)."""
        self._usable(what)
        device = cuda.pieces.device_of(tensor)
        if device is not None:
            handle = (self._record(what, shown or (tensor,))
                      if _profiling() and not self._quiet else None)
            try:
                work = self._start_cuda(what, device, calls, result, finish, p2p)
            finally:
                if handle is not None:
                    torch.autograd._record_function_with_args_exit(handle)
        elif _profiling() and not self._quiet:
            handle = self._record(what, shown or (tensor,))
            work = self._start_host(what, opts, calls, result, finish, receive, blocking=False)
            self._by_waiter(work, handle)
        else:
            work = self._start_host(what, opts, calls, result, finish, receive)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _start_host(self, what, opts, calls, result, finish, receive,
                    blocking: bool = True) -> Work:
        comm = self.comm
        limit = _seconds(getattr(opts, "timeout", None))
        if blocking and opts is not None and not opts.asyncOp and limit is None:
            try:
                comm.bind_thread()      # torch calls from its autograd thread and others
                for method, args, kwargs in calls:
                    method.run(comm, *args, **kwargs)
            except Error as e:          # argument errors (TypeError, ValueError) pass as such
                raise self._failure(what, e, self._op_timeout or 0.0) from e
            return Work(self, what, [], finish, result)
        requests = []
        try:
            comm.bind_thread()
            for method, args, kwargs in calls:
                requests.append(method.start(comm, *args, **kwargs))
        except Error as e:              # delivered through the Work (DDP: from backward())
            requests.append(_Failed(e))
        work = Work(self, what, requests, finish, result,
                    receive=requests[0] if receive else None)
        if limit is not None:
            work._completion.run(limit)     # a call's own timeout: waited for here
        return work

    @staticmethod
    def _record(what: str, tensors):
        """Under torch's profiler: the start of the event ``aluminum:<what>`` with the shapes
        of `tensors` (complex as real, as gloo records them)."""
        shown = [torch.view_as_real(t) if t.is_complex() else t for t in tensors
                 if isinstance(t, torch.Tensor)]
        return torch.autograd._record_function_with_args_enter(f"{NAME}:{what}", *shown)

    @staticmethod
    def _by_waiter(work: Work, handle) -> None:
        """The profiled call runs nonblocking and the waiter thread completes it, ending its
        event there (an asynchronous event, from its start in the caller to its completion,
        as gloo's worker threads report theirs)."""
        c = work._settled()
        c.future.add_done_callback(
            lambda _: torch.autograd._record_function_with_args_exit(handle))
        if not c.future.done():
            work._queued = work._by_waiter = True
            completion.waiter.submit(c)

    def _start_cuda(self, what, device, calls, result, finish, p2p) -> Work:
        def launch(comm) -> list:
            if p2p:
                return [method.start(comm, *args, **kwargs) for method, args, kwargs in calls]
            for method, args, kwargs in calls:
                method.run(comm, *args, **kwargs)
            return []
        tensors = [a for _, args, _ in calls for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for t in result if isinstance(t, torch.Tensor)]
        if finish is not None:
            copy_out = finish

            def finish() -> list:
                copy_out()
                return result
        enqueued = cuda.enqueue(self._devices, device, tensors, launch, finish, result,
                                lambda e: self._failure(what, e, self._op_timeout or 0.0))
        return Work(self, what, [], None, result, enqueued=enqueued)

    # --- reductions
    def allreduce(self, tensors, opts=None):
        opts = _c10d.AllreduceOptions() if opts is None else opts
        op = opts.reduceOp
        t = tensors[0]
        if t.is_sparse:
            return self._sparse_allreduce(tensors, op)
        if (len(tensors) == 1 and not opts.asyncOp and self._broken is None
                and cuda.pieces.device_of(t) is None and not _profiling()
                and _seconds(opts.timeout) is None):
            self._reduce_now(t, op)     # dist.all_reduce(t): the blocking call, nothing else
            return Work(self, "all_reduce", [], None, tensors)
        calls = [(ALLREDUCE, (buffer(t, True), None, reduce_op(op, t.dtype)), _NO_KWARGS)
                 for t in tensors]
        return self._start("all_reduce", opts, tensors[0], calls, tensors, shown=tensors)

    def _reduce_now(self, t: torch.Tensor, op) -> None:
        """Reduce host tensor `t` in place, blocking in this thread (``dist.all_reduce(t)`` and
        :func:`all_reduce`): the shortest path from torch to the library."""
        comm = self.comm
        try:
            comm.bind_thread()
            comm.Allreduce(buffer(t, True), None, reduce_op(op, t.dtype))
        except Error as e:
            raise self._failure("all_reduce", e, self._op_timeout or 0.0) from e

    def _sparse_allreduce(self, tensors, op):
        """SUM of sparse COO host tensors (as gloo): every rank's indices and values are
        gathered (Allgather of the counts, Allgatherv of both) and summed; each tensor then
        holds the coalesced sum (blocking)."""
        what = "all_reduce"
        if op != _R.SUM:
            raise ValueError(f"aluminum: all_reduce of sparse tensors takes ReduceOp.SUM only, "
                             f"got {op}")
        self._usable(what)
        comm = self.comm
        try:
            comm.bind_thread()
            for t in tensors:
                if t.is_cuda:
                    raise ValueError("aluminum: all_reduce of sparse tensors: host tensors only")
                local = t.coalesce()
                indices = local.indices().t().contiguous()     # one row per nonzero
                values = local.values().contiguous()
                counts = np.zeros(comm.size, dtype=np.int64)
                comm.Allgather(np.array([local._nnz()], dtype=np.int64), counts)
                total = int(counts.sum())
                every_index = torch.empty((total, indices.shape[1]), dtype=indices.dtype)
                every_value = torch.empty((total, *values.shape[1:]), dtype=values.dtype)
                for mine, every in ((indices, every_index), (values, every_value)):
                    sbuf, rbuf = buffer(mine), buffer(every)
                    per = int(np.prod(mine.shape[1:])) * _per(mine, sbuf)   # per nonzero
                    n = [int(c) * per for c in counts]
                    comm.Allgatherv(sbuf, rbuf, recvcounts=n, displs=_offsets(n))
                t.copy_(torch.sparse_coo_tensor(every_index.t(), every_value, t.shape)
                        .coalesce())
        except Error as e:
            raise self._failure(what, e, self._op_timeout or 0.0) from e
        return Work(self, what, [], None, list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        opts = _c10d.ReduceOptions() if opts is None else opts
        t = tensors[0]
        calls = [(REDUCE, (buffer(t, True),), {"op": reduce_op(opts.reduceOp, t.dtype),
                                          "root": opts.rootRank})]
        return self._start("reduce", opts, t, calls, list(tensors))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = _c10d.ReduceScatterOptions() if opts is None else opts
        out, ins = output_tensors[0], input_tensors[0]
        _same_sizes("reduce_scatter", out, ins, self.comm.size)
        flat = torch.cat([i.reshape(-1) for i in ins])
        return self._reduce_scatter("reduce_scatter", out, flat, opts, list(output_tensors))

    def _reduce_scatter(self, what, out, flat, opts, result):
        if flat.numel() != out.numel() * self.comm.size:
            raise ValueError(f"aluminum: {what}: the input has {flat.numel()} elements, "
                             f"expected {self.comm.size} x the output's {out.numel()}")
        if _overlaps(out, flat):            # the output inside the input: reduce into a copy
            tmp = torch.empty_like(out)
            return self._start(what, opts, out, [self._rs_call(flat, tmp, opts)], result,
                               lambda: out.copy_(tmp))
        return self._start(what, opts, out, [self._rs_call(flat, out, opts)], result)

    def _rs_call(self, flat, out, opts):
        return (REDUCE_SCATTER, (buffer(flat, True), buffer(out, True)),
                {"op": reduce_op(opts.reduceOp, out.dtype)})

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = _c10d.ReduceScatterOptions() if opts is None else opts
        return self._reduce_scatter("reduce_scatter_tensor", output, input.reshape(-1), opts,
                                    [output])

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = _c10d.ReduceScatterOptions() if opts is None else opts
        return self._coalesce("reduce_scatter_tensor_coalesced", outputs, inputs,
                              lambda: [self._reduce_scatter_base(o, i, opts)
                                       for o, i in zip(outputs, inputs)])

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # --- data movement
    def broadcast(self, tensors, opts=None):
        opts = _c10d.BroadcastOptions() if opts is None else opts
        calls = [(BCAST, (buffer(t),), {"root": opts.rootRank}) for t in tensors]
        return self._start("broadcast", opts, tensors[0], calls, list(tensors))

    def _allgather_base(self, output, input, opts=None):
        """all_gather_into_tensor: `output` holds size blocks of `input`'s element count; when
        `input` is block `rank` of `output` (FSDP2), in place."""
        opts = _c10d.AllgatherOptions() if opts is None else opts
        size, rank = self.comm.size, self.comm.rank
        if output.numel() != input.numel() * size:
            raise ValueError(f"aluminum: all_gather_into_tensor: the output has "
                             f"{output.numel()} elements, expected {size} x the input's "
                             f"{input.numel()}")
        if _is_block(input, output, rank):
            call = (ALLGATHER, (buffer(output),), {})
        elif _overlaps(input, output):
            src = input.clone()
            call = (ALLGATHER, (buffer(src), buffer(output)), {})
        else:
            call = (ALLGATHER, (buffer(input), buffer(output)), {})
        return self._start("all_gather_into_tensor", opts, output, [call], [output])

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = _c10d.AllgatherOptions() if opts is None else opts
        return self._coalesce("allgather_into_tensor_coalesced", outputs, inputs,
                              lambda: [self._allgather_base(o, i, opts)
                                       for o, i in zip(outputs, inputs)])

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = _c10d.AllgatherOptions() if opts is None else opts
        outs, inp = output_tensors[0], input_tensors[0]
        _same_sizes("all_gather", inp, outs, self.comm.size)
        flat, finish = _gathered(inp, outs)
        return self._start("all_gather", opts, inp,
                           [(ALLGATHER, (buffer(inp), buffer(flat)), {})],
                           list(output_tensors), finish)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """`output_lists[r][p]` receives part `p` (`input_tensors[p]`) of rank `r`."""
        opts = _c10d.AllgatherOptions() if opts is None else opts
        size = self.comm.size
        if len(output_lists) != size or any(len(o) != len(input_tensors) for o in output_lists):
            raise ValueError(f"aluminum: all_gather_coalesced: expected {size} output lists "
                             f"(one per rank) of {len(input_tensors)} tensors (one per input)")
        return self._coalesce("all_gather", [t for o in output_lists for t in o], input_tensors,
                              lambda: [self.allgather([[o[p] for o in output_lists]], [inp], opts)
                                       for p, inp in enumerate(input_tensors)])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """all_to_all_single: even splits (both lists empty) as Alltoall, uneven as Alltoallv
        (counts and displacements in elements: a split of dim 0 times the row's elements)."""
        opts = _c10d.AllToAllOptions() if opts is None else opts
        size = self.comm.size
        if _overlaps(input, output):
            input = input.clone()
        if not output_split_sizes and not input_split_sizes:
            if input.numel() % size or output.numel() != input.numel():
                raise ValueError(f"aluminum: all_to_all_single: {input.numel()} input and "
                                 f"{output.numel()} output elements do not split evenly over "
                                 f"{size} ranks")
            call = (ALLTOALL, (buffer(input), buffer(output)), {})
        else:
            sbuf, rbuf = buffer(input), buffer(output)
            scounts, sdispls = _splits(input, input_split_sizes, size, "input", _per(input, sbuf))
            rcounts, rdispls = _splits(output, output_split_sizes, size, "output",
                                       _per(output, rbuf))
            call = (ALLTOALLV, (sbuf, rbuf),
                    {"sendcounts": scounts, "sdispls": sdispls, "recvcounts": rcounts,
                     "rdispls": rdispls})
        return self._start("all_to_all_single", opts, output, [call], [output])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = _c10d.AllToAllOptions() if opts is None else opts
        send = torch.cat([t.reshape(-1) for t in input_tensors])
        recv, finish = _gathered(send, output_tensors)
        sbuf, rbuf = buffer(send), buffer(recv)
        per = _per(send, sbuf)                  # buffer elements per tensor element
        scounts = [t.numel() * per for t in input_tensors]
        rcounts = [t.numel() * per for t in output_tensors]
        call = (ALLTOALLV, (sbuf, rbuf),
                {"sendcounts": scounts, "sdispls": _offsets(scounts), "recvcounts": rcounts,
                 "rdispls": _offsets(rcounts)})
        return self._start("all_to_all", opts, send, [call], list(output_tensors), finish)

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = _c10d.GatherOptions() if opts is None else opts
        inp, root = input_tensors[0], opts.rootRank
        if self.comm.rank != root:
            return self._start("gather", opts, inp, [(GATHER, (buffer(inp), None),
                                                      {"root": root})], [])
        outs = output_tensors[0]
        _same_sizes("gather", inp, outs, self.comm.size)
        flat, finish = _gathered(inp, outs)
        return self._start("gather", opts, inp,
                           [(GATHER, (buffer(inp), buffer(flat)), {"root": root})],
                           list(output_tensors), finish)

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = _c10d.ScatterOptions() if opts is None else opts
        out, root = output_tensors[0], opts.rootRank
        if self.comm.rank != root:
            return self._start("scatter", opts, out, [(SCATTER, (None, buffer(out)),
                                                       {"root": root})], list(output_tensors))
        ins = input_tensors[0]
        _same_sizes("scatter", out, ins, self.comm.size)
        flat = torch.cat([i.reshape(-1) for i in ins])
        return self._start("scatter", opts, out,
                           [(SCATTER, (buffer(flat), buffer(out)), {"root": root})],
                           list(output_tensors))

    def barrier(self, opts=None):
        opts = _c10d.BarrierOptions() if opts is None else opts
        return self._start("barrier", opts, _CPU_TOKEN, [(BARRIER, (), {})], [])

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """gloo's monitored barrier on host memory: every other rank reports to rank 0, which
        waits for each within `timeout` (default: the group's) and raises naming the first
        rank that did not arrive (every one with `wait_all_ranks`), then releases them; a rank
        not released in time raises too.  (``dist.monitored_barrier`` itself accepts gloo
        groups only; this is the group's method.)"""
        limit = _seconds(timeout)
        limit = self._op_timeout if limit is None and timeout is None else (limit or 0.0)
        comm, rank, token = self.comm, self.comm.rank, np.zeros(1, np.uint8)
        deadline = time.monotonic() + (limit if limit is not None else float("inf"))
        comm.bind_thread()
        if rank != 0:
            try:
                comm.Isend(token, 0, _MONITORED_TAG).Wait(limit)
                comm.Irecv(token, 0, _MONITORED_TAG).Wait(max(0.0, deadline - time.monotonic()))
            except Error as e:
                raise RuntimeError(f"Rank {rank} successfully reached monitoredBarrier, but "
                                   f"received errors while waiting for send/recv from rank 0. "
                                   f"Please check rank 0 logs for faulty rank.") from e
            return
        if limit is not None and limit <= 0:
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {limit * 1e3:g} ms.")
        arrived = [np.zeros(1, np.uint8) for _ in range(comm.size)]
        requests = {r: comm.Irecv(arrived[r], r, _MONITORED_TAG) for r in range(1, comm.size)}
        failed = []
        for r, req in requests.items():
            try:
                req.Wait(max(0.0, deadline - time.monotonic()))
            except Error:
                failed.append(r)
                self._left_behind.append((req, arrived[r]))    # a late rank may still send
                if not wait_all_ranks:
                    break
        if failed:
            who = (f"Ranks {', '.join(map(str, failed))}" if wait_all_ranks
                   else f"Rank {failed[0]}")
            raise RuntimeError(f"[Rank 0]: {who} failed to pass monitoredBarrier in "
                               f"{limit * 1e3:g} ms")
        for r in range(1, comm.size):
            comm.Isend(token, r, _MONITORED_TAG).Wait(limit)

    # --- point to point (always nonblocking: batch_isend_irecv starts both sides first)
    def send(self, tensors, dst, tag):
        t = tensors[0]
        return self._start("send", None, t, [(SEND, (buffer(t), dst, tag), {})], list(tensors),
                           p2p=True)

    def recv(self, tensors, src, tag):
        t = tensors[0]
        work = self._start("recv", None, t, [(RECV, (buffer(t), src, tag), {})], list(tensors),
                           receive=True, p2p=True)
        if work._enqueued is not None:      # GPU receives name their source
            work._source = src
        return work

    def recv_anysource(self, tensors, tag):
        t = tensors[0]
        return self._start("recvAnySource", None, t, [(RECV, (buffer(t), ANY_SOURCE, tag), {})],
                           list(tensors), receive=True, p2p=True)

    # --- coalescing: torch's _coalescing_manager(device=...) brackets calls with these
    def _start_coalescing(self, device=None):
        if self._coalesced is not None:
            raise RuntimeError("aluminum: coalescing already started on this group")
        self._coalesced = []

    def _end_coalescing(self, device=None):
        works, self._coalesced = self._coalesced or [], None
        return _joined("coalesced", self, works,
                       [t for w in works for t in w._outputs])

    def _coalesce(self, what, outputs, inputs, parts: Callable[[], list]):
        """One Work for the calls `parts()` starts (one profiler event for them all)."""
        handle = self._record(what, inputs) if _profiling() and not self._quiet else None
        self._quiet += 1
        try:
            works = parts()
        finally:
            self._quiet -= 1
        if self._coalesced is not None:      # inside _start_coalescing: each part counts
            for w in works:
                self._coalesced.remove(w)
        work = _joined(what, self, works, list(outputs))
        if handle is not None:
            self._by_waiter(work, handle)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    # --- groups
    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None,
                    devices=None):
        """A group of the ranks `ranks` (this group's numbering) over a sub-communicator, or
        None on a rank not in `ranks`; collective over every rank of this group (each passes
        the ranks of its own part; parts must not overlap)."""
        from mpi4py import MPI
        ranks = sorted(int(r) for r in ranks)
        member = self.comm.rank in ranks
        sub = self.comm.mpi_comm.Split(ranks[0] if member else MPI.UNDEFINED, self.comm.rank)
        if not member:
            return None
        try:
            pg = ProcessGroupAluminum(Communicator(sub), _seconds(timeout) or self._op_timeout,
                                      self._store, [self._global_ranks[r] for r in ranks])
        finally:
            sub.Free()
        if group_name:
            pg.setGroupName(group_name)
        if group_desc:
            pg.setGroupDesc(group_desc)
        return pg

    def abort(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Free the communicator (torch calls it from destroy_process_group)."""
        if self._broken is None:
            self._broken = dist.DistBackendError("aluminum: this process group was shut down")
        try:
            self._devices.free()
        except Error:
            pass                        # pending ops (a timed-out call): leave it to exit
        if not self.comm._state.freed:
            try:
                self.comm.bind_thread()
                self.comm.Free()
            except Error:
                pass                    # pending ops (a timed-out call): leave it to exit


_CPU_TOKEN = torch.empty(0)
_profiling = torch._C._autograd._profiler_enabled


def _joined(what: str, group: ProcessGroupAluminum, works: list, result: list) -> Work:
    """One Work that completes when every part has (a coalesced call); its error is the first
    failed part's.  CUDA parts: their requests are waited for together (consecutive
    point-to-point calls form one group) and the Work ends after the last part on the
    collective stream."""
    enqueued = [w._enqueued for w in works if w._enqueued is not None]
    if not enqueued:
        return Work(group, what, [_Parts(list(works))], None, result)
    first = enqueued[0]
    if first.stream is None:                # failed to start
        return Work(group, what, [], None, result, enqueued=first)
    joined = cuda.Enqueued(first.cuda, first.device, first.stream, enqueued, None, result,
                           lambda e: e)
    return Work(group, what, [], None, result, enqueued=joined)


class _Failed:
    """A call that failed to start, as a request: ``Wait`` raises its error."""

    done = True

    def __init__(self, error: BaseException):
        self.error = error

    def Wait(self, timeout=None):
        raise self.error


class _Parts:
    """The parts of a coalesced call as one request: ``Wait`` waits for each."""

    def __init__(self, works):
        self.works = works

    def Wait(self, timeout=None):
        for w in self.works:
            w.wait(None if timeout is None else datetime.timedelta(seconds=timeout))

    @property
    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _gathered(like: torch.Tensor, outs: list):
    """A flat buffer of `like`'s dtype and device as long as the tensors `outs` together, and
    the finish that copies its consecutive blocks into them."""
    flat = torch.empty((sum(o.numel() for o in outs),), dtype=like.dtype, device=like.device)

    def finish():
        off = 0
        for o in outs:
            o.copy_(flat[off:off + o.numel()].view(o.shape))
            off += o.numel()
    return flat, finish


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _same_sizes(what: str, one: torch.Tensor, many, size: int) -> None:
    if len(many) != size:
        raise ValueError(f"aluminum: {what}: {len(many)} tensors in the list, expected the "
                         f"group size {size}")
    for i, t in enumerate(many):
        if t.numel() != one.numel() or t.dtype != one.dtype:
            raise ValueError(f"aluminum: {what}: tensor {i} of the list has {t.numel()} "
                             f"elements of {t.dtype}, expected {one.numel()} of {one.dtype}")


def _offsets(counts: list[int]) -> list[int]:
    out, off = [], 0
    for c in counts:
        out.append(off)
        off += c
    return out


def _per(t: torch.Tensor, buf) -> int:
    """Elements of `t`'s buffer per element of `t` (2 for bfloat16 moved as bytes, else 1)."""
    return t.element_size() // (buf.itemsize if hasattr(buf, "itemsize") else buf.element_size())


def _splits(t: torch.Tensor, split_sizes, size: int, name: str, per: int = 1):
    """Counts and displacements in buffer elements (`per` per tensor element) for
    all_to_all_single's splits of dim 0 (empty: even)."""
    rows = t.shape[0] if t.dim() else 1
    row = t.numel() // rows if rows else 0
    if not split_sizes:
        if rows % size:
            raise ValueError(f"aluminum: all_to_all_single: the {name}'s {rows} rows do not "
                             f"split evenly over {size} ranks; give {name}_split_sizes")
        split_sizes = [rows // size] * size
    split_sizes = [int(s) for s in split_sizes]
    if len(split_sizes) != size or sum(split_sizes) != rows or min(split_sizes) < 0:
        raise ValueError(f"aluminum: all_to_all_single: {name}_split_sizes {split_sizes} must "
                         f"be {size} non-negative row counts summing to {rows}")
    counts = [s * row * per for s in split_sizes]
    return counts, _offsets(counts)


# ---------------------------------------------------------------------------------- creation
_world: Communicator | None = None      # the default group's communicator: new groups' parent


def create(options, backend_options=None) -> ProcessGroupAluminum:
    """The backend's creator (``register_backend(..., extended_api=True)``): the default group
    over ``MPI.COMM_WORLD`` (whose ranks must be torch's: ``init_method="mpi://"``), a new group
    over the members' sub-communicator of the default group's (collective over the members
    only, as torch calls it)."""
    global _world
    world = rendezvous.mpi_world("init_process_group('aluminum')")
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    timeout = _seconds(options.timeout)
    if not options.global_ranks_in_group or _world is None or _world._state.freed:
        if options.group_size != world.size or options.group_rank != world.rank:
            raise Error(f"the 'aluminum' backend: torch's rank {options.group_rank} of "
                        f"{options.group_size} is not MPI's ({world.rank} of {world.size}): "
                        f"use init_method='mpi://' and {rendezvous.HOW_TO_LAUNCH}")
        comm = Communicator(world)
        if not options.global_ranks_in_group:
            _world = comm
        return ProcessGroupAluminum(comm, timeout, options.store, ranks)
    base = _world.mpi_comm
    sub = base.Create_group(base.group.Incl(ranks), tag=_CREATE_TAG)
    try:
        comm = Communicator(sub)
    finally:
        sub.Free()
    if comm.rank != options.group_rank:
        raise Error(f"new_group: torch's group rank {options.group_rank} is not MPI's "
                    f"{comm.rank}")
    return ProcessGroupAluminum(comm, timeout, options.store, ranks)


_CREATE_TAG = 2120
_MONITORED_TAG = 2121


def register() -> None:
    """Register the backend "aluminum" (CPU and CUDA tensors) with torch.distributed (once)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, create, extended_api=True, devices=["cpu", "cuda"])


def all_reduce(tensor: torch.Tensor, op=_R.SUM, group: "ProcessGroupAluminum | None" = None
               ) -> torch.Tensor:
    """Reduce `tensor` in place over `group` (default: the default group), blocking, and return
    it: ``dist.all_reduce(tensor, op, group)`` without torch's dispatch on the way (the path of
    a tensor-parallel layer's all-reduce in inference, as DeepSpeed's ``inference_all_reduce``).
    The same algorithms, errors and timeout as ``dist.all_reduce`` on an "aluminum" group; the
    same rule for calls: every rank of the group makes it, in the same order as the group's
    other calls."""
    pg = dist.group.WORLD if group is None else group
    if type(pg) is not ProcessGroupAluminum:
        raise TypeError(f"group: expected a process group of the 'aluminum' backend, got "
                        f"{type(pg).__name__} (init_process_group('aluminum', "
                        f"init_method='mpi://'), or pass group=)")
    if pg._broken is not None or cuda.pieces.device_of(tensor) is not None or _profiling():
        opts = _c10d.AllreduceOptions()     # the group's path: the failed group's error, or
                                            # enqueued on the device's collective stream
        opts.reduceOp, opts.asyncOp = op, False
        pg.allreduce([tensor], opts).wait()
        return tensor
    pg._reduce_now(tensor, op)
    return tensor


def init_process_group(**kwargs) -> None:
    """``torch.distributed.init_process_group(backend="aluminum", init_method="mpi://",
    **kwargs)``: under ``mpiexec -n N python prog.py`` nothing else is needed."""
    kwargs.setdefault("backend", NAME)
    if "store" not in kwargs:
        kwargs.setdefault("init_method", f"{rendezvous.SCHEME}://")
    dist.init_process_group(**kwargs)
