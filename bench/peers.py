"""Our algorithms against the peers a user would pick instead, in one run, interleaved:
mpi4py's ``comm.Allreduce`` (the MPI library's own) and, when torch is installed,
``torch.distributed.all_reduce`` on the gloo backend and, when deepspeed is installed and its
op builds, DeepSpeed's CPU shared-memory ``deepspeed.comm.inference_all_reduce``
(``bench/deepspeed_peer.py``).

    mpiexec -n 2 python bench/peers.py [--min-bytes 4] [--max-bytes 64MiB] [--algorithms auto,shm]
        [--no-torch] [--no-deepspeed] [--no-gloo] [--omp-threads 1] [--run-length 1]
        [--json FILE]

``--algorithms`` names ours (``all``: every host name of ``al.algorithms()``); a name this build
lacks, or one that raises on this communicator (``shm`` across nodes), is skipped with its
reason.  Every contender's first call at each size is checked against numpy (rank-dependent
integer inputs, so every summation order gives the same float32 result); a wrong result is
reported and makes the exit status 1.  Each sample is the max over ranks of one call (barrier
before each; with --run-length K, the last of K calls of one contender in a row); the table
shows medians in microseconds and the first algorithm's speedup over each peer (peer time /
its time; higher is better); --json also keeps each one's minimum and,
where ``auto`` runs, ``auto_paired``: per contender the median over iterations of ``auto``'s
time over that contender's in the same iteration (a paired figure: a change of the machine's
state between iterations slows both calls of a pair, where it moves two medians of independent
samples apart; ``bench/peers_summary.py`` reports it beside the ratio of medians).  With
torch, torch is imported in every rank for every contender; with --no-torch in none.  Each of
ours and mpi4py reduces into a recvbuf of its own, every one at the sendbuf's page offset
(``recvbuf_like``: allocated in turn, numpy's arrays gave the first contenders a recvbuf just
ahead of the sendbuf, where MPICH's single copy is slower, and the others not).  It also
reports the memory-bandwidth bound for large messages (see `memory_bound`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py import _core
from aluminum_py.bench.timing import (iterations, parse_bytes, recvbuf_like, size_sweep,
                                      time_interleaved)
from peers_summary import paired_worst  # noqa: E402  (bench/, the script's directory)


def contender(run, result):
    """`run` (one allreduce call) with `run.result()`: the array holding its latest result."""
    run.result = result
    return run


def ours(comm, algorithm):
    """A factory of Communicator.Allreduce(send, recv, algorithm=...) calls."""
    def factory(send: np.ndarray):
        recv = recvbuf_like(send)      # at the sendbuf's page offset, as every contender's
        return contender(lambda: comm.Allreduce(send, recv, algorithm=algorithm), lambda: recv)
    return factory


def mpi4py_allreduce(native):
    """A factory of mpi4py comm.Allreduce calls (the MPI library's own)."""
    def factory(send: np.ndarray):
        recv = recvbuf_like(send)      # at the sendbuf's page offset, as every contender's
        return contender(lambda: native.Allreduce(send, recv, op=MPI.SUM), lambda: recv)
    return factory


def gloo_allreduce(world):
    """A factory of torch.distributed gloo all_reduce calls (in place on a copy of send), or None
    without torch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        port = world.bcast(29500 + (os.getpid() % 1000) if world.rank == 0 else None, root=0)
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=world.rank, world_size=world.size)

    def factory(send: np.ndarray):
        t = torch.from_numpy(send.copy())
        return contender(lambda: dist.all_reduce(t), t.numpy)
    return factory


def memory_bound(nbytes: int, p: int, copy_bw: float, add_bw: float) -> float:
    """Lower bound (s) for an allreduce of nbytes per rank on one shared-memory node, each rank
    on its own core: every rank must receive 2(p-1)/p * n bytes (reduce-scatter + allgather
    volume), each byte copied at least once (copy_bw, bytes/s), and produce (p-1)/p * n bytes of
    reduction output (add_bw: output bytes/s of out = a + b).  Single-core bandwidths measured
    with the other cores idle, so the bound is optimistic."""
    return 2 * (p - 1) / p * nbytes / copy_bw + (p - 1) / p * nbytes / add_bw


def measure_bandwidths(nbytes: int = 64 << 20, reps: int = 7) -> tuple[float, float]:
    """(copy, add) bandwidth in bytes/s on this core: np.copyto and the library's float32 SUM
    kernel, medians over `reps` (buffers pre-faulted)."""
    import time
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    c = np.empty_like(a)
    copy_t, add_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(c, a)
        copy_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _core.reduce_into(10, 0, c, a, b)
        add_t.append(time.perf_counter() - t0)
    return nbytes / float(np.median(copy_t)), nbytes / float(np.median(add_t))


def our_algorithms(spec: str, rank: int) -> list[str]:
    """The names in `spec` ("all": every host algorithm of al.algorithms()) that this build has;
    rank 0 prints why any other is skipped."""
    known = al.algorithms(device="host")
    names = list(known) if spec == "all" else [a for a in spec.split(",") if a]
    for a in names:
        if a not in known and rank == 0:
            print(f"# {a}: skipped, not an algorithm of this build (al.algorithms(): "
                  f"{', '.join(known)})")
    return [a for a in names if a in known]


def check_input(count: int, rank: int) -> np.ndarray:
    """Rank-dependent small integers in float32: every partial sum is exact, so every summation
    order gives the same result."""
    return ((np.arange(count) % 251 + 3 * rank) % 17 - 8).astype(np.float32)


def check(world, calls: dict, count: int, skipped: dict) -> list[str]:
    """Run every call once and compare its result with numpy's sum of every rank's input (see
    :func:`checked`)."""
    expected = sum(check_input(count, r).astype(np.float64) for r in range(world.size))
    return checked(world, calls, dict.fromkeys(calls, expected), skipped,
                   note=f"from {count * 4} B on")


def checked(world, calls: dict, expected: dict, skipped: dict, what: str = "",
            note: str = "") -> list[str]:
    """Run every call once (a barrier before each) and compare its result (``call.result()``)
    with ``expected[name]`` exactly.  A call that raises on any rank is removed from `calls`
    (its reason into ``skipped["<what> <name>"]``, `note` added to the message rank 0 prints);
    returns the names whose result is wrong on some rank."""
    local = {}
    for name, call in list(calls.items()):
        world.Barrier()
        try:
            call()
            local[name] = None if np.array_equal(call.result(), expected[name]) else "wrong"
        except Exception as e:  # noqa: BLE001  (reported, the contender is dropped)
            local[name] = f"{type(e).__name__}: {str(e)[:200]}"
    wrong = []
    for r, errors in enumerate(world.allgather(local)):
        for name, err in errors.items():
            if err == "wrong":
                wrong += [name] if name not in wrong else []
            elif err and name in calls:
                del calls[name]
                key = f"{what} {name}".strip()
                skipped[key] = f"rank {r}: {err}"
                if world.rank == 0:
                    print(f"# {key}: skipped{' ' + note if note else ''}, it raised on rank "
                          f"{r}: {err}", flush=True)
    return wrong


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", default="4")
    ap.add_argument("--max-bytes", default="64MiB")
    ap.add_argument("--algorithms", default="auto,shm",
                    help="ours, comma-separated ('all': every host algorithm); default auto,shm")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per size")
    ap.add_argument("--min-iters", type=int, default=25,
                    help="iterations per size at least, whatever the budget (default 25: at "
                         "64 MiB the budget gave 10-14, and one slow call moved a median)")
    ap.add_argument("--large-min-iters", type=int, default=64,
                    help="iterations per size at least from --large-bytes (default 64: with "
                         "25-40 at 16-64 MiB one algorithm's median under two names, auto and "
                         "its own, differed by 0.82-1.16x over 90 (run, size) pairs)")
    ap.add_argument("--large-bytes", default="16MiB")
    ap.add_argument("--no-torch", action="store_true", help="no torch peers (gloo, DeepSpeed)")
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--no-gloo", action="store_true",
                    help="no gloo (DeepSpeed's op still runs): its threads stay busy for a while "
                         "after each call and slow whichever call follows on 2 cores")
    ap.add_argument("--omp-threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)),
                    help="OMP_NUM_THREADS for torch and DeepSpeed's op (default: the "
                         "environment's, else 1)")
    ap.add_argument("--run-length", type=int, default=1,
                    help="calls of a contender in a row per turn, the last one timed (1: single "
                         "calls, each after another contender's; 3: as a loop of one size runs them)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.run_length < 1:
        ap.error("--run-length must be 1 or more")
    os.environ["OMP_NUM_THREADS"] = str(args.omp_threads)   # before torch or DeepSpeed load
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    native = world.Dup()
    mine = our_algorithms(args.algorithms, world.rank)
    if not mine:
        raise SystemExit("--algorithms: none of them exists in this build")
    factories = {a: ours(comm, a) for a in mine}
    factories["mpi4py"] = mpi4py_allreduce(native)
    peers = ["mpi4py"]
    skipped = {}
    versions = {"mpi": MPI.Get_library_version().splitlines()[0]}
    gloo = None if args.no_torch else gloo_allreduce(world)
    if gloo:
        import torch
        versions["torch"] = torch.__version__
        if not args.no_gloo:
            factories["gloo"] = gloo
            peers.append("gloo")
        if not args.no_deepspeed:
            import deepspeed_peer
            ds, why = deepspeed_peer.shm_allreduce(world)
            if ds:
                import deepspeed
                versions["deepspeed"] = deepspeed.__version__
                factories["deepspeed_shm"] = ds
                peers.append("deepspeed_shm")
            else:
                skipped["deepspeed_shm"] = why
    elif not args.no_torch:
        skipped["gloo"] = skipped["deepspeed_shm"] = "torch is not installed"
    first, columns = mine[0], list(factories)
    sizes = size_sweep(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), 4)
    large = parse_bytes(args.large_bytes)
    rows, wrong_any = [], False
    if comm.rank == 0:
        for name, why in skipped.items():
            print(f"# {name}: skipped, {why}")
        print(f"# allreduce float32 SUM, {comm.size} ranks, "
              + ", ".join(f"{k} {v}" for k, v in versions.items())
              + (f", OMP_NUM_THREADS={args.omp_threads}" if gloo else ""))
        print(f"# median of max over ranks (us); speedup = peer time / {first} time")
        print(f"{'bytes':>10}" + "".join(f" {n:>13}" for n in columns)
              + "".join(f" {'vs ' + p:>10}" for p in peers) + f"  {first} picks")
    for n in sizes:
        send = check_input(n // 4, world.rank)
        calls = {name: f(send) for name, f in factories.items()}
        wrong = check(world, calls, n // 4, skipped)
        factories = {k: f for k, f in factories.items() if k in calls}
        wrong_any = wrong_any or bool(wrong)
        lo = args.large_min_iters if n >= large else args.min_iters
        iters = iterations(world, calls, args.budget / args.run_length, lo=lo)
        samples = time_interleaved(world, calls, iters, salt=n, run=args.run_length)
        med = {k: float(np.median(v)) for k, v in samples.items()}
        row = {"bytes": n, "iterations": iters,
               **{k: v * 1e6 for k, v in med.items()},
               **{f"{k}_min": float(v.min()) * 1e6 for k, v in samples.items()},
               "algorithm": comm.explain(n).algorithm, "wrong": wrong,
               # where each contender's recvbuf starts in its page, and the sendbuf's (this
               # rank's): a copy's speed depends on the two (docs/performance.md, "A recvbuf
               # just ahead of the sendbuf")
               "page_offsets": {"send": send.ctypes.data % 4096,
                                **{k: int(np.asarray(c.result()).ctypes.data % 4096)
                                   for k, c in calls.items()}}}
        if "auto" in samples:   # paired: auto over each contender, by iteration (see docstring)
            row["auto_paired"] = {k: float(np.median(samples["auto"] / v))
                                  for k, v in samples.items() if k != "auto"}
        rows.append(row)
        if comm.rank == 0:
            line = f"{n:>10}" + "".join(f" {row[k]:>12.1f}{'!' if k in wrong else ' '}"
                                        if k in row else f" {'-':>13}" for k in columns)
            line += "".join(f" {med[p] / med[first]:>9.2f}x" if p in med and first in med
                            else f" {'-':>10}" for p in peers)
            print(line + f"  {row['algorithm'] if first == 'auto' else first}", flush=True)
            if wrong:
                print(f"# {n} B: WRONG result from {', '.join(wrong)} (marked !)", flush=True)
    copy_bw, add_bw = measure_bandwidths()
    copy_bw = world.allreduce(copy_bw, op=MPI.MIN)
    add_bw = world.allreduce(add_bw, op=MPI.MIN)
    if comm.rank == 0:
        big = rows[-1]
        bound = memory_bound(big["bytes"], comm.size, copy_bw, add_bw) * 1e6
        for a in mine:
            for p in peers:
                both = [r for r in rows if a in r and p in r]
                if not both:
                    continue
                speed = np.array([r[p] / r[a] for r in both])
                print(f"# {a} vs {p}: geometric-mean speedup {np.exp(np.log(speed).mean()):.2f}x, "
                      f"worst {speed.min():.2f}x at {both[int(speed.argmin())]['bytes']} B")
        if "auto" in mine:      # issue 31's target: auto within 1.10x of the fastest contender
            over = [(r["auto"] / min(r[k] for k in columns if k in r), r["bytes"],
                     min((k for k in columns if k in r), key=r.get)) for r in rows if "auto" in r]
            worst = max(over)
            print(f"# auto over the fastest contender: worst {worst[0]:.2f}x at {worst[1]} B "
                  f"(fastest there: {worst[2]}); within 1.10x at {sum(o[0] <= 1.10 for o in over)}"
                  f" of {len(over)} sizes")
            paired = paired_worst(rows)
            if paired:
                worst = max(paired)
                print(f"# auto over each contender, paired by iteration (median of the ratios): "
                      f"worst {worst[0]:.2f}x at {worst[1]} B (against {worst[2]}); within 1.10x "
                      f"at {sum(p[0] <= 1.10 for p in paired)} of {len(paired)} sizes")
        print(f"# memory bandwidth (one core): copy {copy_bw / 1e9:.2f} GB/s, add (output) "
              f"{add_bw / 1e9:.2f} GB/s; bound at {big['bytes']} B: {bound:.0f} us; "
              + "; ".join(f"{k} {big[k]:.0f} us = {big[k] / bound:.2f}x" for k in columns
                          if k in big))
        shm = _core.shm_info(comm._state)
        round_trip = shm and shm["round_trip_ns"]
        if round_trip:
            far = shm["far_ns"]
            where = (f"above {far:.0f} ns: the far placement, new size classes start with "
                     "streamed slot stores" if round_trip > far else f"up to {far:.0f} ns: the "
                     "near placement, new size classes start with cached slot stores")
            print(f"# placement probe at setup (al_shm.h): a cache line's round trip between "
                  f"ranks 0 and 1 {round_trip:.0f} ns ({where})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": comm.size, "rows": rows, "copy_bw": copy_bw, "add_bw": add_bw,
                           "bound_us": bound, "omp_threads": args.omp_threads,
                           "run_length": args.run_length, "round_trip_ns": round_trip,
                           "skipped": skipped, **versions}, f, indent=1)
    native.Free()
    return 1 if wrong_any else 0


if __name__ == "__main__":
    sys.exit(main())
