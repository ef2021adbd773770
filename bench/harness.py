"""The harness every benchmark in bench/ shares: the common options, the run's stamp, interleaved
timing with the max over ranks, medians, ratios to the peer, the table on rank 0 and the JSON and
CSV files.

A benchmark is a script that builds a dict of contenders (name -> a call with no arguments) per
row, hands it to :func:`measure` (or :func:`measure_batches` for calls too short to time one at a
time) and gives the medians to :meth:`Report.row`.  What is measured and how to read it:
bench/README.md.

Timing (aluminum_py.bench.timing, the mechanism ``bench crossover`` uses too): every iteration
runs each contender once, in a fresh random order drawn before the first call (the same on every
rank), each call after a barrier; a sample is the slowest rank's time of one call; the figure of
a contender is the median of its samples.  Ratios are ``peer time / contender time``: above 1
the contender is faster than the peer.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shlex
import sys
import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from aluminum_py.bench.timing import (interleaved_orders, iterations, parse_bytes, size_sweep,
                                      time_interleaved)


def options(doc: str, *, sizes: str | None = "4:64MiB", budget: float = 1.0,
            batches: tuple[int, int] | None = None) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has: ``--json FILE`` and ``--csv
    FILE`` (the rows, written by rank 0); with `sizes` ("lo:hi" or a comma-separated list)
    ``--sizes``, message sizes in bytes ("4:64MiB": every power of two from 4 B to 64 MiB).
    Then either ``--iters N`` (iterations per row; 0: as many as ``--budget`` seconds per row
    allow, at least 10) and ``--budget`` (:func:`measure`), or, with `batches` = (calls,
    batches), ``--calls`` and ``--batches`` (:func:`measure_batches`)."""
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if sizes is not None:
        ap.add_argument("--sizes", default=sizes,
                        help=f"bytes per rank: lo:hi (powers of two) or a list (default {sizes})")
    if batches is None:
        ap.add_argument("--iters", type=int, default=0,
                        help="iterations per row (default 0: as many as --budget allows, >= 10)")
        ap.add_argument("--budget", type=float, default=budget,
                        help=f"seconds per row when --iters is 0 (default {budget})")
    else:
        ap.add_argument("--calls", type=int, default=batches[0],
                        help=f"calls back to back per contender per batch (default {batches[0]})")
        ap.add_argument("--batches", type=int, default=batches[1],
                        help=f"batches, each in a fresh order (default {batches[1]})")
    ap.add_argument("--json", default=None, help="write the stamp and the rows as JSON")
    ap.add_argument("--csv", default=None, help="write the rows as CSV (one line per row)")
    return ap


def parse(ap: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``ap.parse_args`` with the common checks: counts and the budget not negative."""
    args = ap.parse_args(argv)
    for name in ("iters", "budget", "calls", "batches"):
        if getattr(args, name, 0) < 0 or (name in ("calls", "batches") and
                                          getattr(args, name, 1) == 0):
            ap.error(f"--{name} must be {'positive' if name in ('calls', 'batches') else 'at least 0'}")
    return args


def sizes(spec: str, itemsize: int = 1) -> list[int]:
    """`spec` as bytes: "lo:hi" gives the powers of two from lo to hi (multiples of itemsize),
    "a,b,c" those sizes ("64KiB" and the like accepted)."""
    if ":" in spec:
        lo, hi = spec.split(":", 1)
        return size_sweep(parse_bytes(lo), parse_bytes(hi), itemsize)
    return [parse_bytes(s) for s in spec.split(",") if s.strip()]


def stamp(world) -> dict:
    """What a figure needs beside it: the UTC date and time, the command line, the number of
    ranks, the MPI library, the versions, the machine and its load when the run started."""
    import aluminum_py
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
            "ranks": world.size, "mpi": MPI.Get_library_version().splitlines()[0].strip(),
            "aluminum_py": getattr(aluminum_py, "__version__", "?"), "numpy": np.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "load": round(os.getloadavg()[0], 2)}


def measure(world, contenders: dict[str, Callable[[], object]], iters: int = 0,
            budget: float = 1.0, salt: int = 0) -> dict[str, np.ndarray]:
    """Per contender, its samples in seconds (the max over ranks of one call), interleaved
    (see the module's docstring).  Every contender is called once first (a warm-up); `iters` 0
    picks the count from `budget` (at least 10, the same on every rank).  Give each row its own
    `salt` (its bytes) so no contender follows the same one at every row."""
    if not iters:
        iters = iterations(world, contenders, budget, lo=10)
    else:
        for f in contenders.values():
            f()
    return time_interleaved(world, contenders, iters, salt=salt)


def measure_batches(world, contenders: dict[str, Callable[[], object]], calls: int,
                    batches: int, before_turn: Callable[[], object] | None = None
                    ) -> dict[str, np.ndarray]:
    """For calls of a few microseconds, where a barrier per call would be most of the time: per
    contender and batch, the time per call of `calls` calls back to back (seconds, the max over
    ranks), every batch in a fresh random order, each contender's turn after a barrier.
    `before_turn`, if given, runs before each turn (and warm-up), outside the time."""
    names = list(contenders)
    per_call = np.zeros((len(names), batches))
    for f in contenders.values():                 # warm-up: the engine, the schedule caches
        if before_turn is not None:
            before_turn()
        for _ in range(min(calls, 200)):
            f()
    for b, order in enumerate(interleaved_orders(len(names), batches, salt=calls)):
        for i in order:
            f = contenders[names[i]]
            if before_turn is not None:
                before_turn()
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            per_call[i, b] = (time.perf_counter() - t0) / calls
    world.Allreduce(MPI.IN_PLACE, per_call, op=MPI.MAX)
    return {name: per_call[i] for i, name in enumerate(names)}


def medians_us(samples: dict[str, np.ndarray]) -> dict[str, float]:
    return {k: float(np.median(v)) * 1e6 for k, v in samples.items()}


def check(world, calls: dict, expected: dict, exact: bool = True) -> tuple[list[str], dict]:
    """Run every call once (a barrier before each) and compare its result (``call.result()``)
    with ``expected[name]``: bitwise with `exact`, else to float32 rounding.  A call that raises
    on any rank leaves `calls`.  Returns (the names whose result is wrong on some rank, {name:
    why} of the calls removed), the same on every rank."""
    local = {}
    for name, call in list(calls.items()):
        world.Barrier()
        try:
            call()
            got, want = np.asarray(call.result()), expected[name]
            same = np.array_equal(got, want) if exact else np.allclose(got, want, rtol=1e-5)
            local[name] = None if same else "wrong"
        except Exception as e:  # noqa: BLE001  (reported, the contender is dropped)
            local[name] = f"{type(e).__name__}: {str(e)[:200]}"
    wrong, dropped = [], {}
    for r, errors in enumerate(world.allgather(local)):
        for name, err in errors.items():
            if err == "wrong" and name not in wrong:
                wrong.append(name)
            elif err and err != "wrong" and name in calls:
                del calls[name]
                dropped[name] = f"raised on rank {r}: {err}"
    return wrong, dropped


def geomean(values) -> float:
    v = np.asarray([x for x in values if x and x > 0], dtype=float)
    return float(np.exp(np.log(v).mean())) if len(v) else float("nan")


class Report:
    """The rows of one benchmark: printed on rank 0 as they come (the key columns, the median
    of each contender in microseconds, then ``vs <peer>``: each of `ours`' ratio over the peer),
    kept with the stamp for ``--json`` and ``--csv``.

        report = Report(world, args, "allreduce float32 SUM", keys=["bytes"], ours=["auto"],
                        peers=["mpi4py"])
        report.row({"bytes": n}, medians_us(samples))
        report.finish()                  # the summary lines, the files; returns the exit status
    """

    def __init__(self, world, args, title: str, keys: list[str], ours: list[str],
                 peers: list[str], unit: str = "us", notes: tuple[str, ...] = ()):
        self.world, self.args, self.title = world, args, title
        self.keys, self.ours, self.peers, self.unit = keys, list(ours), list(peers), unit
        self.rows, self.notes, self.wrong, self.skipped = [], list(notes), [], {}
        self.stamp = stamp(world)
        self.header_done = False

    @property
    def rank0(self) -> bool:
        return self.world.rank == 0

    def say(self, text: str) -> None:
        """A comment line on rank 0 (kept in the JSON's notes too)."""
        self.notes.append(text)
        if self.rank0:
            print(f"# {text}", flush=True)

    def skip(self, name: str, why: str) -> None:
        if name not in self.skipped:
            self.skipped[name] = why
            self.say(f"{name}: left out, {why}")

    def _header(self, times: dict) -> None:
        s = self.stamp
        self.columns = [c for c in self.peers + self.ours if c in times] + \
            [c for c in times if c not in self.peers + self.ours]
        if self.rank0:
            print(f"# {self.title}; {s['ranks']} rank(s), {s['mpi']}; {s['date']}, "
                  f"load {s['load']} on {s['cpus']} CPUs")
            print(f"# {s['command']}")
            print(f"# median over iterations of the slowest rank's time ({self.unit}); "
                  f"vs <peer> = peer time / our time (above 1: ours is faster)")
            print("".join(f"{k:>14}" for k in self.keys)
                  + "".join(f" {c:>14}" for c in self.columns)
                  + "".join(f" {o + ' vs ' + p:>18}" for o in self.ours for p in self.peers
                            if o in times and p in times), flush=True)
        self.header_done = True

    def row(self, keys: dict, times: dict[str, float], wrong=(), **extra) -> dict:
        """One row: `keys` (e.g. {"bytes": n}), `times` (contender -> median in self.unit),
        the names whose result was wrong (marked ``!``), and any `extra` fields for the files."""
        if not self.header_done:
            self._header(times)
        ratios = {f"{o}_vs_{p}": times[p] / times[o] for o in self.ours for p in self.peers
                  if o in times and p in times and times[o] > 0}
        row = {**keys, **times, **ratios, "wrong": list(wrong), **extra}
        self.rows.append(row)
        self.wrong += [w for w in wrong if w not in self.wrong]
        if self.rank0:
            print("".join(f"{keys[k]!s:>14}" for k in self.keys)
                  + "".join(f" {times[c]:>13.1f}{'!' if c in wrong else ' '}" if c in times
                            else f" {'-':>14}" for c in self.columns)
                  + "".join(f" {ratios[f'{o}_vs_{p}']:>17.2f}x" for o in self.ours
                            for p in self.peers if f"{o}_vs_{p}" in ratios), flush=True)
            if wrong:
                print(f"# WRONG result from {', '.join(wrong)} (marked !)", flush=True)
        return row

    def summary(self) -> None:
        """Per (ours, peer): the geometric mean of the ratios over the rows and the worst row."""
        for o in self.ours:
            for p in self.peers:
                key = f"{o}_vs_{p}"
                rows = [r for r in self.rows if key in r]
                if rows:
                    worst = min(rows, key=lambda r: r[key])
                    where = ", ".join(f"{k} {worst[k]}" for k in self.keys)
                    self.say(f"{o} vs {p}: geometric mean {geomean(r[key] for r in rows):.2f}x "
                             f"over {len(rows)} rows, worst {worst[key]:.2f}x at {where}")

    def finish(self, **extra) -> int:
        """The summary, then the JSON and CSV files (rank 0); 1 if any result was wrong."""
        self.summary()
        if self.rank0 and getattr(self.args, "json", None):
            with open(self.args.json, "w") as f:
                json.dump({**self.stamp, "title": self.title, "ours": self.ours,
                           "peers": self.peers, "unit": self.unit, "skipped": self.skipped,
                           "notes": self.notes, **extra, "rows": self.rows}, f, indent=1)
        if self.rank0 and getattr(self.args, "csv", None):
            fields = []
            for r in self.rows:
                fields += [k for k, v in r.items() if k not in fields and not isinstance(v, (dict, list))]
            with open(self.args.csv, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
                w.writeheader()
                w.writerows(self.rows)
        return 1 if self.wrong else 0


def combine(runs: list[dict]) -> list[dict]:
    """Several runs' JSON of one benchmark as one table: per row (the key columns) and ratio,
    the median over the runs and the lowest and highest run; per contender its median time."""
    keys = [k for k in ("collective", "bytes", "mode") if k in runs[0]["rows"][0]]
    table = {}
    for run in runs:
        for r in run["rows"]:
            at = table.setdefault(tuple(r[k] for k in keys), {})
            for k, v in r.items():
                if k not in keys and isinstance(v, (int, float)) and not isinstance(v, bool):
                    at.setdefault(k, []).append(v)
    out = []
    for at, fields in table.items():
        row = dict(zip(keys, at))
        for k, vs in fields.items():
            row[k] = float(np.median(vs))
            if "_vs_" in k:
                row[k + "_range"] = (min(vs), max(vs))
        out.append(row)
    return out


def main(argv=None) -> int:
    """``python bench/harness.py RUN.json ...``: the runs of one benchmark (its --json files)
    combined: per row the median time of each contender over the runs and each ratio's median
    with its lowest and highest run, so a reader sees which ratios the runs agree on."""
    ap = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0].split(": ", 1)[1])
    ap.add_argument("runs", nargs="+", help="--json files of one benchmark")
    args = ap.parse_args(argv)
    runs = [json.load(open(p)) for p in args.runs]
    for p, run in zip(args.runs, runs):
        print(f"# {p}: {run.get('date')}, {run.get('ranks')} rank(s), load {run.get('load')}: "
              f"{run.get('command')}")
    rows = combine(runs)
    ours, peers = runs[0]["ours"], runs[0]["peers"]
    keys = [k for k in ("collective", "bytes", "mode") if k in rows[0]]
    print(f"# median over {len(runs)} runs (us); ratio = peer time / ours, median [lowest, "
          "highest run]")
    names = [c for c in peers + ours if c in rows[0]]
    print("".join(f"{k:>14}" for k in keys) + "".join(f" {c:>12}" for c in names)
          + "".join(f" {o + ' vs ' + p:>24}" for o in ours for p in peers
                    if f"{o}_vs_{p}" in rows[0]))
    for r in rows:
        cells = []
        for o in ours:
            for p in peers:
                k = f"{o}_vs_{p}"
                if k in r:
                    lo, hi = r[k + "_range"]
                    cells.append(f" {r[k]:>8.2f}x [{lo:.2f}, {hi:.2f}]".rjust(25))
        print("".join(f"{r[k]!s:>14}" for k in keys)
              + "".join(f" {r[c]:>12.1f}" if c in r else f" {'-':>12}" for c in names)
              + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
