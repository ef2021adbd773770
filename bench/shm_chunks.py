"""The "shm" allreduce with rounds of different sizes (AL_SHM_CHUNK_BYTES), against MPICH's
Rabenseifner and ring and mpi4py, interleaved in one run.

    mpiexec -n 2 python bench/shm_chunks.py [--min-bytes 512KiB] [--max-bytes 64MiB]
        [--chunks default,128KiB,256KiB,1MiB] [--budget 0.4] [--json FILE]

One communicator per round size (``default``: this machine's rule, ``aluminum_py.config.
shm_chunk_bytes``; a size: AL_SHM_CHUNK_BYTES), each with the default 1 MiB slots; each
contender has its own recvbuf at the sendbuf's page offset (``recvbuf_like``); every result is
checked.  Prints per size the median of the max over ranks (us) of each contender and each shm
contender over the faster of Rabenseifner and ring, with the placement probe's round trip
(docs/performance.md, "Rounds that stay in L2").
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import parse_bytes, recvbuf_like, size_sweep, time_interleaved


def communicators(chunks: list[str]) -> dict[str, al.Communicator]:
    """One communicator per round size, made with AL_SHM_CHUNK_BYTES set (unset: 'default')."""
    out = {}
    old = os.environ.pop("AL_SHM_CHUNK_BYTES", None)
    try:
        for c in chunks:
            if c != "default":
                os.environ["AL_SHM_CHUNK_BYTES"] = str(parse_bytes(c))
            out[c] = al.Communicator()
            os.environ.pop("AL_SHM_CHUNK_BYTES", None)
    finally:
        if old is not None:
            os.environ["AL_SHM_CHUNK_BYTES"] = old
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-bytes", default="512KiB")
    ap.add_argument("--max-bytes", default="64MiB")
    ap.add_argument("--chunks", default="default,128KiB,256KiB,1MiB")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds per size (about)")
    ap.add_argument("--json")
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    comms = communicators(args.chunks.split(","))
    first = next(iter(comms.values()))
    info = _core.shm_info(first._state)
    if info is None:
        raise SystemExit("no shared-memory segment (one rank, or AL_SHM_SLOT_BYTES=0)")
    head = {"ranks": world.size, "round_trip_ns": info.get("round_trip_ns", 0),
            "chunks": {k: _core.shm_info(c._state)["chunk"] for k, c in comms.items()},
            "chunk_upto": info["chunk_upto"], "start": time.strftime("%H:%M:%S", time.gmtime())}
    if world.rank == 0:
        print("#", json.dumps(head), flush=True)
    rows = []
    for nbytes in size_sweep(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), 4):
        send = np.full(nbytes // 4, world.rank + 1, np.float32)
        calls, recvs = {}, []

        def call(comm, algorithm, recv):
            return lambda: comm.Allreduce(send, recv, algorithm=algorithm)
        for k, c in comms.items():
            recvs.append(recvbuf_like(send))
            calls[f"shm_{k}"] = call(c, "shm", recvs[-1])
        for algorithm in ("rabenseifner", "ring"):
            recvs.append(recvbuf_like(send))
            calls[algorithm] = call(first, algorithm, recvs[-1])
        recvs.append(recvbuf_like(send))
        calls["mpi4py"] = (lambda r: lambda: world.Allreduce(send, r, op=MPI.SUM))(recvs[-1])
        for _ in range(12):             # warm-up: segments, scratch, each class's slot stores
            for f in calls.values():
                f()
        t0 = time.perf_counter()
        for f in calls.values():
            f()
        one = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        iters = max(15, min(400, int(args.budget / one)))
        samples = time_interleaved(world, calls, iters, salt=nbytes)
        want = world.size * (world.size + 1) // 2
        bad = [k for k, r in zip(calls, recvs) if not np.all(r == want)]
        if bad:
            raise SystemExit(f"rank {world.rank}: wrong results at {nbytes} B: {bad}")
        med = {k: float(np.median(v) * 1e6) for k, v in samples.items()}
        best = min(med["rabenseifner"], med["ring"])
        rows.append({"bytes": nbytes, "iters": iters, "median_us": med})
        if world.rank == 0:
            print(f"{nbytes:>9} " + " ".join(f"{k} {v:.1f}" for k, v in med.items())
                  + " | over the faster MPI algorithm: "
                  + " ".join(f"{k} {med[k] / best:.2f}" for k in med if k.startswith("shm_")),
                  flush=True)
    if args.json and world.rank == 0:
        with open(args.json, "w") as f:
            json.dump({**head, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
