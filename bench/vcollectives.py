"""Allgatherv and Alltoallv with uneven blocks, and Alltoall: ours (``algorithm="shm"``,
``"mpi"`` and ``"auto"``) against the MPI library's own calls through mpi4py, one run, interleaved.

    mpiexec -n 2 python bench/vcollectives.py [--sizes 4,64,1KiB,16KiB,256KiB,1MiB,4MiB,16MiB]
        [--dtype float32] [--collectives allgatherv,alltoallv,alltoall] [--nonblocking]
        [--iters N | --budget S] [--json F] [--csv F]

The bytes of a row are what one rank sends, on average over the ranks.  Allgatherv: rank j
contributes w_j times that, with weights 1, 2, ..., p scaled to average 1 (the recvbuf is about
p times larger).  Alltoallv: rank i sends rank j w_((i + j) % p) times bytes / p (every rank's
row and column of the exchange hold every weight once).  Alltoall: bytes / p to every rank.
Each contender has buffers of its own; every contender's first call at each size is checked
against mpi4py's result.  A name this build lacks for a collective is left out with its reason.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import aluminum_py as al

import harness

OURS = ("shm", "mpi", "auto")


def weights(p: int) -> np.ndarray:
    """1, 2, ..., p scaled to average 1."""
    w = np.arange(1, p + 1, dtype=np.float64)
    return w / w.mean()


def layout(counts) -> tuple[list[int], list[int]]:
    """(counts, displacements): the blocks packed in rank order."""
    counts = [int(c) for c in counts]
    return counts, [int(d) for d in np.concatenate([[0], np.cumsum(counts)[:-1]])]


def buffers(what: str, p: int, me: int, n: int, dtype):
    """(send, recv, mpi4py's (send, recv) message specs) of one contender."""
    w = weights(p)
    if what == "allgatherv":
        rc, rd = layout(int(round(n * x)) for x in w)
        send, recv = np.full(rc[me], me + 1, dtype), np.zeros(sum(rc), dtype)
        return send, recv, (send, [recv, (rc, rd)])
    if what == "alltoall":
        m = max(n // p, 1)
        send = np.repeat(np.arange(1, p + 1, dtype=dtype) * (me + 1), m)
        recv = np.zeros(p * m, dtype)
        return send, recv, (send, recv)
    count = lambda i, j: int(round(n / p * w[(i + j) % p]))   # noqa: E731  (i sends j)
    sc, sd = layout(count(me, j) for j in range(p))
    rc, rd = layout(count(j, me) for j in range(p))
    send = np.repeat(np.arange(1, p + 1, dtype=dtype) * (me + 1), sc)
    recv = np.zeros(sum(rc), dtype)
    return send, recv, ([send, (sc, sd)], [recv, (rc, rd)])


def contenders(comm, native, what: str, nbytes: int, dtype, nonblocking: bool):
    """{name: call with .result()} and {name: why} of the names left out."""
    n = max(nbytes // dtype.itemsize, 1)
    name = {"allgatherv": "Allgatherv", "alltoallv": "Alltoallv", "alltoall": "Alltoall"}[what]
    out, skipped = {}, {}
    for who in ("mpi4py", *OURS):
        send, recv, spec = buffers(what, comm.size, comm.rank, n, dtype)
        if who == "mpi4py":
            f, kw = getattr(native, ("I" + name[0].lower() + name[1:]) if nonblocking else name), {}
        else:
            f, kw = getattr(comm, ("I" + name[0].lower() + name[1:]) if nonblocking else name,
                            None), {"algorithm": who}
            if f is None:
                skipped[who] = f"this build has no Communicator.{name}"
                continue
        call = (lambda f=f, s=spec, kw=kw: f(*s, **kw).Wait()) if nonblocking else \
            (lambda f=f, s=spec, kw=kw: f(*s, **kw))
        call.result = (lambda r=recv: r)
        out[who] = call
    return out, skipped


def main(argv=None) -> int:
    ap = harness.options(__doc__, sizes="4,64,1KiB,16KiB,256KiB,1MiB,4MiB,16MiB", budget=0.5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--collectives", default="allgatherv,alltoallv,alltoall")
    ap.add_argument("--nonblocking", action="store_true", help="time I<op> + Wait")
    args = harness.parse(ap, argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    native = world.Dup()
    dtype = np.dtype(args.dtype)
    report = harness.Report(world, args, f"{args.dtype}, uneven blocks"
                            f"{', nonblocking (I<op> + Wait)' if args.nonblocking else ''}",
                            keys=["collective", "bytes"], ours=list(OURS), peers=["mpi4py"])
    for what in args.collectives.split(","):
        for nbytes in harness.sizes(args.sizes, dtype.itemsize):
            fns, skipped = contenders(comm, native, what, nbytes, dtype, args.nonblocking)
            fns["mpi4py"]()
            expected = fns["mpi4py"].result().copy()
            wrong, dropped = harness.check(world, fns, dict.fromkeys(fns, expected))
            for who, why in {**skipped, **dropped}.items():
                report.skip(f"{what} {who}", why)
            samples = harness.measure(world, fns, args.iters, args.budget, salt=nbytes)
            report.row({"collective": what, "bytes": nbytes}, harness.medians_us(samples), wrong)
    rc = report.finish()
    native.Free()
    comm.Free()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
