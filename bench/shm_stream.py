"""Where "shm" allreduces should write recvbuf with streaming stores: each size timed with the
default threshold (AL_SHM_STREAM_BYTES unset: where 2 x ranks x bytes fill the last-level
cache) and with every size streamed, interleaved in one run (the threshold is switched around
each call with ``_core.set_shm_stream_bytes``), with and without the caller reading the result
next (``recv.sum()`` inside the timed call), beside ring for scale.

    mpiexec -n 2 python bench/shm_stream.py [--sizes 1MiB,2MiB,4MiB] [--budget 2]

Prints per size the median (us) of each contender, streamed / default, and the placement
probe's round trip (docs/performance.md, "Streaming recvbuf stores by the cache").
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import iterations, parse_bytes, time_interleaved


def shm_call(comm, send, threshold, read: bool):
    recv = np.empty_like(send)
    default = al.config.shm_stream_bytes()

    def call():
        _core.set_shm_stream_bytes(threshold)
        comm.Allreduce(send, recv, algorithm="shm")
        _core.set_shm_stream_bytes(default)
        if read:
            recv.sum()
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1MiB,2MiB,4MiB")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per size")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    info = _core.shm_info(comm._state)
    if info is None:
        raise SystemExit("no shared-memory segment here (one rank, or ranks on several nodes)")
    if world.rank == 0:
        print(f"# {world.size} ranks; default streams from {info['stream_from']} B; placement "
              f"probe {info.get('round_trip_ns', 0):.0f} ns (0: not probed); median us")
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        send = np.ones(n // 4, np.float32)
        recv = np.empty_like(send)
        calls = {"default": shm_call(comm, send, None, False),
                 "streamed": shm_call(comm, send, 0, False),
                 "default+sum": shm_call(comm, send, None, True),
                 "streamed+sum": shm_call(comm, send, 0, True),
                 "ring": lambda: comm.Allreduce(send, recv, algorithm="ring")}
        for f in calls.values():
            f()
        med = {k: float(np.median(v)) * 1e6 for k, v in
               time_interleaved(world, calls, iterations(world, calls, args.budget),
                                salt=n).items()}
        if world.rank == 0:
            print(f"{n:>10} " + "  ".join(f"{k} {v:.0f}" for k, v in med.items())
                  + f"  streamed/default {med['streamed'] / med['default']:.2f}"
                  + f" (+sum {med['streamed+sum'] / med['default+sum']:.2f})", flush=True)


if __name__ == "__main__":
    main()
