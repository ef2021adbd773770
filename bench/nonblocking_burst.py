"""Back-to-back nonblocking allreduces (a framework's fused gradient buckets): per-op time of a
burst of K ``Iallreduce`` calls on distinct buffers, then one ``Waitall``.

    mpiexec -n 2 python bench/nonblocking_burst.py [--burst 8] [--sizes 64KiB,...] [--op avg]
        [--reps 7] [--rounds 3] [--json FILE]

Contenders, interleaved in one run (each round runs every contender once per size):

* ``aluminum_py``: the progress engine as configured by default (large all-reduces on one
  communicator run one at a time, ``AL_ENGINE_SERIAL_BYTES``, default 1 MiB);
* ``aluminum_py, together``: the same with ``AL_ENGINE_SERIAL_BYTES=0`` (every op progressed
  together);
* ``mpi4py Iallreduce``: MPI's own nonblocking allreduce, ``MPI.Request.Waitall``.  MPI has no
  average: for ``--op avg`` it runs SUM followed by a numpy division, as a user would.

A sample is the burst's time divided by K, the max over ranks; the table shows the median of
the rounds' medians in microseconds and the ratio to mpi4py (lower is better).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core, config
from aluminum_py.bench.timing import human, parse_bytes

DEFAULT_SIZES = "64KiB,256KiB,1MiB,4MiB,16MiB"


def burst_al(comm, xs, op):
    al.Waitall([comm.Iallreduce(x, op=op) for x in xs], timeout=300)


def burst_mpi(world, xs, avg):
    MPI.Request.Waitall([world.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM) for x in xs])
    if avg:
        for x in xs:
            x /= world.size


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="bytes per allreduce, comma-separated")
    ap.add_argument("--op", choices=("avg", "sum"), default="avg")
    ap.add_argument("--reps", type=int, default=7, help="bursts per contender per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    op = al.AVG if args.op == "avg" else al.SUM
    serial = config.engine_serial_bytes()
    names = ["aluminum_py", "aluminum_py, together", "mpi4py Iallreduce"]
    rows = []
    for nbytes in [parse_bytes(s) for s in args.sizes.split(",")]:
        xs = [np.ones(max(1, nbytes // 4), dtype=np.float32) for _ in range(args.burst)]
        runs = {
            names[0]: lambda: (_core.set_serial_bytes(serial), burst_al(comm, xs, op)),
            names[1]: lambda: (_core.set_serial_bytes(0), burst_al(comm, xs, op)),
            names[2]: lambda: burst_mpi(world, xs, args.op == "avg"),
        }
        per_round = {n: [] for n in names}
        for rnd in range(args.rounds):
            order = names[rnd % 3:] + names[:rnd % 3]
            for name in order:
                runs[name]()                           # warm-up, and sets the engine mode
                ts = []
                for _ in range(args.reps):
                    world.Barrier()
                    t0 = time.perf_counter()
                    runs[name]()
                    ts.append((time.perf_counter() - t0) / args.burst)
                per_round[name].append(world.allreduce(float(np.median(ts)), op=MPI.MAX))
        _core.set_serial_bytes(serial)
        med = {n: float(np.median(v)) for n, v in per_round.items()}
        rows.append({"bytes": nbytes, "us": {n: t * 1e6 for n, t in med.items()}})
    if world.rank == 0:
        print(f"# {world.size} ranks, burst of {args.burst} Iallreduce ({args.op.upper()}, "
              f"float32) then Waitall; per-op us, median of {args.rounds} rounds x "
              f"{args.reps} bursts; AL_ENGINE_SERIAL_BYTES={serial}")
        print(f"{'size':>8} " + " ".join(f"{n:>22}" for n in names) + "   al/mpi  together/al")
        for r in rows:
            u = r["us"]
            print(f"{human(r['bytes']):>8} " + " ".join(f"{u[n]:>22.0f}" for n in names)
                  + f"   {u[names[0]] / u[names[2]]:>6.2f}  {u[names[1]] / u[names[0]]:>11.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world.size, "burst": args.burst, "op": args.op,
                           "serial_bytes": serial, "rows": rows}, f, indent=1)
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
