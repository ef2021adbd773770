"""What the slot stores' trials cost shm (al_shm.h, "Trials within a call"): the same calls with
trials within a call (the default from 10 rounds) and with trials of 3 whole calls (as below 10
rounds, and at every size before), alternated.

    mpiexec -n 2 python bench/shm_trials.py [--sizes 4MiB,16MiB,64MiB] [--calls 200] [--runs 3]
        [--settings within,whole,cached,streamed]

Each run makes a new communicator (a new segment: new size classes, as a program's start) for
each setting in random order, then times `--calls` shm allreduces of each size back to back (a
barrier before each call, the max over ranks).  Per setting and size: the median, the mean
(which carries what the trials cost), the 90th percentile and the maximum in ms, the calls over
twice the median, how many of rank 0's calls streamed the slots (the class's kind as a whole),
and the placement the probe found at setup.  Its figures are in
docs/performance.md ("Trials within a call").
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import parse_bytes, shm_stores_class

SETTINGS = {"within": (0, 1), "whole": (0, 0), "cached": (1, 1), "streamed": (2, 1)}
# (AL_SHM_SLOT_STORES: 0 measured, 1 cached, 2 streamed; trials within a call or not)


def run(world, sizes: list[int], calls: int) -> tuple[dict, dict, float]:
    """`calls` shm allreduces of each size on a new communicator: the times (s) per size, how
    many of rank 0's calls of the size streamed the slots (al_shm.h: in its kind as a whole),
    and the probe's round trip (ns; 0: none)."""
    comm = al.Communicator(world)
    try:
        info = _core.shm_info(comm._state)
        times, streamed = {}, {}
        for n in sizes:
            x = np.ones(n // 4, np.float32)
            out = np.full_like(x, 0.0)          # (its pages touched: no faults in the timing)
            t = []
            for _ in range(calls):
                world.Barrier()
                t0 = time.perf_counter()
                comm.Allreduce(x, out, algorithm="shm")
                t.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            if out[0] != world.size:
                raise SystemExit(f"wrong result {out[0]} at {n} B")
            times[n] = np.array(t)
            cls = shm_stores_class(_core.shm_info(comm._state), n) or {}
            streamed[n] = cls.get("streamed", "-")
        return times, streamed, (info or {}).get("round_trip_ns", 0.0)
    finally:
        comm.Free()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4MiB,16MiB,64MiB")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--settings", default="within,whole",
                    help="of within, whole (the measured choice, its trials within a call or of "
                         "3 whole calls), cached, streamed (one kind, fixed)")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rng = random.Random(7)
    if world.rank == 0:
        print(f"# {world.size} ranks, {args.calls} shm allreduces per size and setting: "
              "median / mean / p90 / max ms, calls over 2x the median, calls that streamed the "
              "slots; probe at setup",
              flush=True)
    before = _core._set_shm_part_trials(1)
    try:
        for r in range(args.runs):
            order = args.settings.split(",")
            rng.shuffle(order)
            for name in order:
                _core.set_shm_slot_stores(SETTINGS[name][0])
                _core._set_shm_part_trials(SETTINGS[name][1])
                times, streamed, rt = run(world, sizes, args.calls)
                if world.rank == 0:
                    cells = []
                    for n, t in times.items():
                        med = float(np.median(t))
                        cells.append(f"{n >> 20} MiB {med * 1e3:.2f} / {t.mean() * 1e3:.2f} / "
                                     f"{np.percentile(t, 90) * 1e3:.2f} / {t.max() * 1e3:.1f}, "
                                     f"{int((t > 2 * med).sum())} over 2x, "
                                     f"{streamed[n]} streamed")
                    print(f"run {r + 1} {name:>6} ({time.strftime('%H:%M:%S')}, probe "
                          f"{rt:.0f} ns): " + "; ".join(cells), flush=True)
    finally:
        _core._set_shm_part_trials(before)
        _core.set_shm_slot_stores(al.config.shm_slot_stores())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
