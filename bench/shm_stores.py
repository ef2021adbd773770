"""The "shm" collectives' slot stores (al_shm.h, "the slots' stores") in the two placements of
the host: cached, streamed and chosen by measurement (``auto``, the default), against the
MPI library's point to point (the allreduce: Rabenseifner; the other collectives: "mpi", the
MPI library's own), for as long as asked, with the placement probed between rounds.

    mpiexec -n 2 python bench/shm_stores.py [--seconds 300] [--sizes 256KiB,2MiB,64MiB]
        [--samples 5] [--collective allreduce] [--log FILE]

``--collective``: allreduce, allgather, reduce_scatter, alltoall or allgatherv; a size is the
bytes of one rank's block (the allreduce: of the message; allgatherv: rank j's block is
size * (j + 1) / p).

Each round times every size: the four contenders interleaved in random order (barrier before
each call), ``--samples`` calls each (5 from 8 MiB up, 4x that below), the median of the max
over ranks in microseconds.  The stores are switched for a contender's call on every rank at
once (``_core.set_shm_slot_stores``): ``auto`` keeps measuring across the round, as it would
in a program, but a cached or streamed contender's calls in between change what the caches
hold, so ``auto`` is compared with the better of the two fixed kinds in the same round.  Then
rank 0 runs bench/cacheline_probe.c (compiled once with cc; the other ranks sleep meanwhile):
a cache line's round trip between CPUs 0 and 1, which tells the placement (on the reference
VM: 50-65 ns near, 330-590 ns far).  At the end: per placement (a round trip of more than
``--far-ns``, default 200, is far), the median of each contender per size and of ``auto`` over
the better fixed kind.  Its figures are in docs/performance.md ("Why large messages were
bimodal").
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import parse_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = {"auto": 0, "cached": 1, "streamed": 2}


def build_probe() -> str:
    """Compile bench/cacheline_probe.c into a temporary directory: the program's path."""
    out = os.path.join(tempfile.mkdtemp(prefix="al-probe-"), "probe")
    subprocess.run(["cc", "-O2", "-pthread", "-o", out, os.path.join(HERE, "cacheline_probe.c")],
                   check=True)
    return out


def probe(world, exe) -> float:
    """Rank 0 runs the probe while the others sleep (a spinning rank would take a CPU the probe
    pins): the round trip in ns, on every rank."""
    rt = None
    if world.rank == 0:
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout.split()
        rt = float(out[1])
        for r in range(1, world.size):
            world.send(rt, dest=r)
    else:
        req = world.irecv(source=0)
        while True:
            done, rt = req.test()
            if done:
                break
            time.sleep(0.002)
    return rt


def timed(world, call) -> float:
    world.Barrier()
    t0 = time.perf_counter()
    call()
    return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)


PEER = {"allreduce": "rabenseifner"}          # the MPI-based contender (else "mpi")


def calls(comm, collective: str, nbytes: int):
    """(call(algorithm), peer name) of `collective` with blocks of `nbytes` bytes."""
    p, me = comm.size, comm.rank
    n = nbytes // 4
    x, y = np.ones(n, np.float32), np.empty(n, np.float32)
    big_x, big_y = np.ones(n * p, np.float32), np.empty(n * p, np.float32)
    counts = [max(n * (j + 1) // p, 1) for j in range(p)]
    mine, whole = np.ones(counts[me], np.float32), np.empty(sum(counts), np.float32)
    call = {
        "allreduce": lambda alg: comm.Allreduce(x, y, algorithm=alg),
        "allgather": lambda alg: comm.Allgather(x, big_y, algorithm=alg),
        "reduce_scatter": lambda alg: comm.Reduce_scatter(big_x, y, algorithm=alg),
        "alltoall": lambda alg: comm.Alltoall(big_x, big_y, algorithm=alg),
        "allgatherv": lambda alg: comm.Allgatherv(mine, [whole, counts], algorithm=alg),
    }[collective]
    return call, PEER.get(collective, "mpi")


def one_round(world, comm, sized_calls, samples, rng) -> dict:
    """{size: {contender: median us}} for one round."""
    row = {}
    for nbytes, (call, peer) in sized_calls.items():
        n = samples if nbytes >= 8 << 20 else 4 * samples
        times = {k: [] for k in (*KINDS, peer)}
        for _ in range(n):
            order = list(times)
            rng.shuffle(order)
            for k in order:
                if k == peer:
                    times[k].append(timed(world, lambda: call(peer)))
                else:
                    _core.set_shm_slot_stores(KINDS[k])
                    times[k].append(timed(world, lambda: call("shm")))
                    _core.set_shm_slot_stores(0)
        row[nbytes] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return row


def summary(rounds, far_ns) -> str:
    lines = []
    for far in (False, True):
        sel = [row for rt, row in rounds if (rt > far_ns) == far]
        lines.append(f"# {'far' if far else 'near'} placement (round trip {'>' if far else '<='} "
                     f"{far_ns:g} ns): {len(sel)} rounds")
        if not sel:
            continue
        for nbytes in sel[0]:
            med = {k: statistics.median(r[nbytes][k] for r in sel) for k in sel[0][nbytes]}
            ratio = statistics.median(r[nbytes]["auto"] / min(r[nbytes]["cached"],
                                                              r[nbytes]["streamed"]) for r in sel)
            lines.append(f"#   {nbytes:>9} B: " + "  ".join(f"{k} {v:.0f}" for k, v in med.items())
                         + f"  auto/better fixed {ratio:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--sizes", default="256KiB,2MiB,64MiB")
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--far-ns", type=float, default=200.0)
    ap.add_argument("--collective", default="allreduce",
                    choices=("allreduce", "allgather", "reduce_scatter", "alltoall",
                             "allgatherv"))
    ap.add_argument("--log", help="also append every round's line to this file (rank 0)")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    exe = world.bcast(build_probe() if world.rank == 0 else None)
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    sized_calls = {n: calls(comm, args.collective, n) for n in sizes}
    rng = random.Random(31)
    end = time.time() + args.seconds
    rounds = []
    while not world.bcast(time.time() > end):
        row = one_round(world, comm, sized_calls, args.samples, rng)
        rt = probe(world, exe)
        rounds.append((rt, row))
        if world.rank == 0:
            line = (time.strftime("%H:%M:%S") + f" round trip {rt:.0f} ns | " + " | ".join(
                f"{n >> 10}K " + " ".join(f"{k} {v:.0f}" for k, v in r.items())
                for n, r in row.items()))
            print(line, flush=True)
            if args.log:
                with open(args.log, "a") as f:
                    f.write(line + "\n")
    if world.rank == 0:
        text = f"# {args.collective}, {world.size} ranks\n" + summary(rounds, args.far_ns)
        print(text, flush=True)
        if args.log:
            with open(args.log, "a") as f:
                f.write(text + "\n")
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
