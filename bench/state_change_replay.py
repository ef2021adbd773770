"""Replay what learning recorded in ``bench/peers.py --json`` runs through the change-of-state
rule (aluminum_py.learning.state_change): in how many size classes it fires, and, where it
does, what the rounds after the change decide, against the choice made from all the rounds and
the timing that followed in the same run (each contender's median there over the fastest's).

    python bench/state_change_replay.py RUN.json [RUN.json ...]
    python bench/state_change_replay.py --extract OUT.json.gz RUN.json ...   # keep what it reads

A replay cannot run the rounds that learning adds after a change; where the rounds after it
leave the contest in doubt (learning would have learned longer) it says so.  Nor can it tell
how long the rounds lasted (the records keep no call times): it applies the shift test alone,
not learning's CHANGE_SECONDS.  ``--extract``
keeps the learned rounds and the timing's medians of each run (about 1% of the runs' size),
and the replay reads such a file as it reads runs.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
from collections import Counter

import numpy as np

from aluminum_py.learning import Learner, state_change
from aluminum_py.tuning import Choice


def classes(paths):
    """(run, row) per learned size class with its rounds' times, from runs or an extract."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            data = json.load(f)
        runs = data["runs"] if "runs" in data else {os.path.relpath(path): data}
        for name, run in runs.items():
            for row in run["rows"]:
                if (row.get("learned") or {}).get("times_us"):
                    yield name, row


def extract(row: dict) -> dict:
    keep = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not k.endswith("_min")}
    return dict(keep, learned={k: row["learned"][k] for k in ("prior", "choice", "rounds",
                                                            "times_us")})


def decide(prior: str, times: dict, rows: list) -> str | None:
    """What learning decides from rounds `rows` alone of `times` (contender -> per round, us);
    None where it would learn longer (as it does after a change: the rounds after it are
    followed by as many as the class's first schedule had)."""
    return replay(prior, times, rows).committed


def replay(prior: str, times: dict, rows: list) -> Learner:
    """A Learner over rounds `rows` of `times`, past its first decision (see decide)."""
    names = (prior,) + tuple(a for a in times if a != prior)
    lr = Learner(lambda payload: payload, 1 << 20, 4, Choice(prior, "table", "", names),
                 rounds=len(rows))
    while lr.calls < len(lr.order):
        cell = lr.cell[lr.calls]
        name = lr.next()
        t = times[name][rows[cell[0]]] if cell else 1.0
        lr.record(10.0, 10.0 + (np.nan if t is None else t))
    lr.next()
    return lr


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--extract", metavar="OUT.json.gz")
    args = ap.parse_args()
    if args.extract:
        out = {}
        for name, row in classes(args.runs):
            out.setdefault(name, {"rows": []})["rows"].append(extract(row))
        with gzip.open(args.extract, "wt") as f:
            json.dump({"runs": out}, f)
        print(f"{sum(len(r['rows']) for r in out.values())} classes of {len(out)} runs "
              f"-> {args.extract}")
        return 0
    rounds, fired = Counter(), Counter()
    print("run, bytes: the change's round; choice from all rounds (its time over the fastest "
          "in the timing that followed); from the rounds after the change")
    for name, row in classes(args.runs):
        learned = row["learned"]
        times = {a: [np.nan if t is None else t for t in ts]
                 for a, ts in learned["times_us"].items()}
        n = len(next(iter(times.values())))
        rounds[n] += 1
        table = np.array([times[a] for a in times], dtype=float).T
        row_at = state_change(table)
        if row_at is None:
            continue
        fired[n] += 1
        fastest = min(times, key=lambda a: row.get(a, np.inf))
        def over(a):
            return f"{row[a] / row[fastest]:.2f}x" if a in row else "?"
        after = decide(learned["prior"], times, list(range(row_at, n)))
        print(f"{name} {row['bytes']:>9} B: round {row_at + 1} of {n}; all rounds "
              f"{learned['choice']} ({over(learned['choice'])}); after the change "
              + (f"{after} ({over(after)})" if after else "in doubt"))
    print("rounds learned: classes, fired: " + ", ".join(
        f"{n}: {rounds[n]}, {fired[n]} ({fired[n] / rounds[n]:.1%})" for n in sorted(rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
