"""auto's re-check (AL_AUTO_RECHECK) after the machine changes state: a loop of ``"auto"``
allreduces of one size; after ``--before`` calls a busy process (a neighbour's job) starts on
the node, and ``--after`` calls follow.  Per phase: the median time per call, and auto's
standing choice at the calls (``explain``: while a class learns, its calls rotate among the
contenders).  Then, still busy, every algorithm named, interleaved (the third of three calls
in a row timed, as learning times them): the fastest in that state, which auto's second busy
half, and the named time of its choice at the end, are compared with.  Run it with re-checks on and off, in one run of this script each:

    AL_AUTO_RECHECK=200 mpiexec -n 2 python bench/recheck_state_change.py --bytes 8388608
    AL_AUTO_RECHECK=0   mpiexec -n 2 python bench/recheck_state_change.py --bytes 8388608

Each call is timed on every rank from a barrier to its return, the max over ranks (one small
allreduce per call, outside the timing).  ``--json FILE`` keeps every call's time and auto's
choice, the named algorithms' times, and learned() at the end.  Needs no tuning table (set
AL_TUNING_FILE to a missing file for the formula's choice; with a table, its choice is the
prior).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.learning import NEVER


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=8 << 20, help="message size (float32)")
    ap.add_argument("--before", type=int, default=400, help="calls before the busy process")
    ap.add_argument("--after", type=int, default=1600, help="calls while it runs")
    ap.add_argument("--rounds", type=int, default=60,
                    help="then, still busy: rounds of every contender (3 calls, the last timed)")
    ap.add_argument("--json")
    args = ap.parse_args()
    comm = al.Communicator()
    world = MPI.COMM_WORLD
    x = np.ones(args.bytes // 4, np.float32)
    y = np.empty_like(x)
    times, algs = [], []
    hog = None
    try:
        for i in range(args.before + args.after):
            if i == args.before:
                if world.rank == 0:
                    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
                world.Barrier()
                time.sleep(0.5)
            algs.append(comm.explain(args.bytes).algorithm)     # what this call will run
            world.Barrier()
            t = time.perf_counter()
            comm.Allreduce(x, y)
            times.append(world.allreduce(time.perf_counter() - t, op=MPI.MAX))
        # the same state, every contender named: what auto's last phase compares with
        names = ("shm", "ring", "rabenseifner", "recursive_doubling", "hierarchical")
        named = {a: [] for a in names}
        for _ in range(args.rounds):
            for a in names:
                for _ in range(3):
                    world.Barrier()
                    t = time.perf_counter()
                    comm.Allreduce(x, y, algorithm=a)
                    dt = world.allreduce(time.perf_counter() - t, op=MPI.MAX)
                named[a].append(dt)
    finally:
        if hog is not None:
            hog.kill()
    if world.rank != 0:
        comm.Free()
        return
    t = np.array(times)
    recheck = os.environ.get("AL_AUTO_RECHECK", "default")
    print(f"# {comm.size} ranks, {args.bytes} B, AL_AUTO_RECHECK={recheck}: median us per call "
          f"and auto's standing choice at the calls, per phase")
    spans = [("quiet", 0, args.before), ("busy, first half", args.before,
                                         args.before + args.after // 2),
             ("busy, second half", args.before + args.after // 2, args.before + args.after)]
    for name, a, b in spans:
        ran = Counter(algs[a:b]).most_common()
        print(f"{name:>18}: {np.median(t[a:b]) * 1e6:9.1f} us  "
              + ", ".join(f"{k} x{v}" for k, v in ran))
    last = np.median(t[args.before + args.after // 2:])
    medians = {a: float(np.median(v)) for a, v in named.items()}
    best = min(medians, key=medians.get)
    print("   then, named (median us, 3rd of 3 calls): "
          + ", ".join(f"{a} {m * 1e6:.1f}" for a, m in sorted(medians.items(),
                                                             key=lambda kv: kv[1])))
    final = comm.explain(args.bytes).algorithm
    print(f"   auto's second busy half over the fastest named ({best}): "
          f"{last / medians[best]:.2f}x; its choice at the end, {final}, named: "
          f"{medians[final] / medians[best]:.2f}x the fastest")
    learned = comm.learned()
    for r in learned:
        print(f"learned: {r['bytes']} B -> {r['choice']} (prior {r['prior']}, "
              f"re-check {r['rechecks']}, next after "
              f"{r['recheck_after'] if r['recheck_after'] < NEVER else 'no'} calls)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": args.bytes, "ranks": comm.size, "recheck": recheck,
                       "before": args.before, "times": times, "algorithms": algs, "named": named,
                       "learned": learned}, f, default=str)
    comm.Free()


if __name__ == "__main__":
    main()
