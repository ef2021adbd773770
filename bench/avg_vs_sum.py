"""AVG against SUM: blocking ``Allreduce`` time of ``al.AVG`` over ``al.SUM`` per algorithm.

    mpiexec -n 2 python bench/avg_vs_sum.py [--sizes 1MiB,4MiB,16MiB] [--algorithms ring,rabenseifner]
        [--rounds 3] [--iters 15]

Per size, `rounds` rounds; in each, every (algorithm, op) pair runs `iters` calls (each after a
barrier); a sample is the median call time, the max over ranks.  Prints the median over rounds
in microseconds and AVG / SUM per algorithm (1.00: the average costs nothing extra).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.bench.timing import human, parse_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1MiB,4MiB,16MiB")
    ap.add_argument("--algorithms", default="ring,rabenseifner,recursive_doubling")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    algs = args.algorithms.split(",")
    if world.rank == 0:
        print(f"# {world.size} ranks, blocking Allreduce float32, median of {args.rounds} "
              f"rounds x {args.iters} calls, us")
    for nbytes in [parse_bytes(s) for s in args.sizes.split(",")]:
        x = np.ones(nbytes // 4, np.float32)
        out = {}
        for _ in range(args.rounds):
            for alg in algs:
                for op in (al.SUM, al.AVG):
                    ts = []
                    for _ in range(args.iters):
                        world.Barrier()
                        t0 = time.perf_counter()
                        comm.Allreduce(x, op=op, algorithm=alg)
                        ts.append(time.perf_counter() - t0)
                    out.setdefault((alg, op.name), []).append(
                        world.allreduce(float(np.median(ts)), op=MPI.MAX))
        if world.rank == 0:
            med = {k: float(np.median(v)) * 1e6 for k, v in out.items()}
            print(f"{human(nbytes):>8} " + "  ".join(
                f"{a}: SUM {med[(a, 'SUM')]:.0f} AVG {med[(a, 'AVG')]:.0f} "
                f"({med[(a, 'AVG')] / med[(a, 'SUM')]:.2f})" for a in algs))
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
