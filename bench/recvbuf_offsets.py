"""An "shm" allreduce into recvbufs that start at different offsets into a page, interleaved
(a random order per iteration, a barrier before each call; medians of the max over ranks, us).
numpy's large arrays start 16 bytes into a page (glibc's header), so that is where most users'
buffers are (docs/performance.md, "recvbuf alignment").

    mpiexec -n 2 python bench/recvbuf_offsets.py [--bytes 2MiB] [--send-offset 16]
        [--offsets 0,16,32,48,64,2048] [--iters 400] [--algorithm shm] [--compare-memcpy]

``--compare-memcpy``: every offset also with memcpy for the copies between the slots and the
user's buffers (``_core._set_shm_line_copies(0)``, switched around each call), interleaved.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import interleaved_orders, parse_bytes
from aluminum_py.testing import at_page_offset


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", default="2MiB")
    ap.add_argument("--send-offset", type=int, default=16)
    ap.add_argument("--offsets", default="0,16,32,48,64,2048")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--algorithm", default="shm")
    ap.add_argument("--compare-memcpy", action="store_true",
                    help="each offset also with memcpy for the copies between the slots and the "
                         "buffers (al_shm.h al_shm_copy_lines off), interleaved")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    n = parse_bytes(args.bytes)
    offsets = [int(x) for x in args.offsets.split(",")]
    send = at_page_offset(n, args.send_offset)
    send[:] = world.rank + 1
    recvs = {o: at_page_offset(n, o) for o in offsets}
    kinds = [(o, 1) for o in offsets] + ([(o, 0) for o in offsets] if args.compare_memcpy else [])
    times = np.zeros((len(kinds), args.iters))
    for it, order in enumerate(interleaved_orders(len(kinds), args.iters)):
        for i in order:
            o, lines = kinds[i]
            _core._set_shm_line_copies(lines)
            world.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(send, recvs[o], algorithm=args.algorithm)
            times[i, it] = time.perf_counter() - t0
    _core._set_shm_line_copies(1)
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    expected = world.size * (world.size + 1) / 2
    wrong = [o for o in offsets if not np.all(recvs[o] == expected)]
    if world.rank == 0:
        med = np.median(times, axis=1) * 1e6
        print(f"# {args.algorithm} allreduce of {n} B, {world.size} ranks, sendbuf "
              f"{args.send_offset} B into a page; recvbuf offset: median us (over offset 0)")
        for lines in ((1, 0) if args.compare_memcpy else (1,)):
            row = [(o, med[kinds.index((o, lines))]) for o in offsets]
            print(("memcpy:  " if not lines else "lines:   " if args.compare_memcpy else "")
                  + "  ".join(f"{o}: {m:.1f} ({m / row[0][1]:.2f})" for o, m in row))
        if wrong:
            print(f"# WRONG result at offsets {wrong}")
    comm.Free()
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
