"""Allreduce: our algorithms against the calls a user would make instead, in one run, interleaved.

    mpiexec -n 2 python bench/peers.py [--sizes 4:64MiB] [--algorithms auto,shm | all]
        [--op sum|avg] [--nonblocking] [--no-torch] [--no-deepspeed] [--omp-threads 1]
        [--iters N | --budget S] [--json FILE] [--csv FILE]

The peers: mpi4py's ``comm.Allreduce`` (the MPI library's own call); with torch installed,
``torch.distributed.all_reduce`` on the gloo backend; with deepspeed installed and its CPU op
built, DeepSpeed's shared-memory ``deepspeed.comm.inference_all_reduce`` (bench/deepspeed_peer.py).
Ours: ``comm.Allreduce(send, recv, algorithm=...)`` for each name of ``--algorithms`` (``all``:
every host algorithm of ``al.algorithms()``; a name this build lacks or that raises on this
communicator, such as ``shm`` across nodes, is left out with its reason).  ``--nonblocking``
times ``Iallreduce(...).Wait()`` and mpi4py's ``Iallreduce().Wait()``.  ``--op avg`` times
``al.AVG``; mpi4py and gloo have no average, so they run SUM followed by a numpy division, as
a user would; DeepSpeed's op is timed with SUM only.

Every contender's first call at each size is checked against numpy's sum of every rank's input
(small integers in float32, so every summation order gives the same value); a wrong result is
marked and makes the exit status 1.  Each of ours and mpi4py reduces into its own recvbuf at the
sendbuf's offset into its page (a copy's speed depends on the two offsets).  The last line
compares the largest size with a memory-bandwidth bound of an allreduce on one node
(:func:`memory_bound`).
"""
from __future__ import annotations

import os
import sys

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import recvbuf_like

import harness


def result(call, array):
    """`call` with ``call.result()``: the array that holds its latest result."""
    call.result = lambda: array
    return call


def ours(comm, algorithm: str, op, nonblocking: bool):
    def factory(send):
        recv = recvbuf_like(send)
        if nonblocking:
            return result(lambda: comm.Iallreduce(send, recv, op=op, algorithm=algorithm).Wait(),
                          recv)
        return result(lambda: comm.Allreduce(send, recv, op=op, algorithm=algorithm), recv)
    return factory


def mpi4py_allreduce(native, avg: bool, nonblocking: bool):
    def factory(send):
        recv = recvbuf_like(send)

        def call():
            if nonblocking:
                native.Iallreduce(send, recv, op=MPI.SUM).Wait()
            else:
                native.Allreduce(send, recv, op=MPI.SUM)
            if avg:
                np.divide(recv, native.size, out=recv)
        return result(call, recv)
    return factory


def gloo_allreduce(world, avg: bool):
    """torch.distributed.all_reduce on gloo (in place on a copy of the input), or None without
    torch."""
    try:
        import torch  # noqa: F401
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        port = world.bcast(29500 + (os.getpid() % 1000) if world.rank == 0 else None, root=0)
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=world.rank, world_size=world.size)

    def factory(send):
        t = torch.from_numpy(send.copy())

        def call():                        # in place: only the first call's result is checked
            dist.all_reduce(t)
            if avg:
                t.div_(world.size)
        return result(call, t.numpy())
    return factory


def check_input(count: int, rank: int) -> np.ndarray:
    """Rank-dependent small integers in float32: every partial sum is exact."""
    return ((np.arange(count) % 251 + 3 * rank) % 17 - 8).astype(np.float32)


def memory_bound(nbytes: int, p: int, copy_bw: float, add_bw: float) -> float:
    """A lower bound (s) of an allreduce of `nbytes` per rank on one node, each rank on its own
    core: every rank receives at least 2(p-1)/p n bytes (the reduce-scatter and allgather
    volume), each copied once at `copy_bw`, and produces (p-1)/p n bytes of sums at `add_bw`
    (output bytes per second of out = a + b).  Both are measured on one core with the others
    idle, so the bound is optimistic."""
    return 2 * (p - 1) / p * nbytes / copy_bw + (p - 1) / p * nbytes / add_bw


def bandwidths(nbytes: int = 64 << 20, reps: int = 7) -> tuple[float, float]:
    """(copy, add) in bytes/s on this core: ``np.copyto`` and the library's float32 SUM kernel,
    medians of `reps` (buffers touched first)."""
    import time
    a, b, c = (np.ones(nbytes // 4, dtype=np.float32) for _ in range(3))
    copy_t, add_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(c, a)
        copy_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _core.reduce_into(10, 0, c, a, b)          # float32 (10), SUM (0)
        add_t.append(time.perf_counter() - t0)
    return nbytes / float(np.median(copy_t)), nbytes / float(np.median(add_t))


def main(argv=None) -> int:
    ap = harness.options(__doc__, sizes="4:64MiB")
    ap.add_argument("--algorithms", default="auto,shm",
                    help="ours, comma-separated ('all': every host algorithm; default auto,shm)")
    ap.add_argument("--op", choices=("sum", "avg"), default="sum")
    ap.add_argument("--nonblocking", action="store_true", help="time Iallreduce + Wait")
    ap.add_argument("--no-torch", action="store_true", help="no gloo and no DeepSpeed")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--omp-threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)),
                    help="OMP_NUM_THREADS for torch and DeepSpeed (default: the environment's, "
                         "else 1)")
    args = harness.parse(ap, argv)
    os.environ["OMP_NUM_THREADS"] = str(args.omp_threads)     # before torch loads
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    native = world.Dup()
    avg = args.op == "avg"
    op = al.AVG if avg else al.SUM
    known = al.algorithms(device="host")
    mine = list(known) if args.algorithms == "all" else [a for a in args.algorithms.split(",") if a]
    factories = {a: ours(comm, a, op, args.nonblocking) for a in mine if a in known}
    peers = {"mpi4py": mpi4py_allreduce(native, avg, args.nonblocking)}
    versions = {}
    gloo = None if args.no_torch else gloo_allreduce(world, avg)
    if gloo is not None:
        import torch
        versions["torch"] = torch.__version__
        peers["gloo"] = gloo
    title = (f"allreduce float32 {args.op.upper()}{', nonblocking' if args.nonblocking else ''}, "
             + ", ".join(f"{k} {v}" for k, v in versions.items()))
    report = harness.Report(world, args, title.rstrip(", "), keys=["bytes"], ours=list(factories),
                            peers=list(peers))
    for a in mine:
        if a not in known:
            report.skip(a, f"not an algorithm of this build ({', '.join(known)})")
    if not factories:
        raise SystemExit("--algorithms: none of them exists in this build")
    if gloo is None and not args.no_torch:
        report.skip("gloo", "torch is not installed")
    if avg and not (args.no_torch or args.no_deepspeed):
        report.skip("deepspeed_shm", "timed with --op sum only")
    elif gloo is None and not (args.no_torch or args.no_deepspeed):
        report.skip("deepspeed_shm", "torch is not installed")
    elif gloo is not None and not args.no_deepspeed and not avg:
        import deepspeed_peer
        ds, why = deepspeed_peer.shm_allreduce(world)
        if ds is None:
            report.skip("deepspeed_shm", why)
        else:
            peers["deepspeed_shm"] = ds
            report.peers.append("deepspeed_shm")
    factories.update(peers)
    for n in harness.sizes(args.sizes, 4):
        send = check_input(n // 4, world.rank)
        expected = sum(check_input(n // 4, r).astype(np.float64) for r in range(world.size))
        if avg:
            expected = expected / world.size
        calls = {name: f(send) for name, f in factories.items()}
        wrong, dropped = harness.check(world, calls, dict.fromkeys(calls, expected),
                                       exact=not avg)
        for name, why in dropped.items():
            report.skip(name, f"from {n} B on: {why}")
            del factories[name]
        samples = harness.measure(world, calls, args.iters, args.budget, salt=n)
        report.row({"bytes": n}, harness.medians_us(samples), wrong,
                   auto_picks=comm.explain(n).algorithm)
    copy_bw, add_bw = (world.allreduce(b, op=MPI.MIN) for b in bandwidths())
    big = report.rows[-1]
    bound = memory_bound(big["bytes"], world.size, copy_bw, add_bw) * 1e6
    if world.size > 1:
        report.say(f"memory bound at {big['bytes']} B: {bound:.0f} us (one core: copy "
                   f"{copy_bw / 1e9:.2f} GB/s, add {add_bw / 1e9:.2f} GB/s); "
                   + ", ".join(f"{k} {big[k] / bound:.2f}x" for k in report.columns if k in big))
    rc = report.finish(copy_bw=copy_bw, add_bw=add_bw, bound_us=bound, **versions)
    native.Free()
    comm.Free()
    return rc


if __name__ == "__main__":
    sys.exit(main())
