"""The "shm" allreduce's direct protocol (al_shm.h, "the direct protocol": the peers' buffers
read once with cross-memory attach) against its split protocol (twice through the slots) and
MPICH's point-to-point algorithms (whose large messages take MPICH's own single-copy path), in
both placements of the host, for as long as asked.

    mpiexec -n 2 python bench/shm_direct.py [--seconds 120] [--sizes 64KiB,256KiB,...]
        [--samples 5] [--log FILE]

Two communicators over the same ranks: one with AL_SHM_DIRECT_BYTES=0 (split, and the MPI
algorithms), one with AL_SHM_DIRECT_BYTES=1 (direct at every size the split protocol would
take).  Each round times every size: the contenders interleaved in random order (barrier before
each call), ``--samples`` calls each (from 8 MiB up; 4x that below), the median of the max over
ranks in microseconds; then rank 0 probes the placement (bench/cacheline_probe.c, as
bench/shm_stores.py).  At the end, per placement: the median of each contender per size, and
direct over split and over the fastest MPI algorithm.  Its figures are in
docs/performance.md ("The direct protocol").
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import parse_bytes
from shm_stores import build_probe, probe, timed

MPI_ALGORITHMS = ("rabenseifner", "recursive_doubling", "ring")
SIZES = "64KiB,256KiB,512KiB,1MiB,2MiB,4MiB,8MiB,16MiB,64MiB"


def communicator(direct: int):
    os.environ["AL_SHM_DIRECT_BYTES"] = str(direct)
    al.config.reload()
    return al.Communicator()


def one_round(world, comms, sizes, samples, rng) -> dict:
    """{size: {contender: median us}} for one round."""
    row = {}
    for nbytes in sizes:
        x, y = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
        contenders = {"direct": (comms["direct"], "shm"), "split": (comms["split"], "shm"),
                      **{a: (comms["split"], a) for a in MPI_ALGORITHMS}}
        times = {k: [] for k in contenders}
        for _ in range(samples if nbytes >= 8 << 20 else 4 * samples):
            order = list(times)
            rng.shuffle(order)
            for k in order:
                comm, alg = contenders[k]
                times[k].append(timed(world, lambda: comm.Allreduce(x, y, algorithm=alg)))
        row[nbytes] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return row


def summary(rounds, far_ns) -> str:
    lines = []
    for far in (False, True):
        sel = [row for rt, row in rounds if (rt > far_ns) == far]
        lines.append(f"# {'far' if far else 'near'} placement (round trip {'>' if far else '<='} "
                     f"{far_ns:g} ns): {len(sel)} rounds")
        for nbytes in (sel[0] if sel else ()):
            med = {k: statistics.median(r[nbytes][k] for r in sel) for k in sel[0][nbytes]}
            split = statistics.median(r[nbytes]["direct"] / r[nbytes]["split"] for r in sel)
            best = statistics.median(r[nbytes]["direct"] / min(r[nbytes][a] for a in MPI_ALGORITHMS)
                                     for r in sel)
            lines.append(f"#   {nbytes:>9} B: " + "  ".join(f"{k} {v:.0f}" for k, v in med.items())
                         + f"  direct/split {split:.2f}x  direct/fastest MPI {best:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--sizes", default=SIZES)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--far-ns", type=float, default=200.0)
    ap.add_argument("--log", help="also append every round's line to this file (rank 0)")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comms = {"split": communicator(0), "direct": communicator(1)}
    if _core.shm_info(comms["direct"]._state)["direct"] != 1:
        why = _core.shm_info(comms["direct"]._state)["direct_unavailable"]
        print(f"the direct protocol is not available here: {why}", file=sys.stderr)
        return 1
    exe = world.bcast(build_probe() if world.rank == 0 else None)
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    rng = random.Random(31)
    end = time.time() + args.seconds
    rounds = []
    while not world.bcast(time.time() > end):
        row = one_round(world, comms, sizes, args.samples, rng)
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
        text = f"# allreduce float32 SUM, {world.size} ranks\n" + summary(rounds, args.far_ns)
        print(text, flush=True)
        if args.log:
            with open(args.log, "a") as f:
                f.write(text + "\n")
    for c in comms.values():
        c.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
