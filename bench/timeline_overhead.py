"""What recording a timeline costs a 4-byte Allreduce, interleaved in one run.

    python bench/timeline_overhead.py [--calls 20000] [--batches 9] [--json F] [--csv F]

Each batch runs ``--calls`` in-place 4 B float32 ``comm.Allreduce(x)`` back to back in three
states (harness.measure_batches): ``off`` (the peer: the timeline compiled in, not recording),
``on_writer_idle`` (recording; the writer's pass is deferred until the state ends, so this is
the op's own cost: a clock read and a list append) and ``on`` (recording, the writer thread
taking and writing the events every 0.1 s, as in use: it shares the GIL with the caller).  The
table gives the median over batches of the time per call in microseconds; ``added_us`` is each
state's time per call minus ``off``'s.  For the cost against a build without the timeline, run
bench/call_overhead.py with both builds.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import timeline

import harness


class Recording:
    """A call that runs the allreduce with the timeline in one state: it starts recording at
    its first call of a batch and stops (the writer's deferred pass, untimed) before the next
    contender's turn (``harness.measure_batches`` calls ``before_turn``)."""

    def __init__(self, comm, x, interval: float | None, path: str, calls: int):
        self.comm, self.x, self.interval, self.path, self.calls = comm, x, interval, path, calls
        self.recording = False

    def __call__(self):
        if self.interval is not None and not self.recording:
            timeline.start(self.path, buffer=self.calls + 256, interval=self.interval)
            self.recording = True
        self.comm.Allreduce(self.x)

    def stop(self):
        if self.recording:
            meta = timeline.stop()
            self.recording = False
            assert meta["dropped_events"] == 0, meta


def main(argv=None) -> int:
    args = harness.parse(harness.options(__doc__, sizes=None, batches=(20000, 9)), argv)
    comm = al.Communicator()
    world = MPI.COMM_WORLD
    x = np.ones(1, dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json")
        states = {"off": Recording(comm, x, None, path, args.calls),
                  "on_writer_idle": Recording(comm, x, 3600.0, path, args.calls),
                  "on": Recording(comm, x, 0.1, path, args.calls)}
        samples = harness.measure_batches(world, states, args.calls, args.batches,
                                          before_turn=lambda: [s.stop() for s in states.values()])
        for s in states.values():
            s.stop()
    med = {k: float(np.median(v)) * 1e6 for k, v in samples.items()}
    report = harness.Report(world, args, f"4 B Allreduce, time per call, {args.calls} calls x "
                            f"{args.batches} batches", keys=["bytes"],
                            ours=["on_writer_idle", "on"], peers=["off"])
    report.row({"bytes": 4}, med, added_us={k: med[k] - med["off"] for k in med})
    rc = report.finish()
    comm.Free()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
