"""Replay what learning recorded in ``bench/peers.py --json`` runs (or an extract of them, see
bench/state_change_replay.py) to ask how a tie should be broken: where learning's contest was
still in doubt at its longest schedule it keeps the prior (the tuning table's choice, or the
model's).  Would the contender with the better worst case over the rounds have done better in
the timing that followed in the same run?  Issue 31 asked for that rule in the crossover
("where two candidates are within noise, the one with the better worst case").

    python bench/learning_tie_break.py bench/results/issue31_learned_rounds.json.gz [RUN.json ...]

Each class is replayed at the rounds it recorded, as its longest schedule (MORE_ROUNDS 1), by
the library's own rule, without the change-of-state rule (CHANGE_P 0); the ties are the
classes whose result has ``in_doubt``.  For each way of breaking them (a statistic of each
contender's rounds, the lowest chosen, among the prior and the contenders in doubt), the
choice's median in the timing over the fastest median of learning's contenders there: how
many are over 1.10x, the geometric mean, the worst.
"""
from __future__ import annotations

import sys

import numpy as np

from aluminum_py import learning
from state_change_replay import classes, replay

WAYS = {"the prior (the library's rule)": None,
        "lowest median": lambda v: np.nanmedian(v),
        "lowest mean": lambda v: np.nanmean(v),
        "lowest 75th percentile": lambda v: np.nanpercentile(v, 75),
        "lowest 90th percentile": lambda v: np.nanpercentile(v, 90),
        "lowest maximum": lambda v: np.nanmax(v)}

HINDSIGHT = "(the tied one fastest in the timing)"   # known only afterwards: the floor


def main(paths) -> int:
    learning.MORE_ROUNDS = 1                    # the recorded rounds are the longest schedule
    learning.CHANGE_P = 0.0                     # and all of them decided on (a change of state:
                                                # bench/state_change_replay.py)
    over = {w: [] for w in [*WAYS, HINDSIGHT]}
    n = agree = 0
    for _, row in classes(paths):
        lr = row["learned"]
        times = {a: np.array([np.nan if t is None else t for t in ts], dtype=float)
                 for a, ts in lr["times_us"].items()}
        r = replay(lr["prior"], times, list(range(len(next(iter(times.values())))))).result
        n += 1
        agree += r["choice"] == lr["choice"]
        if not r["in_doubt"] or not all(a in row for a in times):
            continue
        fastest = min(row[a] for a in times)
        tied = [r["choice"], *r["in_doubt"]]
        for way, stat in WAYS.items():
            pick = r["choice"] if stat is None else min(tied, key=lambda a: stat(times[a]))
            over[way].append(row[pick] / fastest)
        over[HINDSIGHT].append(min(row[a] for a in tied) / fastest)
    print(f"{n} classes replayed, {agree} to the choice they recorded; "
          f"{len(over[HINDSIGHT])} ties (in doubt at the longest schedule)")
    print("a tie broken by: classes whose choice was over 1.10x the fastest of learning's "
          "contenders in the timing; geometric mean; worst")
    for way, ratios in over.items():
        x = np.array(ratios)
        print(f"  {way:40s} {int(np.sum(x > 1.10)):3d}  {np.exp(np.mean(np.log(x))):.3f}x  "
              f"{x.max():.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
