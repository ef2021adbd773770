"""`hierarchical` over the nodes' segments: its two forms at every size, next to its point-to-point
form and MPICH, same run, interleaved (docs/algorithms.md, "Hierarchical").

    mpiexec -n 4 python bench/hierarchical_forms.py [--min-bytes 4] [--max-bytes 16MiB]
        [--dtype float32] [--iters N]

Needs several nodes with several ranks each, emulated (``bench cluster --nodes 2``, or
``AL_NODE_LAYOUT=0,0,1,1``).  Contenders: ``tree`` (shm allreduce in the node, leaders'
allreduce, shm bcast: the first form at every size), ``split`` (shm reduce-scatter, allreduce
of each rank's block between nodes, shm allgather: the second form at every size),
``hierarchical`` (what the library runs: the first form below ``HIER_SHM_SPLIT_FROM``
elements), ``hierarchical_p2p`` (point-to-point inside the nodes too) and mpi4py's
``Allreduce``.  Each form is a Communicator whose node segments are told where the second form
starts (``NodeSegments.split_from``, the same on every rank).  Same table as
``allreduce_vs_mpi.py``: the median of the slowest rank's times, microseconds, ratio to mpi4py.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.bench.timing import parse_bytes, size_sweep, time_interleaved

FORMS = {"tree": 1 << 62, "split": 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", default="4")
    ap.add_argument("--max-bytes", default="16MiB")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--iters", type=int, default=0, help="iterations per size (0: by size)")
    args = ap.parse_args(argv)

    world = MPI.COMM_WORLD
    native = world.Dup()
    comms = {"hierarchical": al.Communicator()}
    for form, split_from in FORMS.items():
        comms[form] = al.Communicator()
        segments = comms[form]._host._node_segments
        if segments is None:
            if world.rank == 0:
                print(f"no node segments: {comms[form]._host._no_hier_shm}", file=sys.stderr)
            return 2
        segments.split_from = split_from
    dtype = np.dtype(args.dtype)
    names = ["mpi4py", "hierarchical_p2p", "tree", "split", "hierarchical"]
    if world.rank == 0:
        print(f"# allreduce {args.dtype} SUM, {world.size} ranks, layout "
              f"{comms['tree']._host.layout}, {MPI.Get_library_version().splitlines()[0]}")
        print("# median over iterations of the max over ranks, microseconds; ratio = time / mpi4py")
        print(f"{'bytes':>10} {'mpi4py':>10}" + "".join(f" {n:>20}" for n in names[1:]))
    for nbytes in size_sweep(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes),
                             dtype.itemsize):
        send = np.ones(nbytes // dtype.itemsize, dtype=dtype)
        recv = np.empty_like(send)
        iters = args.iters or int(min(300, max(5, (256 << 20) // max(nbytes, 1) // 8)))

        def run(name):
            if name == "mpi4py":
                return lambda: native.Allreduce(send, recv, op=MPI.SUM)
            c = comms["hierarchical" if name == "hierarchical_p2p" else name]
            alg = "hierarchical_p2p" if name == "hierarchical_p2p" else "hierarchical"
            return lambda: c.Allreduce(send, recv, algorithm=alg)

        fns = {name: run(name) for name in names}
        for f in fns.values():          # warm-up
            f()
        samples = time_interleaved(world, fns, iters)
        med = [float(np.median(samples[n])) * 1e6 for n in names]
        if world.rank == 0:
            print(f"{nbytes:>10} {med[0]:>10.1f}"
                  + "".join(f" {m:>11.1f} ({m / med[0]:4.2f}x)" for m in med[1:]), flush=True)
    for c in comms.values():
        c.Free()
    native.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
