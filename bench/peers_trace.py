"""bench/peers.py with every sample kept: each contender's call, in the order it ran, with the
contender that ran just before it, its time (max over ranks), the CPU each rank was on
after it and how many shm allreduces of each rank it made wrote the slots with streaming
stores (al_shm.h's per-class choice: 1 for an shm call that streamed) and each rank's
cost of each kind in the size's class after it (ticks per byte, cached then streamed), one JSON line per sample into TRACE (default peers_trace.jsonl), then a summary per
size (median / max in ms of the contenders named in --show).  It found what made one size per
4-rank run slow (docs/performance.md, "Waits that sleep"): from some sample on, every
contender of ours that waits by yielding took 3-8x longer, whatever ran before it.

    mpiexec -n 4 python bench/peers_trace.py [--trace FILE] [--show shm,ring]
        [peers.py args]
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
from aluminum_py import _core  # noqa: E402
from aluminum_py.bench import timing  # noqa: E402


def this_cpu() -> int:
    """The CPU this process last ran on (/proc/self/stat's field 39)."""
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


MADE = []     # the communicators peers.py makes (the segment's store counters are read from it)


def remembered(make):
    def making(*args, **kwargs):
        comm = make(*args, **kwargs)
        MADE.append(comm)
        return comm
    return making


def streamed_calls(nbytes: int) -> tuple[int, float, float]:
    """How many of this rank's shm allreduces so far wrote the slots with streaming stores
    (the segment's counters, al_shm.h; -1 without a segment), and what the size class of
    `nbytes` holds as the cost of each kind (cached, streamed: ticks per byte; 0: none yet)."""
    info = MADE and _core.shm_info(MADE[0]._state)
    if not info or "stores" not in info:        # (the slots' stores are chosen by size now)
        return -1, 0.0, 0.0
    classes = info["stores"].get("allreduce", {})
    mine = (timing.shm_stores_class(info, nbytes) or {"cost": (0.0, 0.0)})["cost"]
    return sum(c["streamed"] for c in classes.values()), mine[0], mine[1]


def traced(path: str):
    """A time_interleaved (aluminum_py.bench.timing's, through its after_call) that also appends
    every sample to `path`."""
    def time_interleaved(world, contenders, iters, salt=0, run=1):
        names = list(contenders)
        cpus = np.zeros((len(names), iters), dtype=int)
        streamed = np.zeros((len(names), iters), dtype=int)
        costs = np.zeros((2, len(names), iters))
        before, last = {}, {}
        count = [streamed_calls(salt)[0]]

        def after_call(i, it):
            cpus[i, it] = this_cpu()
            now, costs[0, i, it], costs[1, i, it] = streamed_calls(salt)
            streamed[i, it], count[0] = now - count[0], now
            before[i, it], last[it] = last.get(it), names[i]
        samples = timing.time_interleaved(world, contenders, iters, salt, after_call, run)
        every = world.gather((cpus, streamed, costs), root=0)
        if world.rank == 0:
            with open(path, "a") as f:
                for (i, it), prev in sorted(before.items(), key=lambda kv: kv[0][::-1]):
                    f.write(json.dumps({"bytes": salt, "iteration": it, "name": names[i],
                                        "after": prev, "us": samples[names[i]][it] * 1e6,
                                        "cpus": [int(c[0][i, it]) for c in every],
                                        "streamed": [int(c[1][i, it]) for c in every],
                                        "cost": [[round(float(c[2][k, i, it]), 4) for k in (0, 1)]
                                                 for c in every]}) + "\n")
        return samples
    return time_interleaved


def summary(path: str, show: list[str]) -> None:
    rows = [json.loads(line) for line in open(path)]
    for n in sorted({r["bytes"] for r in rows}):
        cells = []
        for name in show:
            t = [r["us"] for r in rows if r["bytes"] == n and r["name"] == name]
            if t:
                cells.append(f"{name} {np.median(t) / 1e3:.1f}/{max(t) / 1e3:.0f}")
        print(f"# {n:>10} B (median/max ms): " + "  ".join(cells))


def main(argv: list[str]) -> int:
    opts = {"--trace": "peers_trace.jsonl",
            "--show": "shm,ring,hierarchical,rabenseifner,mpi4py,deepspeed_shm"}
    for flag in opts:
        if flag in argv:
            k = argv.index(flag)
            opts[flag] = argv[k + 1]
            del argv[k:k + 2]
    path, show = opts["--trace"], opts["--show"]
    if MPI.COMM_WORLD.rank == 0 and os.path.exists(path):
        os.unlink(path)
    peers.time_interleaved = traced(path)
    peers.al.Communicator = remembered(peers.al.Communicator)
    rc = peers.main(argv)
    if MPI.COMM_WORLD.rank == 0:
        summary(path, show.split(","))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
