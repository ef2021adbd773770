"""Transparent huge pages under the user's buffers, per algorithm: each contender is an algorithm
with its sendbuf and recvbuf (of its own) wholly on 2 MiB huge pages ("huge"), on none
("small": MADV_NOHUGEPAGE), or as a fresh numpy array at the same address would be ("fresh":
the huge pages wholly inside it, as aluminum_py.bench.timing.recvbuf_like places every
contender's recvbuf), interleaved as bench/peers.py times them; medians (us) and each mode over
"fresh".  Linux only (madvise); the machine's THP setting must allow madvise
(/sys/kernel/mm/transparent_hugepage/enabled: always or madvise).

    mpiexec -n 2 python bench/huge_pages.py [--sizes 4MiB,8MiB,16MiB]
        [--algorithms shm,ring,rabenseifner,hierarchical_p2p] [--iters 60]

Found (issue 31): MPICH's single copy (CMA, process_vm_readv) into and out of buffers on huge
pages is much faster than on small ones, shm's copies much less so; see docs/performance.md,
"Huge pages and MPICH's single copy".
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.bench.timing import HUGE_PAGE, parse_bytes, time_interleaved
from aluminum_py.testing import at_page_offset, huge_share

MODES = ("fresh", "huge", "small")


def buffer(nbytes: int, mode: str, offset: int) -> np.ndarray:
    """A float32 array of `nbytes` bytes, `offset` bytes into a 2 MiB page, in `mode`."""
    huge = {"fresh": None, "huge": True, "small": False}[mode]
    return at_page_offset(nbytes, offset, np.float32, page=HUGE_PAGE, huge=huge)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4MiB,8MiB,16MiB")
    ap.add_argument("--algorithms", default="shm,ring,rabenseifner,hierarchical_p2p")
    ap.add_argument("--iters", type=int, default=60)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        calls, shares = {}, {}
        for mode in MODES:
            send = buffer(n, mode, 16)          # numpy's large arrays start 16 bytes in
            send[:] = world.rank + 1
            shares[mode] = huge_share(send)
            for alg in args.algorithms.split(","):
                recv = buffer(n, mode, 16)
                recv[:] = 0
                calls[f"{alg}/{mode}"] = (lambda s=send, r=recv, a=alg:
                                          comm.Allreduce(s, r, algorithm=a))
        for f in calls.values():
            f()
        med = {k: float(np.median(v)) * 1e6
               for k, v in time_interleaved(world, calls, args.iters, salt=n).items()}
        if world.rank == 0:
            print(f"{n} B, {world.size} ranks; share of the sendbuf on huge pages: "
                  + ", ".join(f"{m} {s:.2f}" for m, s in shares.items()))
            for alg in args.algorithms.split(","):
                f = med[f"{alg}/fresh"]
                print(f"  {alg:>18}: fresh {f:8.1f} us  huge {med[alg + '/huge']:8.1f} "
                      f"({med[alg + '/huge'] / f:.2f}x)  small {med[alg + '/small']:8.1f} "
                      f"({med[alg + '/small'] / f:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
