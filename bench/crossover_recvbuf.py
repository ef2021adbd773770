"""Whether the crossover sweep's algorithms share one recvbuf or have one each, and why it
matters (issue 31; docs/tuning.md, "A recvbuf per algorithm").

    mpiexec -n 2 python bench/crossover_recvbuf.py [--pairs 10] [--sizes 1MiB,2MiB,4MiB,8MiB]
        [--algorithms rabenseifner,ring,hierarchical,shm] [--after]

Default: PAIRS x (crossover.sweep with one shared recvbuf, then with one per algorithm), each
line with the placement probe's round trip of this run (al_shm.h: above 200 ns the two ranks
share no cache), every algorithm's median (us) and the algorithm chosen, per size.

--after: shm's time (median of max over ranks, us) on a recvbuf in different states, per size:
right after another call of shm, after ring or recursive doubling into the same recvbuf (and
the second shm call after ring), after ring into another buffer, after this rank wrote or read
recvbuf itself.  Each timed shm call follows its predecessor; the predecessors take turns in a
random order.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench import crossover
from aluminum_py.bench.timing import parse_bytes


def round_trip(comm) -> float:
    info = _core.shm_info(comm._state)
    return info.get("round_trip_ns", 0) if info else 0.0


def sweeps(comm, world, sizes, algorithms, pairs):
    for k in range(pairs):
        for shared in (True, False):
            run = crossover.sweep(comm, world, sizes, algorithms, "float32", budget=1.0,
                                  shared_recv=shared)
            if world.rank == 0:
                cells = [f"{n >> 20 if n >= 1 << 20 else n} "
                         + " ".join(f"{a} {run['median'][a][i] * 1e6:.0f}" for a in algorithms)
                         + f" -> {run['fastest'][i]}" for i, n in enumerate(run["sizes"])]
                print(f"{time.strftime('%H:%M:%S')} pair {k} {'shared' if shared else 'own   '} "
                      f"rt {round_trip(comm):.0f} ns: " + " | ".join(cells), flush=True)


def after(comm, world, sizes, iters=30):
    def timed(f):
        world.Barrier()
        t0 = time.perf_counter()
        f()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    for n in sizes:
        send = np.ones(n // 4, np.float32)
        recv, other = np.empty_like(send), np.empty_like(send)

        def shm():
            comm.Allreduce(send, recv, algorithm="shm")

        def into(buf, alg):
            return lambda: comm.Allreduce(send, buf, algorithm=alg)

        before = {"shm": shm, "ring": into(recv, "ring"),
                  "ring_then_shm": lambda: (into(recv, "ring")(), shm()),
                  "recursive_doubling": into(recv, "recursive_doubling"),
                  "ring_into_other": into(other, "ring"),
                  "own_write": lambda: recv.fill(0), "own_read": lambda: recv.sum()}
        samples = {k: [] for k in before}
        for _ in range(10):
            for f in before.values():
                f()
                shm()
        for it in range(iters):
            for k in np.random.default_rng(it).permutation(list(before)):
                before[k]()
                samples[k].append(timed(shm))
        if world.rank == 0:
            print(f"{time.strftime('%H:%M:%S')} {n >> 20} MiB, rt {round_trip(comm):.0f} ns, shm "
                  "after: " + ", ".join(f"{k} {np.median(v) * 1e6:.0f}"
                                        for k, v in samples.items()), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--sizes", default="1MiB,2MiB,4MiB,8MiB")
    ap.add_argument("--algorithms", default="rabenseifner,ring,hierarchical,shm")
    ap.add_argument("--after", action="store_true")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    if args.after:
        after(comm, world, sizes)
    else:
        sweeps(comm, world, sizes, args.algorithms.split(","), args.pairs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
