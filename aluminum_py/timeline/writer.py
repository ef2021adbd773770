"""The timeline's writer: a daemon thread that takes what the ops recorded (``_core.trace_take``)
every `interval` seconds, turns the completed ones into events and appends them to the file.

The ops only append to a bounded list under the GIL (``_core``'s ``trace_append``): when it is
full they drop the item and count it, so an op never waits for the writer or for the disk.  The
file is one JSON object in the Trace Event Format's object form: ``traceEvents`` is written as
it goes, ``otherData`` (rank, clock offset, dropped events) last, by :meth:`Writer.close`.
"""
from __future__ import annotations

import json
import os
import threading

from .. import _core
from ..files import open_private
from .events import Tracks, dumps, events_of, start_of


class Writer:
    def __init__(self, path: str, rank: int, size: int, capacity: int, interval: float):
        self.path = path
        self.rank = rank
        self.size = size
        self.tracks = Tracks(rank)
        self.pending: list = []          # ops recorded and not complete yet
        self.dropped = 0
        self.written = 0                 # events (metadata excluded)
        self.clock: dict | None = None   # timeline.clock.measure's result, set by the session
        self.error: Exception | None = None   # what stopped the writer thread
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        self._file = os.fdopen(open_private(path), "w")     # 0600, no link followed
        self._file.write('{"displayTimeUnit":"ms","traceEvents":[\n')
        self._first = True
        self._emit([{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "ts": 0,
                     "args": {"name": f"rank {rank}"}},
                    {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "ts": 0,
                     "args": {"sort_index": rank}}])
        self._interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()    # drain: the thread's and close()'s
        _core.trace_start(capacity)
        self._thread = threading.Thread(target=self._run, name="aluminum_py timeline writer",
                                        daemon=True)
        self._thread.start()

    def before_fork(self) -> None:
        """os.fork(): no write in flight and nothing buffered, so the child's copy of the file
        object has nothing to write (after_fork releases)."""
        self._lock.acquire()
        self._file.flush()

    def after_fork(self, child: bool) -> None:
        self._lock.release()
        if child:           # the parent's file: the child never writes to it
            self._file = None

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._interval):
                self.drain()
        except Exception as e:          # noqa: BLE001 (reported by stop(); ops go on, dropped)
            self.error = e

    def drain(self, items=None, dropped=0) -> None:
        """Write the events of every recorded item that is complete; keep the others."""
        with self._lock:
            if items is None:
                items, dropped = _core.trace_take()
            self.dropped += dropped
            done, pending = [], []
            for it in self.pending + items:
                t = it if type(it) is tuple else it.trace()
                if t is None:
                    pending.append(it)
                else:
                    done.append(t)
            self.pending = pending
            done.sort(key=start_of)
            events = []
            for t in done:
                events += events_of(t, self.tracks)
            self.written += sum(1 for e in events if e["cat"] in ("op", "region", "bucket"))
            self._emit(self.tracks.meta + events)
            self.tracks.meta = []

    def _emit(self, events: list) -> None:
        if not events:
            return
        text = ",\n".join(dumps(e) for e in events)
        self._file.write(text if self._first else ",\n" + text)
        self._first = False

    def close(self, timeout: float = 10.0) -> dict:
        """Stop recording, write what completed, the metadata, close the file. Returns the
        metadata (``otherData``)."""
        self._stop.set()
        self._thread.join(timeout)
        items, dropped = _core.trace_stop()
        self.drain(items, dropped)
        meta = {"aluminum_py_timeline": 1, "rank": self.rank, "size": self.size,
                "clock": self.clock, "events": self.written, "dropped_events": self.dropped,
                "unfinished_ops": len(self.pending)}
        self.pending = []
        self._file.write(f'\n],"otherData":{json.dumps(meta)}}}\n')
        self._file.close()
        return meta
