"""allgather, bcast, reduce_scatter and barrier: ``algorithm="shm"`` against the MPI library's
own calls, through mpi4py and through aluminum_py (``algorithm="mpi"``), same run, interleaved.

    mpiexec -n 2 python bench/shm_collectives.py [--sizes 4,64KiB,16MiB] [--dtype float32]
        [--nonblocking] [--iters N] [--json FILE]

The bytes of a row are one rank's contribution: allgather's sendbuf (recvbuf is size times
larger), bcast's buffer, reduce_scatter's result block (sendbuf is size times larger); barrier
has one row.  Timing as bench/allreduce_vs_mpi.py: every iteration runs the contenders in a
fresh random order, each after a barrier; a sample is the max over ranks of one call; the table
shows the median in microseconds and the ratio to mpi4py's call (lower is better).
"""
from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.bench.timing import parse_bytes, time_interleaved
from allreduce_vs_mpi import default_iters

CONTENDERS = ("mpi4py", "mpi", "shm")


def calls(comm, native, what: str, nbytes: int, dtype, nonblocking: bool) -> dict:
    """The three contenders' calls of collective `what` on `nbytes` per rank."""
    n = max(nbytes // dtype.itemsize, 1)
    p = comm.size

    def ours(f, *args):
        if nonblocking:
            g = getattr(comm, "I" + f.__name__.lower())
            return lambda a: g(*args, algorithm=a).Wait()
        return lambda a: f(*args, algorithm=a)

    if what == "allgather":
        s, r = np.ones(n, dtype), np.empty(n * p, dtype)
        mine, theirs = ours(comm.Allgather, s, r), lambda: native.Allgather(s, r)
    elif what == "bcast":
        b = np.ones(n, dtype)
        mine, theirs = ours(comm.Bcast, b, 0), lambda: native.Bcast(b, root=0)
    elif what == "reduce_scatter":
        s, r = np.ones(n * p, dtype), np.empty(n, dtype)
        mine = ours(comm.Reduce_scatter, s, r, al.SUM)
        theirs = lambda: native.Reduce_scatter_block(s, r, op=MPI.SUM)   # noqa: E731
    else:
        mine, theirs = ours(comm.Barrier), native.Barrier
    if nonblocking:
        theirs = {"allgather": lambda: native.Iallgather(s, r).Wait(),
                  "bcast": lambda: native.Ibcast(b, root=0).Wait(),
                  "reduce_scatter": lambda: native.Ireduce_scatter_block(s, r, op=MPI.SUM).Wait(),
                  "barrier": lambda: native.Ibarrier().Wait()}[what]
    return {"mpi4py": theirs, "mpi": lambda: mine("mpi"), "shm": lambda: mine("shm")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,64KiB,16MiB")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--nonblocking", action="store_true", help="time I<op> + Wait")
    ap.add_argument("--iters", type=int, default=0, help="iterations per size (0: by size)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    world = MPI.COMM_WORLD
    comm = al.Communicator()
    native = world.Dup()
    dtype = np.dtype(args.dtype)
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s]
    rows = []
    if comm.rank == 0:
        print(f"# {args.dtype}, {comm.size} ranks, {MPI.Get_library_version().splitlines()[0]}"
              f"{', nonblocking (I<op> + Wait)' if args.nonblocking else ''}")
        print("# median over iterations of the max over ranks, us; ratio = time / mpi4py")
        print(f"{'collective':>15} {'bytes':>10} {'mpi4py':>10} {'mpi':>18} {'shm':>18}")
    for what in ("allgather", "bcast", "reduce_scatter", "barrier"):
        for nbytes in (sizes if what != "barrier" else [0]):
            fns = calls(comm, native, what, nbytes, dtype, args.nonblocking)
            for f in fns.values():          # warm-up
                f()
            iters = args.iters or max(20, default_iters(max(nbytes, 4) * comm.size))
            samples = time_interleaved(world, fns, iters)
            med = {k: float(np.median(v)) * 1e6 for k, v in samples.items()}
            rows.append({"collective": what, "bytes": nbytes, "iters": iters, **med})
            if comm.rank == 0:
                cells = "".join(f" {med[k]:>9.1f} ({med[k] / med['mpi4py']:4.2f}x)"
                                for k in CONTENDERS[1:])
                print(f"{what:>15} {nbytes:>10} {med['mpi4py']:>10.1f}{cells}", flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": comm.size, "dtype": args.dtype, "nonblocking": args.nonblocking,
                       "mpi": MPI.Get_library_version().splitlines()[0], "rows": rows}, f,
                      indent=1)
    native.Free()
    comm.Free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
