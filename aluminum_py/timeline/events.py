"""Trace Event Format events from what the timeline records: the tracks (``tid``) of one rank,
their names, and the complete (``"X"``) events of ops, user regions and synchronizer buckets.

Times are microseconds on this rank's monotonic clock (``time.monotonic() * 1e6``); ``merge``
moves them onto rank 0's clock.  Events on one track never overlap: an op that overlaps the
last event of its track's first lane goes to the next lane (``"communicator 0 #2"``), so every
viewer draws it (Trace Event Format viewers expect the complete events of one thread to nest).
"""
from __future__ import annotations

import json

from .. import _core

# track ids: their order is the order viewers list them in (thread_sort_index)
COMPUTE_TID = 1                 # user regions (timeline.region)
BUCKETS_TID = 10                # + lane: the synchronizer's bucket all-reduces
ENGINE_TID = 100                # + lane: ops while the progress engine ran them
COMM_TID = 1000                 # * (communicator index + 1) + lane
STREAM_TID = 1_000_000          # + 1000 * stream index + lane: GPU (host-transfer) ops

_DTYPE_NAMES = {code: name for name, code in _core.DTYPES.items()}
_OP_NAMES = {code: name.lower() for name, code in _core.REDUCTION_OPS.items()}
_K_HOST_TRANSFER = _core.KINDS["host_transfer"]
# ops whose reduction op means something (the others carry a meaningless op code)
_REDUCING = ("allreduce", "reduce", "reduce_scatter", "reduce_scatterv")
# host-transfer phases (_core.ht_times order): the phase that ended at each time
HT_PHASES = ("device-to-host", "host algorithm", "release", "host-to-device")


def us(t: float) -> float:
    """Seconds on the monotonic clock -> trace microseconds."""
    return round(t * 1e6, 3)


class Tracks:
    """The tracks of one rank: a tid per (track, lane), named on first use."""

    def __init__(self, pid: int):
        self.pid = pid
        self._ends: dict[int, float] = {}        # tid -> end of its last event
        self._comms: dict[int, tuple[int, str]] = {}   # id(CommState) -> (index, name)
        self._streams: dict[int, int] = {}
        self._keep: list = []                    # the CommStates: their ids are never reused
        self.meta: list[dict] = []               # thread_name events not written yet

    def comm(self, state) -> tuple[int, str]:
        key = id(state)
        if key not in self._comms:
            k = len(self._comms)
            self._comms[key] = (k, f"communicator {k} (rank {state.rank} of {state.size})")
            self._keep.append(state)
        return self._comms[key]

    def stream(self, handle: int) -> int:
        return self._streams.setdefault(handle, len(self._streams))

    def lane(self, base: int, name: str, start: float, end: float) -> int:
        """The first lane of track `base` whose last event ended by `start`."""
        lane = 0
        while self._ends.get(base + lane, -1.0) > start:
            lane += 1
        tid = base + lane
        if tid not in self._ends:
            self._name(tid, name if lane == 0 else f"{name} #{lane + 1}")
        self._ends[tid] = end
        return tid

    def fixed(self, tid: int, name: str) -> int:
        if tid not in self._ends:
            self._name(tid, name)
            self._ends[tid] = 0.0
        return tid

    def _name(self, tid: int, name: str) -> None:
        self.meta.append({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": tid, "ts": 0,
                          "args": {"name": name}})
        self.meta.append({"ph": "M", "name": "thread_sort_index", "pid": self.pid, "tid": tid,
                          "ts": 0, "args": {"sort_index": tid}})


def _x(name, cat, pid, tid, start, end, args=None) -> dict:
    ev = {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": us(start),
          "dur": max(0.0, round(us(end) - us(start), 3))}
    if args:
        ev["args"] = args
    return ev


def op_events(t: tuple, tracks: Tracks) -> list[dict]:
    """The events of one completed op (a ``NativeOp.trace()`` tuple): one ``cat: "op"`` event
    from the call to completion on its communicator's track (a GPU op: on its stream's track),
    its phases as nested ``cat: "phase"`` events, and, when the progress engine ran it, its
    running span on the engine's track (``cat: "engine"``)."""
    (name, kind, called, started, done, count, esize, dtype, rop, state, engine, err, stream,
     ht) = t
    pid = tracks.pid
    called = called if called > 0 else started
    k, comm_name = tracks.comm(state)
    args = {"bytes": count * esize, "count": count, "dtype": _DTYPE_NAMES.get(dtype, str(dtype)),
            "communicator": k, "engine": bool(engine),
            "queued_us": round(max(0.0, started - called) * 1e6, 3),
            "run_us": round(max(0.0, done - started) * 1e6, 3)}
    if name.split("/")[0] in _REDUCING:
        args["op"] = _OP_NAMES.get(rop, str(rop))
    if "/" in name:
        args["algorithm"] = name.split("/", 1)[1]
    if err:
        args["error"] = err
    if kind == _K_HOST_TRANSFER:
        s = tracks.stream(stream)
        tid = tracks.lane(STREAM_TID + 1000 * s, f"stream {s} (0x{stream:x})", called, done)
    else:
        tid = tracks.lane(COMM_TID * (k + 1), comm_name, called, done)
    out = [_x(name, "op", pid, tid, called, done, args)]
    if engine and started > called:
        out.append(_x("queued", "phase", pid, tid, called, started))
    if ht is not None:
        prev = started
        for phase, end in zip(HT_PHASES, ht):
            if end > 0:
                out.append(_x(phase, "phase", pid, tid, prev, end))
                prev = end
    if engine:
        etid = tracks.lane(ENGINE_TID, "progress engine", started, done)
        out.append(_x(name, "engine", pid, etid, started, done, {"communicator": k}))
    return out


def enqueued_events(name: str, called: float, returned: float, stream: int, nbytes, dtype, op,
                    tracks: Tracks) -> list[dict]:
    """An NCCL operation on its stream's track: from the call until it was enqueued (the
    device's execution is not seen by the host)."""
    s = tracks.stream(stream)
    tid = tracks.lane(STREAM_TID + 1000 * s, f"stream {s} (0x{stream:x})", called, returned)
    args = {"algorithm": "nccl", "enqueued_only": True}
    if nbytes is not None:
        args.update(bytes=nbytes, dtype=dtype, op=op.lower())
    return [_x(name, "op", tracks.pid, tid, called, returned, args)]


def region_events(name: str, start: float, end: float, tracks: Tracks) -> list[dict]:
    """A user region (``timeline.region``) on the compute track."""
    tid = tracks.fixed(COMPUTE_TID, "compute (timeline.region)")
    return [_x(name, "region", tracks.pid, tid, start, end)]


def bucket_events(step: int, bucket: int, grads, launched: float, started: float,
                  completed: float, tracks: Tracks) -> list[dict]:
    """A synchronizer bucket's all-reduce: launched (``grad_ready``) to completed, with its
    queued part (launched to started) nested."""
    tid = tracks.lane(BUCKETS_TID, "buckets (GradientSynchronizer)", launched, completed)
    args = {"step": step, "bucket": bucket, "gradients": list(grads),
            "queued_us": round(max(0.0, started - launched) * 1e6, 3),
            "run_us": round(max(0.0, completed - started) * 1e6, 3)}
    out = [_x(f"bucket {bucket}", "bucket", tracks.pid, tid, launched, completed, args)]
    if started > launched:
        out.append(_x("queued", "phase", tracks.pid, tid, launched, started))
    return out


def start_of(item) -> float:
    """When a recorded item began (the writer orders a batch by it before assigning lanes)."""
    if item[0] in ("region", "enqueued"):
        return item[2]
    if item[0] == "bucket":
        return item[4]
    return item[2] if item[2] > 0 else item[3]


def events_of(item, tracks: Tracks) -> list[dict]:
    """The events of one recorded item: an op's trace tuple, ("region", name, start, end),
    ("bucket", step, bucket, gradients, launched, started, completed) or ("enqueued", name,
    called, returned, stream, bytes, dtype, op)."""
    if item[0] == "region":
        return region_events(item[1], item[2], item[3], tracks)
    if item[0] == "bucket":
        return bucket_events(*item[1:], tracks)
    if item[0] == "enqueued":
        return enqueued_events(*item[1:], tracks)
    return op_events(item, tracks)


def dumps(event: dict) -> str:
    return json.dumps(event, separators=(",", ":"))
