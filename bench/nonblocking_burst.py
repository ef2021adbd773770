"""Back-to-back nonblocking allreduces (a framework's gradient buckets): the time per op of a
burst of K ``Iallreduce`` calls on distinct buffers, then one ``Waitall``, against mpi4py's.

    mpiexec -n 2 python bench/nonblocking_burst.py [--burst 8] [--sizes 64KiB,256KiB,1MiB,4MiB,16MiB]
        [--op avg|sum] [--iters N | --budget S] [--json F] [--csv F]

Contenders, interleaved in one run:

* ``aluminum_py``: the progress engine as configured (large allreduces on one communicator run
  one at a time from ``AL_ENGINE_SERIAL_BYTES``, default 1 MiB);
* ``together``: the same with every op progressed together (``AL_ENGINE_SERIAL_BYTES=0``);
* ``mpi4py``: MPI's own ``Iallreduce`` and ``MPI.Request.Waitall`` (the peer).  MPI has no
  average: for ``--op avg`` it runs SUM followed by a numpy division, as a user would.

A sample is the slowest rank's time of one burst divided by K.
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core, config

import harness


def main(argv=None) -> int:
    ap = harness.options(__doc__, sizes="64KiB,256KiB,1MiB,4MiB,16MiB", budget=1.0)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--op", choices=("avg", "sum"), default="avg")
    args = harness.parse(ap, argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    op = al.AVG if args.op == "avg" else al.SUM
    serial = config.engine_serial_bytes()
    report = harness.Report(world, args, f"burst of {args.burst} Iallreduce ({args.op.upper()}, "
                            f"float32) then Waitall, time per op; AL_ENGINE_SERIAL_BYTES={serial}",
                            keys=["bytes"], ours=["aluminum_py", "together"], peers=["mpi4py"])
    for nbytes in harness.sizes(args.sizes, 4):
        xs = {k: [np.ones(max(1, nbytes // 4), dtype=np.float32) for _ in range(args.burst)]
              for k in ("aluminum_py", "together", "mpi4py")}

        def ours(mode, xs):
            _core.set_serial_bytes(mode)
            al.Waitall([comm.Iallreduce(x, op=op) for x in xs], timeout=300)

        def theirs(xs=xs["mpi4py"]):
            MPI.Request.Waitall([world.Iallreduce(MPI.IN_PLACE, x, op=MPI.SUM) for x in xs])
            if args.op == "avg":
                for x in xs:
                    x /= world.size
        fns = {"aluminum_py": lambda: ours(serial, xs["aluminum_py"]),
               "together": lambda: ours(0, xs["together"]), "mpi4py": theirs}
        samples = harness.measure(world, fns, args.iters, args.budget, salt=nbytes)
        _core.set_serial_bytes(serial)
        report.row({"bytes": nbytes}, {k: float(np.median(v)) * 1e6 / args.burst
                                       for k, v in samples.items()})
    rc = report.finish()
    comm.Free()
    return rc


if __name__ == "__main__":
    sys.exit(main())
