"""Allreduce: every aluminum_py algorithm against mpi4py's own Allreduce, same run, interleaved.

    mpiexec -n 2 python bench/allreduce_vs_mpi.py [--min-bytes 4] [--max-bytes 64MiB]
        [--algorithms shm,recursive_doubling,rabenseifner,ring,auto] [--dtype float32]
        [--nonblocking] [--op sum|avg] [--iters N] [--json FILE]

For each size and each iteration, every contender runs once (order rotated per iteration),
each preceded by a barrier.  A sample is the max over ranks of one call's time; the table shows
the median sample in microseconds and the ratio to mpi4py's ``comm.Allreduce`` (lower is better).
``--op avg`` times ``al.AVG``; MPI has no average, so mpi4py runs SUM and then divides with
numpy (``recv /= size``), as a user would.

With ``shm`` among the algorithms (and more than one rank), the last line compares its time at
the largest size with the memory-traffic bound of a shared-memory allreduce (:func:`shm_bound`),
whose bandwidth comes from ``copy``: an ``np.copyto`` of the same bytes on every rank at once,
timed at the largest size among the contenders (same iterations, same load; not in the table).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.bench.timing import parse_bytes, size_sweep, time_interleaved


def shm_bound(nbytes: int, bandwidth: float) -> float:
    """Lower bound (s) of an allreduce of `nbytes` per rank, for buffers larger than the caches:
    every rank must at least read its sendbuf from memory and write its recvbuf to it, 2n bytes,
    at `bandwidth` (what one rank gets while every rank copies: bytes read + written per second
    by ``np.copyto`` of n bytes, whose glibc memcpy streams its stores, so it pays no read of
    the destination either).  The rest of the shm algorithm's traffic ((5 - 2/p) n bytes per
    rank in all, al_shm.h) goes to and from its slots, 2 p MiB that stay in the caches."""
    return 2 * nbytes / bandwidth


def default_iters(nbytes: int) -> int:
    return int(min(300, max(5, (256 << 20) // max(nbytes, 1) // 8)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", default="4")
    ap.add_argument("--max-bytes", default="64MiB")
    ap.add_argument("--algorithms", default="shm,recursive_doubling,rabenseifner,ring,auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--nonblocking", action="store_true", help="time Iallreduce + Wait")
    ap.add_argument("--op", choices=("sum", "avg"), default="sum")
    ap.add_argument("--iters", type=int, default=0, help="iterations per size (0: by size)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    world = MPI.COMM_WORLD
    comm = al.Communicator()
    native = world.Dup()
    dtype = np.dtype(args.dtype)
    algs = [a for a in args.algorithms.split(",") if a]
    lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    sizes = size_sweep(lo, hi, dtype.itemsize)
    contenders = ["mpi4py"] + algs
    rows = []
    if comm.rank == 0:
        print(f"# allreduce {args.dtype} {args.op.upper()}, {comm.size} ranks, {MPI.Get_library_version().splitlines()[0]}"
              f"{', nonblocking (Iallreduce+Wait)' if args.nonblocking else ''}")
        print(f"# median over iterations of the max over ranks, microseconds; ratio = time / mpi4py")
        head = f"{'bytes':>10} {'mpi4py':>10}" + "".join(f" {a:>20}" for a in algs)
        print(head)
    for nbytes in sizes:
        count = nbytes // dtype.itemsize
        send = np.ones(count, dtype=dtype)
        recv = np.empty_like(send)
        iters = args.iters or default_iters(nbytes)

        op = al.AVG if args.op == "avg" else al.SUM

        def mpi4py_avg():
            native.Allreduce(send, recv, op=MPI.SUM)
            np.divide(recv, comm.size, out=recv, casting="unsafe")

        def run(name):
            if name == "mpi4py":
                return mpi4py_avg if args.op == "avg" else (
                    lambda: native.Allreduce(send, recv, op=MPI.SUM))
            if args.nonblocking:
                return lambda: comm.Iallreduce(send, recv, op=op, algorithm=name).Wait()
            return lambda: comm.Allreduce(send, recv, op=op, algorithm=name)

        fns = {name: run(name) for name in contenders}
        bound_here = "shm" in algs and comm.size > 1 and nbytes == sizes[-1]
        if bound_here:
            fns["copy"] = lambda: np.copyto(recv, send)
        for f in fns.values():          # warm-up
            f()
        samples = time_interleaved(world, fns, iters)
        times = np.stack([samples[name] for name in contenders])
        med = np.median(times, axis=1) * 1e6
        row = {"bytes": nbytes, "iters": iters,
               **{name: float(med[i]) for i, name in enumerate(contenders)},
               **{f"{name}_min": float(times[i].min() * 1e6) for i, name in enumerate(contenders)}}
        if bound_here:
            # every rank copies at once: 2n bytes read + written per rank in the median time
            row["copy"] = float(np.median(samples["copy"]) * 1e6)
            row["copy_bandwidth"] = 2 * nbytes / (row["copy"] * 1e-6)
        rows.append(row)
        if comm.rank == 0:
            cells = "".join(f" {med[i + 1]:>11.1f} ({med[i + 1] / med[0]:4.2f}x)" for i in range(len(algs)))
            print(f"{nbytes:>10} {med[0]:>10.1f}{cells}", flush=True)
    bandwidth = rows[-1].get("copy_bandwidth") if rows else None
    if comm.rank == 0 and rows:
        for a in algs:
            ratios = np.array([r[a] / r["mpi4py"] for r in rows])
            print(f"# {a}: geometric-mean ratio {np.exp(np.log(ratios).mean()):.2f}, "
                  f"best {ratios.min():.2f}, worst {ratios.max():.2f}")
        if bandwidth:
            big = rows[-1]
            bound = shm_bound(big["bytes"], bandwidth) * 1e6
            print(f"# shm at {big['bytes']} B: {big['shm']:.0f} us = {big['shm'] / bound:.2f}x the "
                  f"memory-traffic bound {bound:.0f} us (read sendbuf + write recvbuf, 2n bytes "
                  f"per rank, at {bandwidth / 1e9:.2f} GB/s read + written per rank while all "
                  f"ranks copy, np.copyto of the same bytes timed among the contenders)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": comm.size, "dtype": args.dtype, "op": args.op,
                           "nonblocking": args.nonblocking, "copy_bandwidth": bandwidth,
                           "mpi": MPI.Get_library_version().splitlines()[0], "rows": rows}, f, indent=1)
    native.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
