"""Requests returned by the nonblocking (I-prefixed) operations."""
from __future__ import annotations

from typing import Iterable

from . import _core, config
from .errors import Error, MPIError, TimeoutError


def _check(op) -> None:
    err = op.error
    if err is not None:
        code, msg = err
        if code == _core.ERR_TIMEOUT:      # abandoned by the engine at its AL_HANG_TIMEOUT deadline
            raise TimeoutError(f"{op.name}: {msg}")
        raise MPIError(f"{op.name}: {msg}{v_truncation_hint(op.name, code)}", code)


class Request:
    """A pending operation. Holds the buffers it reads and writes until it completes.

    Attributes:
        algorithm: the algorithm that runs the op (``"ring"``, ``"mpi"``, ...).
    """

    __slots__ = ("_op", "algorithm")

    def __init__(self, op, algorithm: str):
        self._op = op
        self.algorithm = algorithm

    def Wait(self, timeout: float | None = None) -> None:
        """Block until the op completes.

        Args:
            timeout: seconds; None uses AL_HANG_TIMEOUT (unset: wait forever).
        Raises:
            aluminum_py.TimeoutError: not complete in time (the op stays pending; Wait again).
            aluminum_py.MPIError: the op failed.
        """
        self._wait(config.hang_timeout() if timeout is None else float(timeout))

    def _wait(self, timeout: float | None) -> None:
        if not self._op.wait(-1.0 if timeout is None else timeout):
            raise TimeoutError(f"{self._op.describe()}: not complete after {timeout:.3g} s "
                               f"(a peer that never joined?)")
        _check(self._op)

    def Test(self) -> bool:
        """True if complete (raising if it failed); never blocks."""
        if self._op.test():
            _check(self._op)
            return True
        return False

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


def Waitall(requests: Iterable[Request], timeout: float | None = None) -> None:
    """Wait for every request; `timeout` bounds the whole call. Raises the first failure."""
    import time
    reqs = list(requests)
    if timeout is None:
        timeout = config.hang_timeout()
    deadline = None if timeout is None else time.monotonic() + timeout
    first: Error | None = None
    for r in reqs:
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


# ---- v-collectives: what a truncation means in each (issue 29)
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
