"""Is a contender's time biased by its place in the iteration?  K identical contenders (the same
algorithm, each into its own recvbuf) timed as ``aluminum_py.bench.timing.time_interleaved``
times them (a random order per iteration, a barrier before each call, the max over ranks); the
medians by contender and by place.  With ``--draw-between`` each iteration's order is drawn
between iterations, as the timing did before issue 31's fix: at 4 ranks on 2 cores the last
call of every iteration took 2-3x the others' time.

    mpiexec -n 4 python bench/timing_positions.py [--bytes 64] [--iters 2000] [--k 6]
        [--algorithm shm] [--draw-between] [--seed 1]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.bench.timing import interleaved_orders, parse_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="64")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--k", type=int, default=6, help="identical contenders")
    ap.add_argument("--algorithm", default="shm")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--draw-between", action="store_true",
                    help="draw each iteration's order between iterations (the old timing)")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    n = parse_bytes(args.bytes)
    send = np.full(max(1, n // 4), world.rank + 1, np.float32)
    recvs = [np.empty_like(send) for _ in range(args.k)]
    for r in recvs:
        comm.Allreduce(send, r, algorithm=args.algorithm)
    times = np.zeros((args.k, args.iters))
    place = np.zeros((args.k, args.iters), dtype=int)
    orders = None if args.draw_between else interleaved_orders(args.k, args.iters, args.seed)
    for it in range(args.iters):
        order = (np.random.default_rng([args.seed, it]).permutation(args.k)
                 if args.draw_between else orders[it])
        for j, i in enumerate(order):
            world.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(send, recvs[i], algorithm=args.algorithm)
            times[i, it] = time.perf_counter() - t0
            place[i, it] = j
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    if world.rank == 0:
        us = times * 1e6
        print(f"# {args.algorithm} allreduce of {n} B, {world.size} ranks, {args.k} identical "
              f"contenders, {args.iters} iterations, orders drawn "
              f"{'between iterations' if args.draw_between else 'before the first call'}; "
              f"median us")
        print("by contender: " + "  ".join(f"{np.median(us[i]):.2f}" for i in range(args.k)))
        print("by place:     " + "  ".join(f"{np.median(us[place == j]):.2f}"
                                           for j in range(args.k)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
