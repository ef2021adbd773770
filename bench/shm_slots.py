"""The "shm" allreduce with different slot sizes, against ring and mpi4py, interleaved in one run.

    mpiexec -n 2 python bench/shm_slots.py [BYTES] [ITERS]     (default 64 MiB, 15)

One communicator per slot size (AL_SHM_SLOT_BYTES is read when a communicator's segment is
made, by its first shm allreduce); medians of the max over ranks, in microseconds.  Each slot
size runs twice: with recvbuf written by streaming stores where the message reaches
AL_SHM_STREAM_BYTES (``shm_<slot>K``, the default) and with ordinary stores
(``shm_<slot>K_ordinary``: the threshold set out of reach for that call), so the two are compared
in one interleaved run.
"""
import os
import sys

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import time_interleaved

SLOTS = (128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20)


def main() -> None:
    world = MPI.COMM_WORLD
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 64 << 20
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    x = np.ones(nbytes // 4, np.float32)
    y = np.empty_like(x)
    fns = {}
    stream = al.config.shm_stream_bytes()

    def shm(c, threshold):
        def call():
            _core.set_shm_stream_bytes(threshold)
            c.Allreduce(x, y, algorithm="shm")
        return call
    for slot in SLOTS:
        os.environ["AL_SHM_SLOT_BYTES"] = str(slot)
        c = al.Communicator()
        fns[f"shm_{slot >> 10}K"] = shm(c, stream)
        fns[f"shm_{slot >> 10}K_ordinary"] = shm(c, 1 << 62)
    ring = al.Communicator()
    fns["ring"] = lambda: ring.Allreduce(x, y, algorithm="ring")
    fns["mpi4py"] = lambda: world.Allreduce(x, y)
    fns["copy"] = lambda: np.copyto(y, x)     # the memory-traffic bound (allreduce_vs_mpi.py)
    for f in fns.values():      # warm-up (and each segment made)
        f()
    samples = time_interleaved(world, fns, iters)
    _core.set_shm_stream_bytes(stream)
    if world.rank == 0:
        print(nbytes, "  ".join(f"{k} {np.median(v) * 1e6:.0f}" for k, v in samples.items()))


if __name__ == "__main__":
    main()
