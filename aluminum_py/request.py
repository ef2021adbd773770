"""Requests returned by the nonblocking (I-prefixed) operations."""
from __future__ import annotations

from typing import Iterable

from . import _core, config
from .errors import Error, MPIError, TimeoutError
from .status import UNDEFINED, Status, envelope, fill, status_arg


def _check(op) -> None:
    err = op.error
    if err is not None:
        code, msg = err
        if code == _core.ERR_TIMEOUT:      # abandoned by the engine at its AL_HANG_TIMEOUT deadline
            raise TimeoutError(f"{op.name}: {msg}")
        found = op.status
        if found is not None and _is_truncation(code):
            room = op.recv_count * op.esize
            length = (f", {found[2]} bytes" if found[2] > room else "")   # Open MPI says
            raise MPIError(f"{op.name}: the message from rank {found[0]} (tag {found[1]}"
                           f"{length}) is longer than {_RECV_BUF.get(op.name, 'buf')} "
                           f"({op.recv_count} elements, {room} bytes); MPI dropped the rest "
                           f"(MPI_ERR_TRUNCATE){'' if length else ' without saying how long it was'}"
                           f": receive into a buffer as long as the message (Probe tells its "
                           f"length)", code)
        raise MPIError(f"{op.name}: {msg}{v_truncation_hint(op.name, code)}", code)


_RECV_BUF = {"recv": "buf", "sendrecv": "recvbuf"}   # the receive's buffer argument, by op name


def _is_truncation(code: int) -> bool:
    from mpi4py import MPI
    try:
        return MPI.Get_error_class(code) == MPI.ERR_TRUNCATE
    except MPI.Exception:
        return False


def _status_of(op) -> Status:
    """The Status of the completed op `op`: its receive's envelope, else MPI's empty status."""
    found = op.status
    if found is None:
        return Status()
    return envelope(found[0], found[1], found[2], op.esize, found[3])


class Request:
    """A pending operation. Holds the buffers it reads and writes until it completes.

    Attributes:
        algorithm: the algorithm that runs the op (``"ring"``, ``"mpi"``, ...).
    """

    __slots__ = ("_op", "algorithm", "_retired")

    def __init__(self, op, algorithm: str):
        self._op = op
        self.algorithm = algorithm
        self._retired = False       # returned by Waitany/Testany/Waitsome/Testall: inactive

    def Wait(self, timeout: float | None = None, status: Status | None = None) -> None:
        """Block until the op completes.

        Args:
            timeout: seconds; None uses AL_HANG_TIMEOUT (1800 s unless set; 0: wait forever).
            status: an aluminum_py.Status to fill with the receive's source, tag and count
                (Irecv, Isendrecv; other ops: the empty status), also ``request.status``.
        Raises:
            aluminum_py.TimeoutError: not complete in time (the op stays pending; Wait again).
            aluminum_py.MPIError: the op failed.
        """
        status_arg(status)
        self._wait(config.hang_timeout() if timeout is None else float(timeout))
        if status is not None:
            fill(status, _status_of(self._op))

    def _wait(self, timeout: float | None) -> None:
        if not self._op.wait(-1.0 if timeout is None else timeout):
            raise TimeoutError(f"{self._op.describe()}: not complete after {timeout:.3g} s "
                               f"(a peer that never joined?)")
        _check(self._op)

    def Test(self, status: Status | None = None) -> bool:
        """True if complete (raising if it failed); never blocks. `status`: as Wait's, filled
        once complete."""
        status_arg(status)
        if self._op.test():
            _check(self._op)
            if status is not None:
                fill(status, _status_of(self._op))
            return True
        return False

    @property
    def status(self) -> Status | None:
        """Once complete, the receive's Status (source, tag, count; Irecv, Isendrecv) or the
        empty status (other ops); None before."""
        return _status_of(self._op) if self._op.test() else None

    @property
    def done(self) -> bool:
        return self._op.test()

    @property
    def times(self) -> tuple[float, float] | None:
        """``(started, completed)``: when the op started running (in the progress engine,
        after the ops queued before it on the engine started) and when it completed, seconds
        on the ``time.monotonic()`` clock; None until complete.  For profiling: the op's
        running time is ``completed - started``; the time it queued is ``started`` minus when
        the call returned."""
        return self._op.times

    def __repr__(self) -> str:
        return f"<aluminum_py.Request {self._op.describe()} algorithm={self.algorithm}>"

    def __del__(self):
        try:
            self._op.orphan()
        except Exception:   # interpreter shutdown
            pass


def Waitall(requests: Iterable[Request | None], timeout: float | None = None) -> None:
    """Wait for every request; `timeout` bounds the whole call. Raises the first failure.
    None entries, and requests Waitany & co returned, are skipped (MPI_REQUEST_NULL)."""
    import time
    reqs = list(requests)
    if timeout is None:
        timeout = config.hang_timeout()
    deadline = None if timeout is None else time.monotonic() + timeout
    first: Error | None = None
    for r in reqs:
        if r is None or getattr(r, "_retired", False):    # MPI_REQUEST_NULL
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            r._wait(left)
        except TimeoutError:
            raise
        except Error as e:
            if first is None:
                first = e
    if first is not None:
        raise first


# ---- v-collectives: what a truncation means in each
_V_TRUNCATION = {
    "allgatherv": "every rank's len(sendbuf) must equal recvcounts[rank] on every rank",
    "gatherv": "rank i's len(sendbuf) must equal the root's recvcounts[i]",
    "scatterv": "the root's sendcounts[i] must equal len(recvbuf) on rank i",
    "alltoallv": "sendcounts[j] on rank i must equal recvcounts[i] on rank j",
    "reduce_scatterv": "recvcounts must be the same on every rank",
}


def v_truncation_hint(name: str, code: int) -> str:
    """For an MPI truncation error (MPI_ERR_TRUNCATE) of a v-collective: which arguments
    disagree across ranks (MPI does not say which rank; AL_CHECK=1 does, before the call).
    '' for anything else."""
    rule = _V_TRUNCATION.get(name)
    if rule is None or code <= 0:
        return ""
    from mpi4py import MPI
    try:
        truncated = MPI.Get_error_class(code) == MPI.ERR_TRUNCATE
    except MPI.Exception:
        return ""
    if not truncated:
        return ""
    return (f" (a rank sent more elements than its receiver's counts allow: {rule}; run with "
            f"AL_CHECK=1 to have the rank and the argument named before the call)")
# ---------------------------------------------------------------- Waitany, Testany, Testall,
# Waitsome.  As MPI's: None entries are MPI_REQUEST_NULL, and a request these return
# (complete) becomes inactive, skipped by later calls, so that ``for _ in reqs: Waitany(reqs)``
# visits each once.  Host requests are waited for on the engine's condition variable
# (_core.wait_any: no polling); GPU requests (aluminum_py.gpu.GpuRequest: an event query) are
# polled every _GPU_POLL seconds meanwhile.
_GPU_POLL = 1e-3


def _active(requests, name: str) -> tuple[list, list[int]]:
    """The list of `requests` and the indices of its active entries."""
    reqs = list(requests)
    for i, r in enumerate(reqs):
        if r is not None and not (isinstance(r, Request) or hasattr(r, "_wait")):
            raise TypeError(f"{name}: requests[{i}] is a {type(r).__name__}, not a request "
                            f"(aluminum_py.Request, a GPU request or None)")
    return reqs, [i for i, r in enumerate(reqs)
                  if r is not None and not getattr(r, "_retired", False)]


def _is_done(r) -> bool:
    if isinstance(r, Request):
        return r._op.test()
    try:
        return r.Test()
    except Error:            # its host part failed: complete; _finish raises the failure
        return True


def _finish(r, status: Status | None) -> None:
    """`r` is complete: make it inactive, fill `status`, raise its failure."""
    r._retired = True
    if isinstance(r, Request):
        if status is not None:
            fill(status, _status_of(r._op))
        _check(r._op)
    else:
        if status is not None:
            fill(status, Status())
        r.Wait()            # the bound stream waits for it; raises its host part's failure


def _timeout_arg(timeout, name: str) -> None:
    """Raise unless `timeout` is None or a number of seconds (before anything waits)."""
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, (int, float))):
        raise TypeError(f"{name}: timeout: expected seconds (a number) or None, got "
                        f"{type(timeout).__name__}")


def _wait_one(reqs: list, active: list[int], timeout: float | None, name: str) -> int:
    """Block until one of reqs[active] is complete; its index. TimeoutError after `timeout`
    seconds (None: AL_HANG_TIMEOUT, 1800 s unless set; 0: no limit)."""
    import time
    if timeout is None:
        timeout = config.hang_timeout()
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    host = [i for i in active if isinstance(reqs[i], Request)]
    gpu = [i for i in active if not isinstance(reqs[i], Request)]
    ops = [reqs[i]._op for i in host]
    while True:
        for i in gpu:
            if _is_done(reqs[i]):
                return i
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        step = left if not gpu else _GPU_POLL if left is None else min(left, _GPU_POLL)
        if ops:
            k = _core.wait_any(ops, -1.0 if step is None else step)
            if k >= 0:
                return host[k]
        elif step:
            time.sleep(step)
        if deadline is not None and time.monotonic() >= deadline:
            pending = "; ".join(reqs[i]._op.describe() if isinstance(reqs[i], Request)
                                else repr(reqs[i]) for i in active[:4])
            raise TimeoutError(f"{name}: none of {len(active)} requests complete after "
                               f"{float(timeout):.3g} s ({pending}"
                               f"{'; ...' if len(active) > 4 else ''}; a peer that never "
                               f"joined?)")


def Waitany(requests: Iterable[Request | None], timeout: float | None = None,
            status: Status | None = None) -> int:
    """Wait until one of `requests` completes and return its index (MPI_Waitany).

    The request returned becomes inactive: later Waitany/Testany/Waitsome/Testall/Waitall
    calls skip it, as they skip None entries (MPI_REQUEST_NULL).
    Args:
        timeout: seconds for the whole call; None: AL_HANG_TIMEOUT (1800 s unless set; 0: no
            limit).
        status: filled with the completed request's Status (its receive's, else empty).
    Returns:
        the index, or aluminum_py.UNDEFINED if no entry is active.
    Raises:
        aluminum_py.TimeoutError: none completed in time (all stay pending).
        aluminum_py.MPIError (...): the completed request failed (it is inactive now).
    """
    status_arg(status)
    _timeout_arg(timeout, "Waitany")
    reqs, active = _active(requests, "Waitany")
    if not active:
        return UNDEFINED
    i = next((i for i in active if _is_done(reqs[i])), None)
    if i is None:
        i = _wait_one(reqs, active, timeout, "Waitany")
    _finish(reqs[i], status)
    return i


def Testany(requests: Iterable[Request | None], status: Status | None = None) -> int | None:
    """The index of a complete request of `requests`, made inactive (as Waitany's), raising
    its failure; None if none is complete; aluminum_py.UNDEFINED if no entry is active.
    Never blocks."""
    status_arg(status)
    reqs, active = _active(requests, "Testany")
    if not active:
        return UNDEFINED
    i = next((i for i in active if _is_done(reqs[i])), None)
    if i is not None:
        _finish(reqs[i], status)
    return i


def Testall(requests: Iterable[Request | None]) -> bool:
    """True if every active request of `requests` is complete: they all become inactive, and
    the first failure among them is raised. False otherwise (nothing changes). Never blocks."""
    reqs, active = _active(requests, "Testall")
    if not all(_is_done(reqs[i]) for i in active):
        return False
    return _finish_all(reqs, active)


def _finish_all(reqs: list, done: list[int]) -> bool:
    first: Error | None = None
    for i in done:
        try:
            _finish(reqs[i], None)
        except Error as e:
            if first is None:
                first = e
    if first is not None:
        raise first
    return True


def Waitsome(requests: Iterable[Request | None], timeout: float | None = None) -> list[int]:
    """Wait until at least one of `requests` completes; the indices of all that are complete
    now, each made inactive (as Waitany's); [] if no entry is active. The first failure among
    them is raised (after all are made inactive).

    Raises:
        aluminum_py.TimeoutError: none completed within `timeout` (None: AL_HANG_TIMEOUT).
    """
    _timeout_arg(timeout, "Waitsome")
    reqs, active = _active(requests, "Waitsome")
    if not active:
        return []
    done = [i for i in active if _is_done(reqs[i])]
    if not done:
        first = _wait_one(reqs, active, timeout, "Waitsome")
        done = [i for i in active if i == first or _is_done(reqs[i])]
    _finish_all(reqs, done)
    return done
