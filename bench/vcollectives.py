"""Allgatherv and Alltoallv with uneven blocks: ``algorithm="shm"`` against the MPI library's
own calls (mpi4py's ``Allgatherv`` / ``Alltoallv``) and ours with ``algorithm="mpi"``, same
run, interleaved.

    mpiexec -n 2 python bench/vcollectives.py [--sizes 4,1KiB,64KiB,1MiB,16MiB] [--dtype float32]
        [--collectives allgatherv,alltoallv,alltoall] [--direct] [--nonblocking] [--iters N]
        [--json FILE]

The bytes of a row are what one rank sends (on average over the ranks): Allgatherv's rank j
contributes `w_j` times that, with weights 1, 2, ..., p scaled to average 1 (so recvbuf is about
p times larger); Alltoallv's rank i sends rank j `w_((i + j) % p)` times bytes / p (uneven
splits: every rank's row and column hold every weight once); Alltoall (not in the default
list) sends bytes / p to every rank.  The contenders:
  * mpi4py: the MPI library's MPI_Allgatherv / MPI_Alltoallv through mpi4py;
  * shm, mpi, auto: ``comm.Allgatherv([...], algorithm=...)`` / ``comm.Alltoallv`` (the public
    calls; a contender this build lacks is left out with its reason);
  * with ``--direct``: shm through the native entries (``_core.shm_allgatherv`` /
    ``shm_alltoallv``, what the public call runs after its checks) instead of the public calls.
Every contender's first call at each size is checked against mpi4py's result; a difference is
reported and makes the exit status 1.  Timing as bench/shm_collectives.py
(aluminum_py.bench.timing.time_interleaved): every iteration runs the contenders in a fresh
random order, each after a barrier; a sample is the max over ranks of one call; the table shows
the median in microseconds and the ratio to mpi4py's (lower is better).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import parse_bytes, time_interleaved
from aluminum_py.buffers import vlayout
from allreduce_vs_mpi import default_iters

SIZES = "4,64,1KiB,16KiB,256KiB,1MiB,4MiB,16MiB"


def weights(p: int) -> np.ndarray:
    """1, 2, ..., p scaled to average 1."""
    w = np.arange(1, p + 1, dtype=np.float64)
    return w / w.mean()


def allgatherv_layout(p: int, n: int) -> list[int]:
    """Rank j's count: n elements on average, uneven (n * w_j)."""
    return [int(round(n * w)) for w in weights(p)]


def alltoallv_counts(p: int, n: int, i: int) -> list[int]:
    """What rank i sends each rank: n elements in all on average, rank j getting n/p * w_(i+j)."""
    w = weights(p)
    return [int(round(n / p * w[(i + j) % p])) for j in range(p)]


def contenders(comm, native, what, nbytes, dtype, direct, nonblocking):
    """{name: (call, result array)} for collective `what` at `nbytes` per rank, and the reasons
    of the contenders left out."""
    p, me = comm.size, comm.rank
    n = max(nbytes // dtype.itemsize, 1)
    out, skipped = {}, {}
    if what == "allgatherv":
        counts = allgatherv_layout(p, n)
        cnt, dsp = vlayout(counts, None, p, "recvbuf", sum(counts))
        send = np.full(counts[me], me + 1, dtype)
        recvs = {k: np.zeros(sum(counts), dtype) for k in ("mpi4py", "shm", "mpi", "auto")}
        out["mpi4py"] = ((lambda: native.Iallgatherv(send, [recvs["mpi4py"], (cnt, dsp)]).Wait())
                         if nonblocking else
                         (lambda: native.Allgatherv(send, [recvs["mpi4py"], (cnt, dsp)])),
                         recvs["mpi4py"])
        entry = lambda r, b: _core.shm_allgatherv(comm._host.launcher, send, r, cnt, dsp, b,  # noqa: E731
                                                  -1.0)
        public = getattr(comm, "Iallgatherv" if nonblocking else "Allgatherv", None)
        public_call = (lambda a, r: public(send, [r, (cnt, dsp)], algorithm=a))
    elif what == "alltoall":
        m = max(n // p, 1)                        # elements per block
        send = np.repeat(np.arange(1, p + 1, dtype=dtype) * (me + 1), m)
        recvs = {k: np.zeros(p * m, dtype) for k in ("mpi4py", "shm", "mpi", "auto")}
        out["mpi4py"] = ((lambda: native.Ialltoall(send, recvs["mpi4py"]).Wait()) if nonblocking
                         else (lambda: native.Alltoall(send, recvs["mpi4py"])), recvs["mpi4py"])
        entry = lambda r, b: _core.shm_alltoall(comm._host.launcher, send, r, m, b, -1.0)  # noqa: E731
        public = getattr(comm, "Ialltoall" if nonblocking else "Alltoall", None)
        public_call = (lambda a, r: public(send, r, algorithm=a))
    else:
        scounts = alltoallv_counts(p, n, me)
        rcounts = [alltoallv_counts(p, n, j)[me] for j in range(p)]
        sc, sd = vlayout(scounts, None, p, "sendbuf", sum(scounts))
        rc, rd = vlayout(rcounts, None, p, "recvbuf", sum(rcounts))
        send = np.repeat(np.arange(1, p + 1, dtype=dtype) * (me + 1), scounts)
        recvs = {k: np.zeros(sum(rcounts), dtype) for k in ("mpi4py", "shm", "mpi", "auto")}
        out["mpi4py"] = ((lambda: native.Ialltoallv([send, (sc, sd)], [recvs["mpi4py"], (rc, rd)]).Wait())
                         if nonblocking else
                         (lambda: native.Alltoallv([send, (sc, sd)], [recvs["mpi4py"], (rc, rd)])),
                         recvs["mpi4py"])
        entry = lambda r, b: _core.shm_alltoallv(comm._host.launcher, send, sc, sd, r, rc, rd,  # noqa: E731
                                                 b, -1.0)
        public = getattr(comm, "Ialltoallv" if nonblocking else "Alltoallv", None)
        public_call = (lambda a, r: public([send, (sc, sd)], [r, (rc, rd)], algorithm=a))
    if direct:
        r = recvs["shm"]
        out["shm"] = ((lambda r=r: entry(r, False).Wait()) if nonblocking
                      else (lambda r=r: entry(r, True)), r)
    for alg in (("mpi", "auto") if direct else ("shm", "mpi", "auto")):
        if public is None:
            skipped[alg] = f"this build has no Communicator.{what.capitalize()}"
            continue
        r = recvs[alg]
        call = ((lambda a=alg, r=r: public_call(a, r).Wait()) if nonblocking
                else (lambda a=alg, r=r: public_call(a, r)))
        try:
            call()
        except Exception as e:                   # noqa: BLE001  (a name this build lacks)
            skipped[alg] = f"{type(e).__name__}: {e}"
            continue
        out[alg] = (call, r)
    return out, skipped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--collectives", default="allgatherv,alltoallv")
    ap.add_argument("--direct", action="store_true",
                    help="time shm through the native entries, not the public calls")
    ap.add_argument("--nonblocking", action="store_true", help="time I<op> + Wait")
    ap.add_argument("--iters", type=int, default=0, help="iterations per size (0: by size)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    world = MPI.COMM_WORLD
    comm = al.Communicator()
    native = world.Dup()
    dtype = np.dtype(args.dtype)
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s]
    rows, wrong, said = [], 0, set()
    if comm.rank == 0:
        print(f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {args.dtype}, {comm.size} ranks, "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, "
              f"{MPI.Get_library_version().splitlines()[0]}"
              f"{', nonblocking (I<op> + Wait)' if args.nonblocking else ''}"
              f"{', shm through the native entries' if args.direct else ''}")
        print("# bytes: sent per rank (uneven blocks); median over iterations of the max over "
              "ranks, us; ratio = time / mpi4py")
    for what in args.collectives.split(","):
        header = False
        for nbytes in sizes:
            fns, skipped = contenders(comm, native, what, nbytes, dtype, args.direct,
                                      args.nonblocking)
            for name, why in skipped.items():
                if comm.rank == 0 and (what, name) not in said:
                    print(f"# {what} {name}: left out ({why})")
                    said.add((what, name))
            for call, r in fns.values():          # warm-up, and the results checked
                call()
            ref = fns["mpi4py"][1]
            for name, (call, r) in fns.items():
                if not np.array_equal(r, ref):
                    wrong += 1
                    print(f"rank {comm.rank}: {what} {name} at {nbytes} bytes: result differs "
                          f"from mpi4py's", flush=True)
            names = list(fns)
            if comm.rank == 0 and not header:
                print(f"{'collective':>11} {'bytes':>10} {'mpi4py':>10}"
                      + "".join(f" {k:>18}" for k in names[1:]))
                header = True
            iters = args.iters or max(20, default_iters(max(nbytes, 4) * comm.size))
            samples = time_interleaved(world, {k: c for k, (c, _) in fns.items()}, iters)
            med = {k: float(np.median(v)) * 1e6 for k, v in samples.items()}
            rows.append({"collective": what, "bytes": nbytes, "iters": iters, **med})
            if comm.rank == 0:
                cells = "".join(f" {med[k]:>9.1f} ({med[k] / med['mpi4py']:4.2f}x)"
                                for k in names[1:])
                print(f"{what:>11} {nbytes:>10} {med['mpi4py']:>10.1f}{cells}", flush=True)
    wrong = world.allreduce(wrong)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": comm.size, "dtype": args.dtype, "direct": args.direct,
                       "nonblocking": args.nonblocking, "load": os.getloadavg()[0],
                       "mpi": MPI.Get_library_version().splitlines()[0], "rows": rows}, f,
                      indent=1)
    native.Free()
    comm.Free()
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
