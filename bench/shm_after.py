"""shm's first calls after another algorithm wrote the same recvbuf: the median time (max over
ranks, us) of the 1st, 2nd, ... shm call after two calls of ring, of recursive doubling, or of
shm itself, per size, with the placement probe's round trip (al_shm.h: above 200 ns the ranks
share no cache).  Why learning in use times the third call of each run (aluminum_py/learning.py,
RUN).

    mpiexec -n 2 python bench/shm_after.py [--sizes 1MiB,2MiB,4MiB] [--calls 4] [--reps 20]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import parse_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1MiB,2MiB,4MiB")
    ap.add_argument("--calls", type=int, default=4, help="shm calls timed after each predecessor")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--before", default="ring,recursive_doubling,shm")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()

    def timed(send, recv):
        world.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(send, recv, algorithm="shm")
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        send = np.ones(n // 4, np.float32)
        recv = np.empty_like(send)
        cells = []
        for before in args.before.split(","):
            samples = []
            for _ in range(args.reps):
                for _ in range(2):
                    comm.Allreduce(send, recv, algorithm=before)
                samples.append([timed(send, recv) for _ in range(args.calls)])
            med = np.median(np.array(samples), axis=0) * 1e6
            cells.append(f"after {before}: " + " ".join(f"{x:.0f}" for x in med))
        if world.rank == 0:
            info = _core.shm_info(comm._state) or {}
            print(f"{time.strftime('%H:%M:%S')} {n} B, round trip "
                  f"{info.get('round_trip_ns', 0):.0f} ns; shm call 1..{args.calls} (us) "
                  + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
