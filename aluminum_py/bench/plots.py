"""PNG plots of crossover runs (matplotlib, Agg backend): time vs size per algorithm (paper
Fig. 11) and the crossover map "fastest algorithm per (ranks, size)" (paper Fig. 10)."""
from __future__ import annotations

import json


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_run(run: dict, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for a in run["algorithms"]:
        ax.loglog(run["sizes"], [t * 1e6 for t in run["median"][a]], marker="o", ms=3, label=a)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("time (us), median of max over ranks")
    ax.set_title(f"allreduce {run['dtype']}, {run['ranks']} ranks ({run['mpi']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def crossover_map(runs: list[dict]) -> tuple[list[int], list[int], dict]:
    """(rank counts, sizes, {(ranks, size): fastest algorithm}) over several runs."""
    cells = {}
    for run in runs:
        for n, best in zip(run["sizes"], run["fastest"]):
            cells[(run["ranks"], n)] = best
    ranks = sorted({r for r, _ in cells})
    sizes = sorted({n for _, n in cells})
    return ranks, sizes, cells


def format_map(runs: list[dict]) -> str:
    ranks, sizes, cells = crossover_map(runs)
    lines = [f"{'bytes':>12}" + "".join(f"{f'{r} ranks':>22}" for r in ranks)]
    for n in sizes:
        lines.append(f"{n:>12}" + "".join(f"{cells.get((r, n), '-'):>22}" for r in ranks))
    return "\n".join(lines)


def plot_map(runs: list[dict], path: str) -> None:
    import numpy as np
    plt = _pyplot()
    ranks, sizes, cells = crossover_map(runs)
    algs = sorted(set(cells.values()))
    grid = np.full((len(ranks), len(sizes)), np.nan)
    for (r, n), a in cells.items():
        grid[ranks.index(r), sizes.index(n)] = algs.index(a)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(ranks)))
    cmap = plt.get_cmap("tab10", len(algs))
    ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(algs) - 0.5, interpolation="nearest")
    ax.set_yticks(range(len(ranks)), [str(r) for r in ranks])
    step = max(1, len(sizes) // 12)
    ax.set_xticks(range(0, len(sizes), step), [str(sizes[i]) for i in range(0, len(sizes), step)],
                  rotation=45, ha="right")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("ranks")
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i)) for i in range(len(algs))]
    ax.legend(handles, algs, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_title("fastest allreduce algorithm per (ranks, size)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def map_main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m aluminum_py bench map",
                                 description="Merge crossover runs (--json files) at different "
                                             "rank counts into the crossover map.")
    ap.add_argument("runs", nargs="+", help="JSON files written by `bench crossover --json`")
    ap.add_argument("--plot", default=None, help="PNG file")
    args = ap.parse_args(argv)
    runs = []
    for p in args.runs:
        with open(p) as f:
            runs.append(json.load(f))
    print(format_map(runs))
    if args.plot:
        plot_map(runs, args.plot)
    return 0
