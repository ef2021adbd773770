"""AL_CHECK=1: every collective call of the point-to-point algorithms and "mpi" first exchanges
its signature with the peers (as torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` does), so that ranks
calling differently raise :class:`~aluminum_py.Error` naming both calls.  A debugging aid: one
small allreduce per call, on a communicator of its own (the Communicator's third duplicate), so
that it never mixes with the calls' own traffic.  The "shm" rounds carry fingerprints always
(ext/al_shm.h) and are not checked here.
"""
from __future__ import annotations

import time

import numpy as np

from . import _core, config
from .errors import Error, TimeoutError

_KIND_NAMES = {k: n for n, k in _core.KINDS.items()}
_DTYPE_NAMES = {c: n for n, c in _core.DTYPES.items()}
_OP_NAMES = {c: n for n, c in _core.REDUCTION_OPS.items()}
_REDUCING = {"schedule", "allreduce", "reduce", "reduce_scatter", "hier_shm", "reduce_scatterv"}
_ROOTED = {"reduce", "bcast", "gather", "scatter", "gatherv", "scatterv"}
# The v-collectives: their counts differ from rank to rank, so the signature leaves them out and
# a second exchange (CallChecker._check_v) compares what each rank sends to each other rank with
# what that rank expects, naming the arguments of the first pair that differs: {i} sends {a}
# elements to {j}, which expects {b}.
_VCOUNTS = {
    "allgatherv": "rank {i}'s sendbuf has {a} elements but rank {j}'s recvcounts[{i}] is {b}",
    "gatherv": "rank {i}'s sendbuf has {a} elements but the root's (rank {j}) recvcounts[{i}] "
               "is {b}",
    "scatterv": "the root's (rank {i}) sendcounts[{j}] is {a} but rank {j}'s recvbuf has {b} "
                "elements",
    "alltoallv": "rank {i}'s sendcounts[{j}] is {a} but rank {j}'s recvcounts[{i}] is {b}",
    "reduce_scatterv": "rank {i}'s recvcounts[{j}] is {a} but rank {j}'s recvcounts[{j}] is {b}",
}


def signature(kind: int, count: int, dtype: int, rop: int, root: int, number: int) -> int:
    """A call's signature packed in 62 bits (so that -fp fits int64): kind 5 bits, dtype 5,
    op 4, root 16, count 31 (elements), the call number is not packed: it is compared as is."""
    name = _KIND_NAMES.get(kind, "")
    rop = rop if name in _REDUCING else 0
    root = root if name in _ROOTED else 0
    count = 0 if name in _VCOUNTS else count
    return (kind & 31) | (dtype & 31) << 5 | (rop & 15) << 10 | (root & 0xFFFF) << 14 | \
        (count & 0x7FFFFFFF) << 30


def describe(fp: int, number: int) -> str:
    """The call a signature stands for, e.g. "allreduce/ring(count=1000, float32, SUM, call #17)"
    (the kind's native name: a schedule is one of our allreduce algorithms)."""
    kind, dtype, rop = fp & 31, fp >> 5 & 31, fp >> 10 & 15
    root, count = fp >> 14 & 0xFFFF, fp >> 30 & 0x7FFFFFFF
    name = _KIND_NAMES.get(kind, "?")
    parts = ([] if name in _VCOUNTS else [f"count={count}"]) + [_DTYPE_NAMES.get(dtype, "?")]
    if name in _REDUCING:
        parts.append(_OP_NAMES.get(rop, "?"))
    if name in _ROOTED:
        parts.append(f"root={root}")
    label = {"schedule": "allreduce", "hier_shm": "allreduce/hierarchical"}.get(name, name)
    return f"{label}({', '.join(parts)}, call #{number})"


class CallChecker:
    """The Launcher's `checker` (launcher.pxi, check_call): called by the owner thread before
    each checked collective starts."""

    def __init__(self, comm, state):
        self.comm = comm                    # an MPI communicator used by nothing else
        self.state = state                  # the CommState (its broken mark)
        self.calls = 0
        self._v = None                      # (kind, sends, recvs) of the coming v-collective

    def expect_v(self, kind: int, sends, recvs) -> None:
        """The coming v-collective of `kind` (the next call) sends sends[j] elements to rank j
        and receives recvs[j] from rank j (-1: not significant on this rank)."""
        self._v = (kind, sends, recvs)

    def __call__(self, name, kind, count, dtype, rop, root) -> None:
        from mpi4py import MPI
        self.calls += 1
        fp = signature(kind, count, dtype, rop, root, self.calls)
        mine = np.array([fp, -fp, self.calls, -self.calls], dtype=np.int64)
        low = np.empty(4, dtype=np.int64)
        self._finish(self.comm.Iallreduce(mine, low, op=MPI.MIN), name)
        if low[0] == -low[1] and low[2] == -low[3]:
            if _KIND_NAMES.get(kind) in _VCOUNTS:     # the same v-collective on every rank
                self._check_v(name, kind)
            return
        every = np.empty((self.comm.Get_size(), 2), dtype=np.int64)
        self._finish(self.comm.Iallgather(np.array([fp, self.calls], dtype=np.int64), every),
                     name)
        other = next(r for r in range(len(every)) if tuple(every[r]) != tuple(every[0]))
        why = (f"rank 0 called {describe(int(every[0, 0]), int(every[0, 1]))}, rank {other} "
               f"called {describe(int(every[other, 0]), int(every[other, 1]))}: the ranks' calls "
               f"differ (AL_CHECK); the communicator is now unusable on every rank")
        self.state.mark_broken(why)
        raise Error(f"{name}: {why}")

    def _finish(self, req, name) -> None:
        """Wait for the exchange (wait_exchange: AL_HANG_TIMEOUT, a broken peer)."""
        wait_exchange(req, self.state, name, "AL_CHECK's signature exchange")

    def _check_v(self, name, kind) -> None:
        """Every rank called the v-collective `kind`: compare, for every pair of ranks, what
        one sends with what the other expects (expect_v); a difference breaks the communicator
        on every rank (MPI would truncate, or silently receive less)."""
        v, self._v = self._v, None
        size = self.comm.Get_size()
        mine = np.full(2 * size, -1, dtype=np.int64)
        if v is not None and v[0] == kind:
            mine[:size], mine[size:] = v[1], v[2]
        every = np.empty((size, 2 * size), dtype=np.int64)
        self._finish(self.comm.Iallgather(mine, every), name)
        sends, recvs = every[:, :size], every[:, size:].T      # recvs[i, j]: j expects from i
        bad = np.argwhere((sends >= 0) & (recvs >= 0) & (sends != recvs))
        if bad.size == 0:
            return
        i, j = (int(x) for x in bad[0])
        why = (_VCOUNTS[_KIND_NAMES[kind]].format(i=i, j=j, a=int(sends[i, j]),
                                                   b=int(recvs[i, j]))
               + " (AL_CHECK: the counts of the ranks' calls differ); the communicator is now "
                 "unusable on every rank")
        self.state.mark_broken(why)
        raise Error(f"{name}: {why}")


def wait_exchange(req, state, name: str, what: str) -> None:
    """Wait for the MPI request `req` of a library-internal exchange: raise if a peer broke the
    communicator (it will never join) or after AL_HANG_TIMEOUT."""
    timeout = config.hang_timeout()
    start = time.monotonic()
    polls = 0
    while not req.Test():
        polls += 1
        if polls % 64 == 0:
            why = state.broken
            if why is not None:
                raise Error(f"{name}: this communicator is unusable: {why}")
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f"{name}: {what} not complete after {timeout:g} s (a peer "
                                   f"that never called?)")
        time.sleep(0 if polls < 1000 else 1e-4)
