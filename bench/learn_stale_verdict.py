"""What `auto`'s learning in use (AL_AUTO_LEARN) sees of "shm" in a size class that starts from a
stale verdict on the slots' stores (al_shm.h, "the slots' stores"): before each size the
segment's verdict is set to the kind it did not choose (``_core._set_shm_prefer``: as a verdict
made before the host moved the ranks would leave it), then `auto` runs back to back (a training
loop's calls) until the size class has committed.  Per size: learning's median for shm and
its choice, then shm's time once its class has settled (median of --calls calls of
``algorithm="shm"``, a barrier before each, the max over ranks) and the choice's.

    AL_TUNING_FILE=/tmp/none.json mpiexec -n 2 python bench/learn_stale_verdict.py \\
        [--sizes 128KiB,256KiB,512KiB,1MiB] [--calls 40] [--keep]

``--keep`` leaves the verdict alone (the control).  Learning's samples and the settled times
are both of the max over ranks; a ratio near 1 means learning saw shm as it runs."""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import parse_bytes, recvbuf_like, time_interleaved


def settled(world, comm, send, recv, algorithm, calls):
    """Median over `calls` calls (a barrier before each) of the max over ranks, in us."""
    call = lambda: comm.Allreduce(send, recv, algorithm=algorithm)      # noqa: E731
    return float(np.median(time_interleaved(world, {algorithm: call}, calls)[algorithm])) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="128KiB,256KiB,512KiB,1MiB")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--keep", action="store_true", help="leave the segment's verdict alone")
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    if comm._host.learning is None or _core.shm_info(comm._state) is None:
        if world.rank == 0:
            print("# needs AL_AUTO_LEARN on and a shared-memory segment (2+ ranks on a node)")
        return 1
    first = _core.shm_info(comm._state)["prefer"]
    if world.rank == 0:
        print(f"# {comm.size} ranks; the placement probe's verdict: {first}; "
              f"{'kept' if args.keep else 'set to the other kind before each size'}")
        print(f"{'bytes':>9} {'learned shm':>12} {'settled shm':>12} {'ratio':>6}  "
              f"{'choice':<20} {'its time':>9}  learned medians (us)")
    worst = 1.0
    for nbytes in [parse_bytes(s) for s in args.sizes.split(",")]:
        send = (np.arange(nbytes // 4) % 97 + world.rank).astype(np.float32)
        recv = recvbuf_like(send)
        if not args.keep:
            now = _core.shm_info(comm._state)["prefer"] == "streamed"
            _core._set_shm_prefer(comm._state, 0 if now else 1)
        while comm.explain(nbytes).source != "learned":
            comm.Allreduce(send, recv)
        (r,) = [r for r in comm.learned() if r["bytes"] == nbytes and r["itemsize"] == 4]
        med = {a: t * 1e6 for a, t in r["medians"].items()}
        shm = settled(world, comm, send, recv, "shm", args.calls)
        choice = r["choice"]
        mine = shm if choice == "shm" else settled(world, comm, send, recv, choice, args.calls)
        ratio = med.get("shm", float("nan")) / shm
        worst = max(worst, mine / min(mine, shm))
        if world.rank == 0:
            print(f"{nbytes:>9} {med.get('shm', float('nan')):>12.1f} {shm:>12.1f} "
                  f"{ratio:>6.2f}  {choice:<20} {mine:>9.1f}  "
                  + ", ".join(f"{a} {t:.1f}" for a, t in sorted(med.items(), key=lambda kv: kv[1])))
    if world.rank == 0:
        print(f"# the choice over settled shm: worst {worst:.2f}x")
    comm.Free()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
