"""``hierarchical`` over the nodes' segments: its two forms at every size, next to its
point-to-point form and mpi4py's Allreduce (the peer), one run, interleaved (docs/algorithms.md,
"Hierarchical").

    AL_NODE_LAYOUT=0,0,1,1 mpiexec -n 4 python bench/hierarchical_forms.py [--sizes 4:16MiB]
        [--dtype float32] [--iters N | --budget S] [--json F] [--csv F]

Needs several nodes with several ranks each, real or emulated (``bench cluster --nodes 2``, or
``AL_NODE_LAYOUT``).  Contenders: ``tree`` (shm allreduce in the node, the leaders' allreduce,
shm bcast: the first form at every size), ``split`` (shm reduce-scatter, an allreduce of each
rank's block between nodes, shm allgather: the second form at every size), ``hierarchical``
(what the library runs: the first form below ``HIER_SHM_SPLIT_FROM`` elements, the second
from there), ``hierarchical_p2p`` (point to point inside the nodes too) and ``mpi4py``.  Each
form is a Communicator whose node segments are told where the second form starts (the same on
every rank).
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

import aluminum_py as al

import harness

FORMS = {"tree": 1 << 62, "split": 0}


def main(argv=None) -> int:
    ap = harness.options(__doc__, sizes="4:16MiB", budget=0.5)
    ap.add_argument("--dtype", default="float32")
    args = harness.parse(ap, argv)
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
    report = harness.Report(world, args, f"allreduce {args.dtype} SUM, layout "
                            f"{comms['tree']._host.layout}", keys=["bytes"],
                            ours=["hierarchical", "tree", "split", "hierarchical_p2p"],
                            peers=["mpi4py"])
    for nbytes in harness.sizes(args.sizes, dtype.itemsize):
        send = (np.arange(nbytes // dtype.itemsize) % 7 + world.rank).astype(dtype)
        fns = {}
        for name in ("mpi4py", "hierarchical", "tree", "split", "hierarchical_p2p"):
            recv = np.empty_like(send)
            if name == "mpi4py":
                call = (lambda r=recv: native.Allreduce(send, r, op=MPI.SUM))
            else:
                c = comms["hierarchical" if name == "hierarchical_p2p" else name]
                alg = "hierarchical_p2p" if name == "hierarchical_p2p" else "hierarchical"
                call = (lambda c=c, a=alg, r=recv: c.Allreduce(send, r, algorithm=a))
            call.result = (lambda r=recv: r)
            fns[name] = call
        fns["mpi4py"]()
        wrong, _ = harness.check(world, fns, dict.fromkeys(fns, fns["mpi4py"].result().copy()))
        samples = harness.measure(world, fns, args.iters, args.budget, salt=nbytes)
        report.row({"bytes": nbytes}, harness.medians_us(samples), wrong)
    rc = report.finish()
    for c in comms.values():
        c.Free()
    native.Free()
    return rc


if __name__ == "__main__":
    sys.exit(main())
