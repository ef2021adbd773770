"""auto against the peers a user would pick instead, in one run, interleaved:
mpi4py's ``comm.Allreduce`` (the MPI library's own) and, when torch is installed,
``torch.distributed.all_reduce`` with the gloo backend.

    mpiexec -n 2 python bench/peers.py [--min-bytes 4] [--max-bytes 64MiB] [--json FILE]

Each sample is the max over ranks of one call (barrier before each); the table shows medians in
microseconds and auto's speedup over each peer (peer time / auto time; higher is better).  It
also reports the memory-bandwidth bound for large messages (see --help of `bound`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from mpi4py import MPI

import aluminum_py as al
from aluminum_py.bench.timing import iterations, parse_bytes, size_sweep, time_interleaved


def gloo_allreduce(world):
    """A callable factory for torch.distributed gloo all_reduce, or None without torch."""
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
        return lambda: dist.all_reduce(t)
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
    from aluminum_py import _core
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-bytes", default="4")
    ap.add_argument("--max-bytes", default="64MiB")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds per size")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    world = MPI.COMM_WORLD
    comm = al.Communicator()
    native = world.Dup()
    gloo = None if args.no_torch else gloo_allreduce(world)
    sizes = size_sweep(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), 4)
    rows = []
    if comm.rank == 0:
        print(f"# allreduce float32 SUM, {comm.size} ranks, {MPI.Get_library_version().splitlines()[0]}")
        print(f"# median of max over ranks (us); speedup = peer time / auto time")
        print(f"{'bytes':>10} {'auto':>10} {'mpi4py':>10} {'vs mpi4py':>10}"
              + (f" {'gloo':>10} {'vs gloo':>8}" if gloo else "") + "  auto picks")
    for n in sizes:
        send = np.ones(n // 4, dtype=np.float32)
        recv = np.empty_like(send)
        contenders = {"auto": lambda: comm.Allreduce(send, recv),
                      "mpi4py": lambda: native.Allreduce(send, recv, op=MPI.SUM)}
        if gloo:
            contenders["gloo"] = gloo(send)
        samples = time_interleaved(world, contenders, iterations(world, contenders, args.budget))
        med = {k: float(np.median(v)) for k, v in samples.items()}
        row = {"bytes": n, **{k: v * 1e6 for k, v in med.items()},
               "algorithm": comm.explain(n).algorithm}
        rows.append(row)
        if comm.rank == 0:
            line = (f"{n:>10} {row['auto']:>10.1f} {row['mpi4py']:>10.1f} "
                    f"{med['mpi4py'] / med['auto']:>9.2f}x")
            if gloo:
                line += f" {row['gloo']:>10.1f} {med['gloo'] / med['auto']:>7.2f}x"
            print(line + f"  {row['algorithm']}", flush=True)
    copy_bw, add_bw = measure_bandwidths()
    copy_bw = world.allreduce(copy_bw, op=MPI.MIN)
    add_bw = world.allreduce(add_bw, op=MPI.MIN)
    if comm.rank == 0:
        speed = np.array([r["mpi4py"] / r["auto"] for r in rows])
        print(f"# auto vs mpi4py: geometric-mean speedup {np.exp(np.log(speed).mean()):.2f}x, "
              f"worst {speed.min():.2f}x at {rows[int(speed.argmin())]['bytes']} B")
        if gloo:
            g = np.array([r["gloo"] / r["auto"] for r in rows])
            print(f"# auto vs gloo: geometric-mean speedup {np.exp(np.log(g).mean()):.2f}x, "
                  f"worst {g.min():.2f}x")
        big = rows[-1]
        bound = memory_bound(big["bytes"], comm.size, copy_bw, add_bw) * 1e6
        print(f"# memory bandwidth (one core): copy {copy_bw / 1e9:.2f} GB/s, add (output) "
              f"{add_bw / 1e9:.2f} GB/s; bound at {big['bytes']} B: {bound:.0f} us; auto "
              f"{big['auto']:.0f} us = {big['auto'] / bound:.2f}x the bound")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": comm.size, "rows": rows, "copy_bw": copy_bw, "add_bw": add_bw,
                           "bound_us": bound, "mpi": MPI.Get_library_version().splitlines()[0]},
                          f, indent=1)
    native.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
