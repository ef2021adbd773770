"""A per-rank timeline of every operation, in the Trace Event Format (docs/timeline.md).

``AL_TIMELINE=path`` (read at import) or :func:`start` records every op of every communicator
of this rank, the user's regions (:func:`region`) and the GradientSynchronizer's buckets into
``path`` with the rank substituted (:func:`rank_path`); :func:`stop` (or interpreter exit)
writes the rest.  ``python -m aluminum_py timeline merge`` puts the ranks' files on rank 0's
clock and ``timeline plot`` draws training steps (:mod:`.merge`, :mod:`.plot`).

While the timeline is off, an op pays one test of a module variable in the native launcher.
"""
from __future__ import annotations

import os
import sys
import time

from .. import _core, config
from ..errors import Error
from . import clock
from .writer import Writer

__all__ = ["start", "stop", "region", "recording", "rank_path"]

_writer: Writer | None = None
_env_error: str | None = None       # why AL_TIMELINE could not be recorded to at import


def rank_path(path: str, rank: int) -> str:
    """The file of `rank`: ``{rank}`` in `path` replaced by the rank, else ``.rank<N>`` put
    before a ``.json`` suffix (``t.json`` -> ``t.rank1.json``) or appended with ``.json``
    (``run/t`` -> ``run/t.rank1.json``)."""
    path = os.fspath(path)
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    base = path[:-5] if path.endswith(".json") else path
    return f"{base}.rank{rank}.json"


def recording() -> bool:
    """Whether the timeline records (AL_TIMELINE or start())."""
    return _writer is not None


def start(path, comm=None, *, buffer: int | None = None, interval: float = 0.1) -> str:
    """Record a timeline into :func:`rank_path`\\ (`path`, this rank's ``MPI.COMM_WORLD`` rank).

    Args:
        path: the file name pattern (:func:`rank_path`); directories are created.
        comm: an aluminum_py.Communicator: measure the clock offsets to its rank 0 now
            (collective over `comm`: call start on all its ranks).  Communicators constructed
            while the timeline records measure them in their constructor without it.
        buffer: items the ops may record between two writer passes (default
            AL_TIMELINE_BUFFER, 65536); beyond it they are dropped and counted.
        interval: seconds between writer passes.
    Returns:
        The file written.
    Raises:
        aluminum_py.Error: the timeline already records, or the file cannot be opened (a
            planted link is never followed); with `comm`, on every rank of it when one rank
            cannot open its file.
    """
    global _writer, _env_error
    from mpi4py import MPI
    if _writer is not None:
        raise Error(f"timeline: already recording to {_writer.path} (call stop() first)")
    if buffer is None:
        buffer = config.timeline_buffer()
    if buffer < 1:
        raise ValueError(f"buffer: expected at least 1 item, got {buffer}")
    world = MPI.COMM_WORLD
    file = rank_path(path, world.Get_rank())
    error = None
    try:
        _writer = Writer(file, world.Get_rank(), world.Get_size(), buffer, interval)
    except OSError as e:
        error = f"timeline: cannot record to {file}: {e}"
    if comm is not None:
        # every rank of `comm` fails alike, before the clock sync that all of them must join
        errors = comm.mpi_comm.allgather(error)
        error = config.first_error(errors)
    if error is not None:
        stop()
        raise Error(error)
    _env_error = None
    if comm is not None:
        try:
            sync_clock(comm)
        except BaseException:
            stop()
            raise
    return _writer.path


def stop() -> dict | None:
    """Stop recording and complete the file. Returns its metadata (``otherData``: rank, clock
    offset, events written, dropped events, ops not complete), None if not recording.  Dropped
    events are reported on stderr."""
    global _writer
    w, _writer = _writer, None
    if w is None:
        return None
    meta = w.close()
    if w.error is not None:
        print(f"aluminum_py timeline: rank {meta['rank']}: the writer failed ({w.error}); "
              f"{w.path} may lack events", file=sys.stderr)
    if meta["dropped_events"]:
        print(f"aluminum_py timeline: rank {meta['rank']}: {meta['dropped_events']} events "
              f"dropped (the buffer was full; AL_TIMELINE_BUFFER) in {w.path}", file=sys.stderr)
    return meta


def sync_clock(comm) -> dict | None:
    """Measure this rank's clock offset to `comm`'s rank 0 (collective over `comm`) and keep it
    if it is the best so far (:func:`clock.better`). Does nothing unless recording."""
    w = _writer
    if w is None or comm.size < 2:
        return None
    c = clock.measure(comm.mpi_comm, timeout=config.hang_timeout())
    if clock.better(c, w.clock):
        w.clock = c
    return c


def on_communicator(comm) -> None:
    """Called by every Communicator's constructor (collective): the clock sync, when recording."""
    if _writer is not None:
        sync_clock(comm)


def record_buckets(step: int, buckets, timings) -> None:
    """The synchronizer's buckets of one step: per bucket ``(launched, started, completed)``."""
    for b, (members, t) in enumerate(zip(buckets, timings)):
        _core.trace_record(("bucket", step, b, tuple(members)) + tuple(t))


def record_enqueued(name: str, t_call: float, stream: int, nbytes: int | None = None,
                    dtype: str | None = None, op: str | None = None) -> None:
    """An NCCL operation enqueued on `stream` from `t_call` until now: the host's part only
    (when it runs on the device is not known to the host)."""
    _core.trace_record(("enqueued", name, t_call, time.monotonic(), stream, nbytes, dtype, op))


class region:
    """``with al.timeline.region("backward"): ...``: marks compute on the compute track.
    Costs two clock reads while recording, nothing else otherwise."""

    __slots__ = ("name", "t0")

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        if _writer is not None:
            _core.trace_record(("region", self.name, self.t0, time.monotonic()))
        return False


def _before_fork() -> None:
    if _writer is not None:
        _writer.before_fork()


def _after_fork(child: bool) -> None:
    global _writer
    if _writer is not None:
        _writer.after_fork(child)
        if child:           # the child records nothing and leaves the parent's file alone
            _writer = None
            _core.trace_stop()


os.register_at_fork(before=_before_fork, after_in_parent=lambda: _after_fork(False),
                    after_in_child=lambda: _after_fork(True))


def start_from_env() -> None:
    """AL_TIMELINE: start at import (the library's _shutdown.install).  A file that cannot be
    opened does not fail the import (it would end this rank alone, and its peers would wait
    for it): every rank's Communicator() raises it (:func:`agreement`)."""
    global _env_error
    path = config.timeline()
    if path:
        try:
            start(path)
        except Error as e:
            _env_error = f"environment variable AL_TIMELINE={path!r}: {e}"


def agreement():
    """This rank's part of the comparison at Communicator() (``topology.compute`` gathers it
    from every rank): why AL_TIMELINE could not be recorded to (a str), else whether the
    timeline records (each Communicator then measures the clock offsets, a collective)."""
    return _env_error or recording()


def disagreement(answers) -> str | None:
    """The error of the ranks' :func:`agreement` answers, raised by every rank's
    Communicator(): a rank could not record, or some ranks record and others do not; None when
    every rank records or none does."""
    error = config.first_error(answers)
    if error is not None:
        return f"{error}; no Communicator is made until every rank records or none does"
    on = [r for r, a in enumerate(answers) if a]
    if on and len(on) < len(answers):
        return (f"timeline: ranks {on} record a timeline (AL_TIMELINE or timeline.start()) "
                f"and the others do not: every rank must record or none, as each "
                f"Communicator measures the clock offsets (collective); set AL_TIMELINE the "
                f"same on every rank")
    return None
