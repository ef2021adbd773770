"""Clock offsets to a communicator's rank 0: a barrier, then ping-pongs (collective over the
communicator).

Rank r sends a ping at its time ``a``, rank 0 answers with its time ``T``, r reads the answer at
its time ``b``; then ``T - (a + b) / 2`` is rank 0's clock minus r's, to within half the round
trip ``(b - a) / 2``.  Of `rounds` ping-pongs the one with the shortest round trip is kept
(the least delayed by the scheduler).  Rank 0 answers the ranks one after another.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import TimeoutError

TAG = 32767        # MPI guarantees tags up to 32767; the library's schedules use 1..32000


def _wait(reqs, deadline: float | None, what: str) -> None:
    from mpi4py import MPI
    spins = 0
    while not MPI.Request.Testall(reqs):
        spins += 1
        if spins > 2000:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"timeline clock sync: {what} not complete in time "
                                   "(AL_HANG_TIMEOUT): is the timeline on on every rank?")
            time.sleep(1e-4)


def measure(mpi_comm, rounds: int = 16, timeout: float | None = None) -> dict:
    """This rank's clock offset to rank 0 of `mpi_comm` (collective).

    Returns ``{"offset_us", "uncertainty_us", "reference", "rounds"}``: rank 0's monotonic clock
    is this rank's plus ``offset_us`` (to within ``uncertainty_us``), ``reference`` the
    ``MPI.COMM_WORLD`` rank of `mpi_comm`'s rank 0.
    Raises:
        aluminum_py.TimeoutError: a rank did not take part within `timeout` seconds.
    """
    from mpi4py import MPI
    deadline = None if timeout is None else time.monotonic() + timeout
    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    group, world = mpi_comm.Get_group(), MPI.COMM_WORLD.Get_group()
    reference = MPI.Group.Translate_ranks(group, [0], world)[0]
    group.Free()
    world.Free()
    _wait([mpi_comm.Ibarrier()], deadline, "the barrier")
    ping, pong = np.zeros(1), np.zeros(1)
    result = {"offset_us": 0.0, "uncertainty_us": 0.0, "reference": reference, "rounds": rounds}
    if rank == 0:
        for r in range(1, size):
            for _ in range(rounds):
                _wait([mpi_comm.Irecv(ping, source=r, tag=TAG)], deadline, f"rank {r}'s ping")
                pong[0] = time.monotonic()
                _wait([mpi_comm.Isend(pong, dest=r, tag=TAG)], deadline, f"the pong to rank {r}")
        return result
    best = None
    for _ in range(rounds):
        a = time.monotonic()
        reqs = [mpi_comm.Irecv(pong, source=0, tag=TAG), mpi_comm.Isend(ping, dest=0, tag=TAG)]
        _wait(reqs, deadline, "rank 0's pong")
        b = time.monotonic()
        if best is None or b - a < best[0]:
            best = (b - a, pong[0] - (a + b) / 2)
    result["offset_us"] = round(best[1] * 1e6, 3)
    result["uncertainty_us"] = round(best[0] / 2 * 1e6, 3)
    return result


def better(new: dict, old: dict | None) -> bool:
    """Whether offset `new` should replace `old`: one to world rank 0 first, then the tighter."""
    if old is None:
        return True
    return ((new["reference"] == 0, -new["uncertainty_us"])
            > (old["reference"] == 0, -old["uncertainty_us"]))
