"""``mpiexec -n N python -m aluminum_py bench crossover``: time every allreduce algorithm over a
size sweep, report the fastest per size, and optionally write the tuning table (``--tune``)."""
from __future__ import annotations

import argparse
import csv
import json
import sys

import numpy as np

from ..algorithms import GPU_CANDIDATES, HOST_CANDIDATES
from .timing import (Progress, bus_bandwidth, decide, human, iterations, parse_bytes,
                     recvbuf_like, size_sweep, time_interleaved)

DEFAULT_ALGORITHMS = ",".join(HOST_CANDIDATES)       # what "auto" chooses from: all it can time
DEFAULT_GPU_ALGORITHMS = ",".join(GPU_CANDIDATES)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m aluminum_py bench crossover",
                                 description="Allreduce crossover benchmark (run under mpiexec).")
    ap.add_argument("--min-bytes", default="4", help="smallest message (default 4)")
    ap.add_argument("--max-bytes", default="64MiB", help="largest message (default 64MiB)")
    ap.add_argument("--algorithms", default=None,
                    help=f"comma-separated (default {DEFAULT_ALGORITHMS}, with --buffer cuda "
                         f"{DEFAULT_GPU_ALGORITHMS}; 'auto' allowed)")
    ap.add_argument("--buffer", choices=("host", "cuda"), default="host",
                    help="host (numpy) or cuda (CuPy arrays on one GPU per rank) buffers")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--odd", action="store_true", help="add 1.5 * 2^k sizes between the powers of two")
    ap.add_argument("--nonblocking", action="store_true", help="time Iallreduce + Wait")
    ap.add_argument("--iters", type=int, default=0, help="iterations per size (0: adapt to size)")
    ap.add_argument("--budget", type=float, default=2.0,
                    help="seconds per size when adapting iterations (default 2)")
    ap.add_argument("--csv", default=None, help="write per (size, algorithm) rows")
    ap.add_argument("--json", default=None, help="write the whole run (input of `bench map`)")
    ap.add_argument("--plot", default=None, help="PNG: time vs size per algorithm")
    ap.add_argument("--tune", action="store_true",
                    help="write the tuning table (AL_TUNING_FILE or the per-user cache file)")
    ap.add_argument("--tuning-file", default=None, help="tuning table path (overrides AL_TUNING_FILE)")
    ap.add_argument("--quiet", action="store_true", help="no table, no progress bar")
    return ap


EXTRA_ROUNDS = 2    # more rounds of the two best where their medians are within noise


def sweep(comm, world, sizes, algorithms, dtype, nonblocking=False, iters=0, budget=2.0,
          show_progress=False, buffer="host", shared_recv=False) -> dict:
    """Time every algorithm at every size. Returns the run: a dict with ranks, local_size,
    ranks_per_node (the topology: ranks of each node in node order, rank 0's first; from
    ``MPI_Comm_split_type(SHARED)`` or AL_NODE_LAYOUT, as the hierarchical algorithm sees it), dtype, dtype_size, buffer, mpi, nonblocking, sizes, algorithms, iters, and per algorithm
    lists (one value per size) under median / min / max (seconds) and busbw (bytes/s), plus
    per size: fastest (the algorithm chosen, timing.decide), margin (the runner-up's median over
    the best's), clear (the two best medians' confidence intervals apart, after up to
    EXTRA_ROUNDS more rounds of only those two where they were not) and decided ("median", or
    "worst case": within noise, and the one with the lower 90th percentile chosen). GPU
    buffers: every call ends with a stream sync."""
    from ..tuning import mpi_version
    dt = np.dtype(dtype)
    rpn = list(comm._topology.ranks_per_node)      # computed once, at the Communicator's making
    run = {"ranks": comm.size, "local_size": rpn[0], "ranks_per_node": rpn,
           "dtype": str(dt), "dtype_size": dt.itemsize, "buffer": buffer,
           "mpi": mpi_version(),
           "nonblocking": bool(nonblocking), "sizes": [], "algorithms": list(algorithms),
           "iters": [], "median": {a: [] for a in algorithms}, "min": {a: [] for a in algorithms},
           "max": {a: [] for a in algorithms}, "busbw": {a: [] for a in algorithms}, "fastest": [],
           "margin": [], "decided": [], "clear": []}
    bar = Progress(len(sizes), show_progress and comm.rank == 0, "crossover")
    for nbytes in sizes:
        count = nbytes // dt.itemsize
        if buffer == "cuda":
            import cupy
            send = cupy.ones(count, dtype=dt)
            make_recv = lambda: cupy.empty(count, dtype=dt)         # noqa: E731
            sync = cupy.cuda.ExternalStream(comm.stream).synchronize
        else:
            send, sync = np.ones(count, dtype=dt), None
            make_recv = lambda: recvbuf_like(send)                  # noqa: E731
        shared = make_recv() if shared_recv else None

        def contender(alg):
            # a recvbuf per algorithm (docs/tuning.md), each at the sendbuf's page offset
            recv = shared if shared_recv else make_recv()
            if nonblocking:
                call = lambda: comm.Iallreduce(send, recv, algorithm=alg).Wait()   # noqa: E731
            else:
                call = lambda: comm.Allreduce(send, recv, algorithm=alg)           # noqa: E731
            if sync is None:
                return call
            return lambda: (call(), sync())

        contenders = {a: contender(a) for a in algorithms}
        n_it = iterations(world, contenders, budget)      # also the warm-up
        n_it = iters or n_it
        samples = time_interleaved(world, contenders, n_it, salt=nbytes)
        verdict = decide(samples)
        for _ in range(0 if iters else EXTRA_ROUNDS):
            if verdict["clear"]:
                break
            # the two best within noise: more samples of those two, interleaved (the same
            # decision on every rank: the samples are the max over ranks, identical everywhere)
            top = (verdict["best"], verdict["runner_up"])
            more = time_interleaved(world, {a: contenders[a] for a in top}, n_it,
                                    salt=nbytes + 1)
            for a in top:
                samples[a] = np.concatenate([samples[a], more[a]])
            verdict = decide(samples)
        run["sizes"].append(nbytes)
        run["iters"].append(n_it)
        for a in algorithms:
            med = float(np.median(samples[a]))
            run["median"][a].append(med)
            run["min"][a].append(float(samples[a].min()))
            run["max"][a].append(float(samples[a].max()))
            run["busbw"][a].append(bus_bandwidth(nbytes, med, comm.size))
        best = verdict["best"]
        run["fastest"].append(best)
        run["margin"].append(verdict["margin"])
        run["decided"].append(verdict["decided"])
        run["clear"].append(verdict["clear"])
        bar.update(f"{human(nbytes)}: {best}")
    bar.close()
    return run


def format_table(run: dict) -> str:
    algs = run["algorithms"]
    width = max(12, *(len(a) + 2 for a in algs))
    lines = [f"# aluminum_py crossover: allreduce {run['dtype']} SUM"
             f"{' (Iallreduce+Wait)' if run['nonblocking'] else ''}, {topology_name(run)}, "
             f"{run['mpi']}",
             "# median over iterations of the max over ranks (us); busbw of the fastest (GB/s); "
             "next: the runner-up's median over the fastest's (~: the two within noise, * the "
             "fastest chosen for its 90th percentile)",
             f"{'# Size(B)':>12}" + "".join(f"{a:>{width}}" for a in algs) + f"{'fastest':>{width}}"
             + f"{'busbw':>10}{'next':>8}"]
    for i, n in enumerate(run["sizes"]):
        best = run["fastest"][i]
        cells = "".join(f"{run['median'][a][i] * 1e6:>{width}.2f}" for a in algs)
        mark = ("*" if run["decided"][i] == "worst case" else "~" if not run["clear"][i]
                else " ") if "margin" in run else " "
        margin = f"{run['margin'][i]:.2f}{mark}" if "margin" in run else ""
        lines.append(f"{n:>12}{cells}{best:>{width}}{run['busbw'][best][i] / 1e9:>10.2f}"
                     f"{margin:>8}")
    return "\n".join(lines)


def topology_name(run: dict) -> str:
    """"4 ranks as 2 nodes x 2"; runs saved before they recorded it: "4 ranks (2 per node)"."""
    from ..tuning import describe_topology
    if run.get("ranks_per_node"):
        return describe_topology(run["ranks"], run["ranks_per_node"])
    return f"{run['ranks']} ranks ({run['local_size']} per node)"


def write_csv(run: dict, path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ranks", "bytes", "algorithm", "median_us", "min_us", "max_us", "busbw_GBps",
                    "iters", "fastest"])
        for i, n in enumerate(run["sizes"]):
            for a in run["algorithms"]:
                w.writerow([run["ranks"], n, a, run["median"][a][i] * 1e6, run["min"][a][i] * 1e6,
                            run["max"][a][i] * 1e6, run["busbw"][a][i] / 1e9, run["iters"][i],
                            int(run["fastest"][i] == a)])


def tune(run: dict, path: str | None = None):
    """Merge this run into the tuning table; returns (path, entry)."""
    from .. import tuning
    algs = [a for a in run["algorithms"] if a != "auto"]
    keep = all(a in algs for a in run["fastest"])      # "auto" itself is not a choice
    entry = tuning.make_entry(run["ranks"], run["ranks_per_node"], run["buffer"], run["dtype_size"],
                              run["mpi"], run["sizes"], {a: run["median"][a] for a in algs},
                              **({"choice": run["fastest"], "margin": run["margin"],
                                  "decided": run["decided"]} if keep and "margin" in run else {}))
    return tuning.merge_into_file(entry, path), entry


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from mpi4py import MPI

    import aluminum_py as al
    world = MPI.COMM_WORLD
    default = DEFAULT_GPU_ALGORITHMS if args.buffer == "cuda" else DEFAULT_ALGORITHMS
    algorithms = [a for a in (args.algorithms or default).split(",") if a]
    known = al.algorithms("allreduce", args.buffer)
    bad = [a for a in algorithms if a not in known]
    if bad:
        if world.rank == 0:
            print(f"--algorithms: unknown {', '.join(bad)}; choose from {', '.join(known)}",
                  file=sys.stderr)
        return 2
    if args.buffer == "cuda":
        from ..gpu import cuda_device_count
        if cuda_device_count() == 0:
            if world.rank == 0:
                print("--buffer cuda: no CUDA device is available", file=sys.stderr)
            return 2
    if args.tune and "auto" in algorithms:
        algorithms.remove("auto")
    if not algorithms:
        if world.rank == 0:
            print("--algorithms: nothing to time" + (" (--tune ignores auto)" if args.tune else ""),
                  file=sys.stderr)
        return 2
    if args.buffer == "cuda":
        import cupy
        local = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
        comm = al.Communicator(stream=cupy.cuda.Stream(non_blocking=True))
    else:
        comm = al.Communicator()
        if args.algorithms is None:     # what this communicator's auto picks from ("shm": one node)
            algorithms = [a for a in algorithms if a in comm._host.candidates]
    dt = np.dtype(args.dtype)
    sizes = size_sweep(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), dt.itemsize,
                       odd=args.odd)
    run = sweep(comm, world, sizes, algorithms, dt, args.nonblocking, args.iters, args.budget,
                show_progress=not args.quiet, buffer=args.buffer)
    if comm.rank == 0:
        if not args.quiet:
            print(format_table(run), flush=True)
        if args.tune:       # first: a failing --csv/--json/--plot must not lose the table
            path, entry = tune(run, args.tuning_file)
            ranges = ", ".join(f"{r['algorithm']} {human(r['min_bytes'])}..{human(r['max_bytes'])}"
                               for r in entry["ranges"])
            print(f"# tuning table written to {path} for {entry['topology']}: {ranges}",
                  flush=True)
        if args.csv:
            write_csv(run, args.csv)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(run, f, indent=1)
        if args.plot:
            from .plots import plot_run
            plot_run(run, args.plot)
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
