"""Does the progress engine progress while the caller computes, and what does it cost the caller?

    mpiexec -n 2 python bench/progress_overlap.py [--mib 16] [--algorithm auto] [--iters 15]

1. t_op: median time of a blocking Allreduce of the message.
2. Iallreduce, then the caller sleeps for 3 t_op (time.sleep) or spins in pure Python for 3 t_op
   (holding the GIL), then Waits: reports the time left to wait as a fraction of t_op (0 means
   the op completed entirely in the background).
3. Polling cost to a GIL-holding caller: pure-Python work done in the 3 t_op window that starts
   with the Iallreduce, and loop throughput while the op is in flight, both relative to the
   same loop with no op in flight.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al


def spin(seconds: float) -> int:
    """Pure-Python busy loop (holds the GIL); returns iterations done."""
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=16)
    ap.add_argument("--algorithm", default="auto")
    ap.add_argument("--iters", type=int, default=15)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    x = np.ones(int(args.mib * (1 << 20)) // 4, dtype=np.float32)
    y = np.empty_like(x)

    def max_over_ranks(v: float) -> float:
        return world.allreduce(v, op=MPI.MAX)

    t = []
    for _ in range(args.iters):
        world.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(x, y, algorithm=args.algorithm)
        t.append(max_over_ranks(time.perf_counter() - t0))
    t_op = float(np.median(t))

    results = {}
    window_work, idle_work = [], []
    for mode in ("sleep", "spin"):
        left = []
        for _ in range(args.iters):
            world.Barrier()
            if mode == "spin":
                idle_work.append(spin(3 * t_op))
                world.Barrier()
            req = comm.Iallreduce(x, y, algorithm=args.algorithm)
            if mode == "sleep":
                time.sleep(3 * t_op)
            else:
                window_work.append(spin(3 * t_op))
            t1 = time.perf_counter()
            req.Wait(timeout=60)
            left.append(max_over_ranks(time.perf_counter() - t1))
        results[mode] = float(np.median(left)) / t_op

    # polling cost: Python throughput with the engine busy vs idle (same duration)
    dur = max(3 * t_op, 0.05)
    idle, busy = [], []
    for _ in range(args.iters):
        world.Barrier()
        idle.append(spin(dur))
        world.Barrier()
        req = comm.Iallreduce(x, y, algorithm=args.algorithm)
        t0 = time.perf_counter()
        n = 0
        while not req.done:
            n += spin(0.001)
        busy_time = time.perf_counter() - t0
        busy.append(n / busy_time * dur)
        req.Wait(timeout=60)
    ratio = float(np.median(busy) / np.median(idle))
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {args.mib:g} MiB float32, algorithm={args.algorithm}, "
              f"{MPI.Get_library_version().splitlines()[0]}")
        print(f"blocking Allreduce time t_op:                 {t_op * 1e3:8.2f} ms")
        print(f"left to Wait after sleeping 3 t_op:          {results['sleep'] * 100:8.1f} % of t_op")
        print(f"left to Wait after spinning in Python 3 t_op: {results['spin'] * 100:8.1f} % of t_op")
        print(f"Python work done in the 3 t_op window:        "
              f"{np.median(window_work) / np.median(idle_work) * 100:8.1f} % of idle")
        print(f"Python loop throughput while op in flight:    {ratio * 100:8.1f} % of idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
