"""Per-call overhead: a 4-byte Allreduce, ours against mpi4py's, interleaved in one run.

    python bench/call_overhead.py [--sizes 4] [--calls 20000] [--batches 15] [--json F] [--csv F]
    mpiexec -n 2 python bench/call_overhead.py

At one rank every allreduce is a copy of a few bytes (or nothing, in place), so the time per
call is the library's own call path: the argument checks, the algorithm's choice, the op's
creation and launch.  At more ranks it includes the exchange.  Each batch runs every contender
``--calls`` times back to back (harness.measure_batches); the table gives the median over
batches of the time per call of the slowest rank, in microseconds.

Contenders: ``mpi4py`` (``comm.Allreduce(MPI.IN_PLACE, x)``, the peer) and
``mpi4py_out_of_place`` (``comm.Allreduce(x, y)``); ours: ``auto`` (``comm.Allreduce(x)``, in
place, the default call), ``out_of_place`` (``comm.Allreduce(x, y)``), ``recursive_doubling``
(a named algorithm), ``nonblocking`` (``comm.Iallreduce(x).Wait()``), ``shm`` and
``shm_out_of_place`` (``algorithm="shm"``; left out where the communicator has no segment).
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import aluminum_py as al

import harness


def contenders(comm, native, x: np.ndarray, y: np.ndarray) -> dict:
    return {
        "mpi4py": lambda: native.Allreduce(MPI.IN_PLACE, x),
        "mpi4py_out_of_place": lambda: native.Allreduce(x, y),
        "auto": lambda: comm.Allreduce(x),
        "out_of_place": lambda: comm.Allreduce(x, y),
        "recursive_doubling": lambda: comm.Allreduce(x, algorithm="recursive_doubling"),
        "nonblocking": lambda: comm.Iallreduce(x).Wait(),
        "shm": lambda: comm.Allreduce(x, algorithm="shm"),
        "shm_out_of_place": lambda: comm.Allreduce(x, y, algorithm="shm"),
    }


def main(argv=None) -> int:
    args = harness.parse(harness.options(__doc__, sizes="4", batches=(20000, 15)), argv)
    comm = al.Communicator()
    native = MPI.COMM_WORLD.Dup()
    report = None
    for n in harness.sizes(args.sizes, 4):
        x = np.ones(n // 4, dtype=np.float32)
        y = np.empty_like(x)
        fns = contenders(comm, native, x, y)
        try:
            comm.Allreduce(x.copy(), algorithm="shm")
        except al.UnavailableError as e:              # ranks of several nodes, or no segment
            del fns["shm"], fns["shm_out_of_place"]
            why = str(e)
        if report is None:
            ours = [k for k in fns if not k.startswith("mpi4py")]
            report = harness.Report(native, args, "allreduce float32 SUM, time per call, "
                                    f"{args.calls} calls x {args.batches} batches",
                                    keys=["bytes"], ours=ours, peers=["mpi4py"])
            if "shm" not in fns:
                report.skip("shm", why)
        samples = harness.measure_batches(native, fns, args.calls, args.batches)
        report.row({"bytes": n}, {k: float(np.median(v)) * 1e6 for k, v in samples.items()},
                   auto_picks=comm.explain(n).algorithm)
    rc = report.finish()
    native.Free()
    comm.Free()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
