"""Per-call overhead: a 4-byte Allreduce, aluminum_py against mpi4py, interleaved in one run.

    python bench/call_overhead.py [--calls 20000] [--batches 15] [--bytes 4] [--json FILE]
    mpiexec -n 2 python bench/call_overhead.py

At one rank every allreduce is a copy of a few bytes (or nothing, in place), so the time per call
is the library's own call path: argument checks, the algorithm choice, the op's creation and
launch.  Each batch runs every contender ``--calls`` times back to back (order rotated per
batch); the table gives the median over batches of the time per call, in microseconds, and the
ratio to mpi4py's ``comm.Allreduce(MPI.IN_PLACE, x)``.  At more ranks the figure includes the
exchange, and each batch starts after a barrier.

Contenders: ``mpi4py`` (in place), ``mpi4py_out_of_place`` (``comm.Allreduce(x, y)``), ``auto`` (in place, the default call ``comm.Allreduce(x)``),
``recursive_doubling`` (named algorithm), ``out_of_place`` (``comm.Allreduce(x, y)``),
``nonblocking`` (``comm.Iallreduce(x).Wait()``), ``shm`` and ``shm_out_of_place``
(``algorithm="shm"``, in place and not; left out where the communicator has no segment).
With a tuning table (AL_TUNING_FILE from ``bench crossover --tune``) ``auto`` runs what it
picks, e.g. ``shm``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al


def contenders(comm: "al.Communicator", native, x: np.ndarray, y: np.ndarray) -> dict:
    return {
        "mpi4py": lambda: native.Allreduce(MPI.IN_PLACE, x),
        "mpi4py_out_of_place": lambda: native.Allreduce(x, y),
        "auto": lambda: comm.Allreduce(x),
        "recursive_doubling": lambda: comm.Allreduce(x, algorithm="recursive_doubling"),
        "out_of_place": lambda: comm.Allreduce(x, y),
        "nonblocking": lambda: comm.Iallreduce(x).Wait(),
        "shm": lambda: comm.Allreduce(x, algorithm="shm"),
        "shm_out_of_place": lambda: comm.Allreduce(x, y, algorithm="shm"),
    }


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per contender per batch")
    ap.add_argument("--batches", type=int, default=15)
    ap.add_argument("--bytes", type=int, default=4, help="message size in bytes (float32)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    comm = al.Communicator()
    native = MPI.COMM_WORLD.Dup()
    count = max(args.bytes // 4, 0)
    x = np.ones(count, dtype=np.float32)
    y = np.empty_like(x)
    fns = contenders(comm, native, x, y)
    try:
        comm.Allreduce(x.copy(), algorithm="shm")
    except al.UnavailableError:                  # ranks of several nodes, or no segment
        del fns["shm"], fns["shm_out_of_place"]
    names = list(fns)
    for fn in fns.values():                      # warm-up: engine start, schedule caches
        per_call_us(fn, 200)
    samples = {n: [] for n in names}
    for b in range(args.batches):
        order = names[b % len(names):] + names[:b % len(names)]
        for n in order:
            native.Barrier()
            t = per_call_us(fns[n], args.calls)
            samples[n].append(native.allreduce(t, op=MPI.MAX))
    med = {n: statistics.median(s) for n, s in samples.items()}
    if comm.rank == 0:
        print(f"# per-call time, {args.bytes} B float32 SUM allreduce, {comm.size} rank(s), "
              f"{args.calls} calls x {args.batches} batches; median over batches, microseconds; "
              f"auto picks {comm.explain(args.bytes).algorithm}")
        print(f"{'contender':>20} {'us/call':>9} {'vs mpi4py':>10}")
        for n in names:
            print(f"{n:>20} {med[n]:9.3f} {med[n] / med['mpi4py']:9.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": comm.size, "bytes": args.bytes, "calls": args.calls,
                           "batches": args.batches, "median_us": med, "samples_us": samples}, f,
                          indent=1)
    native.Free()
    comm.Free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
