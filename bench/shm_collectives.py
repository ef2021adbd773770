"""Allgather, Bcast, Reduce_scatter and Barrier: ``algorithm="shm"`` against the MPI library's
own calls, through mpi4py (the peer) and through ours (``algorithm="mpi"``), one run, interleaved.

    mpiexec -n 2 python bench/shm_collectives.py [--sizes 4,64KiB,16MiB] [--dtype float32]
        [--nonblocking] [--iters N | --budget S] [--json F] [--csv F]

The bytes of a row are one rank's contribution: Allgather's sendbuf (its recvbuf is size times
larger), Bcast's buffer, Reduce_scatter's result block (its sendbuf is size times larger);
Barrier has one row.  ``--nonblocking`` times ``I<op>(...).Wait()`` on both sides.  Every
contender's first call at each size is checked against mpi4py's result.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import aluminum_py as al

import harness


def calls(comm, native, what: str, nbytes: int, dtype, nonblocking: bool) -> dict:
    """{name: call with .result()} for collective `what` at `nbytes` per rank: each contender
    has buffers of its own."""
    n, p = max(nbytes // dtype.itemsize, 1), comm.size
    out = {}
    for name in ("mpi4py", "mpi", "shm"):
        if what == "allgather":
            s, r = np.full(n, comm.rank + 1, dtype), np.empty(n * p, dtype)
            args, theirs = (s, r), ("Allgather", (s, r), {})
        elif what == "bcast":
            r = np.full(n, comm.rank + 1, dtype)
            args, theirs = (r, 0), ("Bcast", (r,), {"root": 0})
        elif what == "reduce_scatter":
            s, r = np.arange(n * p, dtype=dtype) + comm.rank, np.empty(n, dtype)
            args, theirs = (s, r, al.SUM), ("Reduce_scatter_block", (s, r), {"op": MPI.SUM})
        else:
            r = np.zeros(1, dtype)
            args, theirs = (), ("Barrier", (), {})
        if name == "mpi4py":
            f, a, kw = getattr(native, ("I" + theirs[0].lower()) if nonblocking else theirs[0]), \
                theirs[1], theirs[2]
        else:
            f = getattr(comm, ("I" + theirs[0].split("_block")[0].lower()) if nonblocking
                        else theirs[0].split("_block")[0])
            a, kw = args, {"algorithm": name}
        call = (lambda f=f, a=a, kw=kw: f(*a, **kw).Wait()) if nonblocking else \
            (lambda f=f, a=a, kw=kw: f(*a, **kw))
        call.result = (lambda r=r: r)
        out[name] = call
    return out


def main(argv=None) -> int:
    ap = harness.options(__doc__, sizes="4,64KiB,16MiB", budget=0.5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--nonblocking", action="store_true", help="time I<op> + Wait")
    args = harness.parse(ap, argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    native = world.Dup()
    dtype = np.dtype(args.dtype)
    report = harness.Report(world, args, f"{args.dtype}"
                            f"{', nonblocking (I<op> + Wait)' if args.nonblocking else ''}",
                            keys=["collective", "bytes"], ours=["mpi", "shm"], peers=["mpi4py"])
    for what in ("allgather", "bcast", "reduce_scatter", "barrier"):
        for nbytes in (harness.sizes(args.sizes, dtype.itemsize) if what != "barrier" else [0]):
            fns = calls(comm, native, what, nbytes, dtype, args.nonblocking)
            fns["mpi4py"]()
            expected = fns["mpi4py"].result().copy()
            wrong, dropped = harness.check(world, fns, dict.fromkeys(fns, expected))
            for name, why in dropped.items():
                report.skip(f"{what} {name}", why)
            samples = harness.measure(world, fns, args.iters, args.budget, salt=nbytes)
            report.row({"collective": what, "bytes": nbytes}, harness.medians_us(samples), wrong)
    rc = report.finish()
    native.Free()
    comm.Free()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
