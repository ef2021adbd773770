"""``mpiexec -n N python -m aluminum_py bench crossover``: time every allreduce algorithm over a
size sweep in repeated passes, report the fastest per size and where a table would override
auto's cost model (tuning.verdicts, tuning.overrides), and optionally write the table
(``--tune``)."""
from __future__ import annotations

import argparse
import csv
import json
import sys

import numpy as np

from ..algorithms import GPU_CANDIDATES, HOST_CANDIDATES
from .timing import (Progress, bus_bandwidth, human, iterations, parse_bytes, recvbuf_like,
                     size_sweep, time_interleaved)

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
    ap.add_argument("--passes", type=int, default=3,
                    help="passes of the whole sweep, interleaved at each size (default 3; the "
                         "table overrides the model only with 3 or more)")
    ap.add_argument("--iters", type=int, default=0,
                    help="iterations per size and pass (0: adapt to size)")
    ap.add_argument("--budget", type=float, default=1.0,
                    help="seconds per size and pass when adapting iterations (default 1)")
    ap.add_argument("--csv", default=None, help="write per (size, algorithm) rows")
    ap.add_argument("--json", default=None, help="write the whole run (input of `bench map`)")
    ap.add_argument("--plot", default=None, help="PNG: time vs size per algorithm")
    ap.add_argument("--tune", action="store_true",
                    help="write the tuning table (AL_TUNING_FILE or the per-user cache file)")
    ap.add_argument("--tuning-file", default=None, help="tuning table path (overrides AL_TUNING_FILE)")
    ap.add_argument("--quiet", action="store_true", help="no table, no progress bar")
    return ap


def sweep(comm, world, sizes, algorithms, dtype, nonblocking=False, iters=0, budget=1.0,
          show_progress=False, buffer="host", shared_recv=False, passes=3) -> dict:
    """Time every algorithm at every size, in `passes` passes of the whole sweep (each size's
    contenders interleaved, timing.time_interleaved; a pass revisits every size, so the passes
    see the machine at different moments).  Returns the run: a dict with ranks, local_size,
    ranks_per_node (the topology: ranks of each node in node order, rank 0's first), dtype,
    dtype_size, buffer, mpi, nonblocking, sizes, algorithms, iters (per size and pass), per
    algorithm lists (one value per size) under median / min / max (seconds, over every pass's
    samples) and busbw (bytes/s), fastest (per size, the lowest median), passes (per pass, per
    algorithm, its median per size), model (per size, the choice of auto's rule without a
    table) and verdicts (per size, tuning.verdicts' alternatives to the model, the best
    first, each a list [algorithm, model, margin, spread]).  GPU buffers: every call ends with a
    stream sync."""
    from .. import tuning
    dt = np.dtype(dtype)
    rpn = list(comm._topology.ranks_per_node)      # computed once, at the Communicator's making
    run = {"ranks": comm.size, "local_size": rpn[0], "ranks_per_node": rpn,
           "dtype": str(dt), "dtype_size": dt.itemsize, "buffer": buffer,
           "mpi": tuning.mpi_version(), "nonblocking": bool(nonblocking), "sizes": list(sizes),
           "algorithms": list(algorithms), "iters": [0] * len(sizes)}
    samples = [{a: [] for a in algorithms} for _ in sizes]
    medians = [{a: [0.0] * len(sizes) for a in algorithms} for _ in range(passes)]
    bar = Progress(len(sizes) * passes, show_progress and comm.rank == 0, "crossover")
    for k in range(passes):
        for i, nbytes in enumerate(sizes):
            contenders = _contenders(comm, nbytes, dt, algorithms, nonblocking, buffer,
                                     shared_recv)
            if k == 0:
                run["iters"][i] = iters or iterations(world, contenders, budget)  # and warm-up
            got = time_interleaved(world, contenders, run["iters"][i], salt=(nbytes, k))
            for a in algorithms:
                samples[i][a].append(got[a])
                medians[k][a][i] = float(np.median(got[a]))
            bar.update(f"pass {k + 1}, {human(nbytes)}")
    bar.close()
    every = [{a: np.concatenate(s[a]) for a in algorithms} for s in samples]
    for key, f in (("median", np.median), ("min", np.min), ("max", np.max)):
        run[key] = {a: [float(f(e[a])) for e in every] for a in algorithms}
    run["busbw"] = {a: [bus_bandwidth(n, t, comm.size) for n, t in zip(sizes, run["median"][a])]
                    for a in algorithms}
    run["fastest"] = [min(algorithms, key=lambda a: run["median"][a][i]) for i in range(len(sizes))]
    run["passes"] = medians
    model = (tuning.gpu_model if buffer == "cuda" else comm._host.chooser.model)
    run["model"] = [model(n, dt.itemsize).algorithm for n in sizes]
    found = tuning.verdicts(sizes, medians, run["model"], [a for a in algorithms if a != "auto"])
    run["verdicts"] = [[list(v) for v in vs] for vs in found]
    return run


def _contenders(comm, nbytes, dt, algorithms, nonblocking, buffer, shared_recv) -> dict:
    """Per algorithm, one call of it on `nbytes` (a recvbuf each, at the sendbuf's page offset,
    unless `shared_recv`)."""
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
        recv = shared if shared_recv else make_recv()
        if nonblocking:
            call = lambda: comm.Iallreduce(send, recv, algorithm=alg).Wait()   # noqa: E731
        else:
            call = lambda: comm.Allreduce(send, recv, algorithm=alg)           # noqa: E731
        return call if sync is None else (lambda: (call(), sync()))
    return {a: contender(a) for a in algorithms}


def _verdict(vs) -> str:
    """A size's best verdict (sweep's lists) in a few characters."""
    if not vs:
        return "-"
    alg, _, margin, spread = vs[0]
    return f"{alg} {margin:.2f}x/{spread:.0%}"


def format_table(run: dict) -> str:
    algs = run["algorithms"]
    width = max(12, *(len(a) + 2 for a in algs))
    lines = [f"# aluminum_py crossover: allreduce {run['dtype']} SUM"
             f"{' (Iallreduce+Wait)' if run['nonblocking'] else ''}, {topology_name(run)}, "
             f"{run['mpi']}, {len(run['passes'])} passes",
             "# median over passes and iterations of the max over ranks (us); busbw of the "
             "fastest (GB/s); model: auto's choice without a table; best other: the alternative "
             "to it with the least margin over passes (model's time / its time) / the spread "
             "between passes",
             f"{'# Size(B)':>12}" + "".join(f"{a:>{width}}" for a in algs) + f"{'fastest':>{width}}"
             + f"{'busbw':>10}{'model':>{width}}  best other"]
    for i, n in enumerate(run["sizes"]):
        best = run["fastest"][i]
        cells = "".join(f"{run['median'][a][i] * 1e6:>{width}.2f}" for a in algs)
        lines.append(f"{n:>12}{cells}{best:>{width}}{run['busbw'][best][i] / 1e9:>10.2f}"
                     f"{run['model'][i]:>{width}}  {_verdict(run['verdicts'][i])}")
    return "\n".join(lines)


def describe_overrides(run: dict) -> list[str]:
    """What a table of `run` does to auto (tuning.overrides): where it overrides the model and
    by how much, where it keeps it and why."""
    from ..tuning import MIN_PASSES, MIN_RUN, Verdict, overrides
    sizes = run["sizes"]
    if len(run["passes"]) < MIN_PASSES:
        return [f"# {len(run['passes'])} passes: the table overrides the model only with "
                f"{MIN_PASSES} or more; auto keeps the model at every size"]
    found = [[Verdict(*v) for v in vs] for vs in run["verdicts"]]
    ranges = overrides(sizes, found)
    best = [vs[0] if vs else None for vs in found]
    lines = [f"# overrides the model: {o.algorithm} {human(o.min_bytes)}..{human(o.max_bytes)} "
             f"(the model's {o.model}; at least {o.margin:.2f}x faster in every pass, spread "
             f"between passes at most {o.spread:.0%})" for o in ranges]
    covered = {i for o in ranges for i, n in enumerate(sizes) if o.min_bytes <= n <= o.max_bytes}
    islands = [f"{v.algorithm} at {human(n)} ({v.margin:.2f}x)" for i, (n, v) in
               enumerate(zip(sizes, best)) if v is not None and v.beyond_noise and i not in covered]
    noise = [f"{human(n)} ({v.algorithm} {v.margin:.2f}x, spread {v.spread:.0%})"
             for n, v in zip(sizes, best) if v is not None and not v.beyond_noise and v.margin > 1]
    kept = len(sizes) - len(covered)
    lines.append(f"# keeps the model at {kept} of {len(sizes)} sizes" + (":" if kept else ""))
    if islands:
        lines.append(f"#   wins at fewer than {MIN_RUN} neighbouring sizes (islands, not used): "
                     + ", ".join(islands))
    if noise:
        lines.append("#   faster in the median but not beyond the spread between passes: "
                     + ", ".join(noise))
    if kept and not islands and not noise:
        lines.append("#   no alternative faster than the model's choice in every pass")
    return lines


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
    algs = [a for a in run["algorithms"] if a != "auto"]      # "auto" itself is not a choice
    entry = tuning.make_entry(run["ranks"], run["ranks_per_node"], run["buffer"],
                              run["dtype_size"], run["mpi"], run["sizes"],
                              [{a: p[a] for a in algs} for p in run["passes"]])
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
    if args.passes < 1:
        if world.rank == 0:
            print("--passes: at least 1", file=sys.stderr)
        return 2
    run = sweep(comm, world, sizes, algorithms, dt, args.nonblocking, args.iters, args.budget,
                show_progress=not args.quiet, buffer=args.buffer, passes=args.passes)
    if comm.rank == 0:
        if not args.quiet:
            print(format_table(run), flush=True)
        if args.tune:       # first: a failing --csv/--json/--plot must not lose the table
            path, entry = tune(run, args.tuning_file)
            print(f"# tuning table written to {path} for {entry['topology']}, "
                  f"{entry['dtype_size']}-byte elements", flush=True)
        if args.tune or not args.quiet:
            print("\n".join(describe_overrides(run)), flush=True)
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
