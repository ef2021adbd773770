"""What recording a timeline costs a 4-byte Allreduce, interleaved in one run.

    python bench/timeline_overhead.py [--calls 20000] [--batches 9] [--json FILE]

Each batch times ``--calls`` in-place 4 B float32 ``comm.Allreduce(x)`` back to back in three
states, order rotated per batch: ``off`` (the timeline compiled in, not recording: the
launcher's one test), ``on, writer idle`` (recording; the writer's pass is deferred until after
the batch, so this is the op's own added cost: a clock read and a list append) and ``on``
(recording with the writer thread taking and writing events every 0.1 s, as in use: it shares
the GIL with the caller).  The table gives the median over batches of the time per call and the
added time per op against ``off``.  For the cost against a build without the timeline, run
bench/call_overhead.py with both builds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

import aluminum_py as al
from aluminum_py import timeline


def per_call_us(comm, x, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        comm.Allreduce(x)
    return (time.perf_counter() - t0) / calls * 1e6


def run_state(state: str, comm, x, calls: int, tmp: str) -> float:
    if state == "off":
        return per_call_us(comm, x, calls)
    interval = 3600.0 if state == "on, writer idle" else 0.1
    timeline.start(os.path.join(tmp, "t.json"), buffer=calls + 16, interval=interval)
    try:
        return per_call_us(comm, x, calls)
    finally:
        meta = timeline.stop()                    # the deferred writer pass runs here, untimed
        assert meta["events"] == calls and meta["dropped_events"] == 0, meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--batches", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    comm = al.Communicator()
    x = np.ones(1, dtype=np.float32)
    states = ["off", "on, writer idle", "on"]
    times = {s: [] for s in states}
    with tempfile.TemporaryDirectory() as tmp:
        for s in states:                          # warm-up
            run_state(s, comm, x, min(args.calls, 2000), tmp)
        for b in range(args.batches):
            for s in states[b % 3:] + states[:b % 3]:
                times[s].append(run_state(s, comm, x, args.calls, tmp))
    med = {s: statistics.median(v) for s, v in times.items()}
    if comm.rank == 0:
        print(f"# 4 B Allreduce, {comm.size} rank(s), {args.calls} calls x {args.batches} batches;"
              " median us per call")
        print(f"{'state':>18} {'us/call':>9} {'added us/op':>12}")
        for s in states:
            print(f"{s:>18} {med[s]:9.3f} {med[s] - med['off']:12.3f}")
    if args.json and comm.rank == 0:
        with open(args.json, "w") as f:
            json.dump({"calls": args.calls, "batches": args.batches, "size": comm.size,
                       "times_us": times, "median_us": med}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
