"""How many bytes shm's reductions should reduce at a time (al_shm.h al_shm_tile): the same shm
allreduces with each tile size, alternated call by call in one process, with Rabenseifner and
ring over MPICH beside them.

    mpiexec -n 2 python bench/shm_tiles.py [--sizes 1MiB,4MiB,16MiB,64MiB] [--tiles 2048,8192]
        [--iters 40] [--runs 1]

Per iteration every setting (each tile size for shm, then the MPI-based algorithms) runs once
in a random order (the same on every rank), a barrier before each call, the max over ranks.
Each setting writes its own recvbuf.  Per size, the median (us) of each setting, each tile's
median over the last tile's (paired by iteration: the median of the ratios), shm over the
faster of Rabenseifner and ring, the probe's placement at setup, and how many of rank 0's shm
calls streamed the slots.  Its figures are in docs/performance.md ("Tiles that stay in L1").
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import (parse_bytes, recvbuf_like, shm_stores_class,
                                      time_interleaved)


def one_size(comm, world, n: int, tiles: list[int], others: list[str], iters: int,
             salt: int) -> dict:
    """Times (s, max over ranks) per setting at n bytes: 'tile T' for shm with tile T, and
    each of `others` by name (timing.time_interleaved: a random order per iteration, the same
    on every rank, a barrier before each call)."""
    x = np.ones(n // 4, np.float32)
    settings = [f"tile {t}" for t in tiles] + others
    outs = {s: recvbuf_like(x) for s in settings}

    def call(s):
        if s.startswith("tile "):
            _core._set_shm_tile(int(s.split()[1]))
            comm.Allreduce(x, outs[s], algorithm="shm")
        else:
            comm.Allreduce(x, outs[s], algorithm=s)

    for s in settings:                       # warm: each buffer written once, each class made
        call(s)
    times = time_interleaved(world, {s: (lambda s=s: call(s)) for s in settings}, iters, salt)
    for s in settings:
        if outs[s][0] != world.size or outs[s][-1] != world.size:
            raise SystemExit(f"wrong result from {s} at {n} B: {outs[s][0]}")
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB")
    ap.add_argument("--tiles", default="2048,8192")
    ap.add_argument("--others", default="rabenseifner,ring")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    tiles = [int(t) for t in args.tiles.split(",")]
    others = [o for o in args.others.split(",") if o]
    before = _core._set_shm_tile(tiles[-1])
    try:
        for run in range(args.runs):
            comm = al.Communicator(world)
            try:
                rt = (_core.shm_info(comm._state) or {}).get("round_trip_ns", 0.0)
                for n in sizes:
                    t = one_size(comm, world, n, tiles, others, args.iters, 1000 * run + n)
                    if world.rank:
                        continue
                    med = {s: float(np.median(v)) * 1e6 for s, v in t.items()}
                    last = f"tile {tiles[-1]}"
                    paired = {s: float(np.median(t[s] / t[last])) for s in t
                              if s.startswith("tile")}
                    best_other = min((med[o] for o in others), default=float("nan"))
                    cls = shm_stores_class(_core.shm_info(comm._state), n) or {}
                    streamed = cls.get("streamed", "-")
                    print(f"{time.strftime('%H:%M:%S')} run {run} rt {rt:.0f} ns {n >> 20} MiB: "
                          + " ".join(f"{s} {m:.0f}" for s, m in med.items())
                          + " | paired over " + last + ": "
                          + " ".join(f"{s.split()[1]} {r:.3f}" for s, r in paired.items())
                          + " | shm/best other: "
                          + " ".join(f"{s.split()[1]} {med[s] / best_other:.2f}"
                                     for s in med if s.startswith("tile"))
                          + f" | streamed {streamed}", flush=True)
            finally:
                comm.Free()
    finally:
        _core._set_shm_tile(before)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
