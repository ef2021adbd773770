"""``auto`` against the algorithm it runs, called by name, each twice (two contenders of each,
each into its own recvbuf), among other contenders, interleaved as bench/peers.py times them
(``aluminum_py.bench.timing.time_interleaved``): medians (us) and auto / named per size.  Run it
with ``AL_AUTO_LEARN=0`` (else auto's first calls at each size are learning's other
contenders) and a table or none that makes auto choose ``--named``.

    AL_AUTO_LEARN=0 AL_TUNING_FILE=/tmp/none.json mpiexec -n 4 python bench/auto_vs_named.py
        [--named shm] [--others mpi,recursive_doubling,rabenseifner,ring,hierarchical,mpi4py]
        [--deepspeed] [--sizes 8,64,512,4096] [--iters 500]

--deepspeed adds DeepSpeed's op (bench/deepspeed_peer.py; torch.distributed on gloo is
initialised for it, as bench/peers.py does).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.bench.timing import parse_bytes, recvbuf_like, time_interleaved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--named", default="shm")
    ap.add_argument("--others", default="mpi,recursive_doubling,rabenseifner,ring,hierarchical,"
                                        "mpi4py")
    ap.add_argument("--deepspeed", action="store_true")
    ap.add_argument("--sizes", default="8,64,512,4096")
    ap.add_argument("--iters", type=int, default=500)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    deepspeed = None
    if args.deepspeed:
        import peers                        # bench/: initialises torch.distributed (gloo)
        from deepspeed_peer import shm_allreduce
        peers.gloo_allreduce(world)
        deepspeed, why = shm_allreduce(world)
        if deepspeed is None:
            if world.rank == 0:
                print(f"# DeepSpeed's op: skipped, {why}", file=sys.stderr)
            return 1
    ratios = []
    for n in (parse_bytes(s) for s in args.sizes.split(",")):
        send = np.full(max(1, n // 4), world.rank + 1, np.float32)
        calls = {}
        for name, alg in (("auto", "auto"), (args.named, args.named), ("auto 2", "auto"),
                          (f"{args.named} 2", args.named),
                          *((o, o) for o in args.others.split(",") if o)):
            recv = recvbuf_like(send)       # at the sendbuf's page offsets, as peers.py's
            calls[name] = ((lambda recv=recv: world.Allreduce(send, recv)) if alg == "mpi4py"
                           else (lambda recv=recv, alg=alg: comm.Allreduce(send, recv,
                                                                           algorithm=alg)))
        if deepspeed is not None:
            calls["deepspeed_shm"] = deepspeed(send)
        for f in calls.values():
            f()
        med = {k: float(np.median(v)) * 1e6
               for k, v in time_interleaved(world, calls, args.iters, salt=n).items()}
        ratio = (med["auto"] + med["auto 2"]) / (med[args.named] + med[f"{args.named} 2"])
        ratios.append(ratio)
        if world.rank == 0:
            print(f"{n} B: " + "  ".join(f"{k} {v:.1f}" for k, v in med.items())
                  + f"  auto / {args.named} {ratio:.3f}", flush=True)
    first = parse_bytes(args.sizes.split(",")[0])
    if world.rank == 0:
        print(f"# {world.size} ranks, auto picks {comm.explain(first).algorithm}; "
              f"geometric mean of auto / {args.named}: {np.exp(np.mean(np.log(ratios))):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
