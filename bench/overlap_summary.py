"""Summarise repeated `python -m aluminum_py bench overlap --json RUN.json` runs: per model and
policy the median over runs of the measured and predicted iteration times, the prediction
errors of both models (median over policies and models), and the policies' speed-ups.

    python bench/overlap_summary.py bench/results/overlap_*_run*.json
"""
import json
import sys
from collections import defaultdict

import numpy as np

from aluminum_py.bench.overlap import speedups


def main(paths):
    runs = defaultdict(lambda: defaultdict(list))          # model -> policy -> [row]
    for p in paths:
        with open(p) as f:
            run = json.load(f)
        for r in run["runs"]:
            runs[run["model"]][r["policy"]].append(r)
    errs = []
    for model, pol in runs.items():
        nrun = len(next(iter(pol.values())))
        print(f"## {model}: median over {nrun} runs")
        print(f"{'policy':<16} {'measured ms':>12} {'model ms':>9} {'error':>7}  model")
        med = {}
        for name, rows in pol.items():
            meas = float(np.median([r["measured"] for r in rows]))
            pred = float(np.median([r["predicted"] for r in rows]))
            med[name] = meas
            e = (pred - meas) / meas
            if rows[0]["model"] == "OSF":
                errs.append(abs(e))
            print(f"{name:<16} {meas * 1e3:>12.2f} {pred * 1e3:>9.2f} {e * 100:>6.1f}%  "
                  f"{rows[0]['model']}")
        for line in speedups(med, ("adafusion", "adafusion-ca", "osf", "libra", "deft", "auto")):
            print(line)
    if errs:
        print(f"# OSF prediction error: median {np.median(errs) * 100:.1f}%, "
              f"max {max(errs) * 100:.1f}% over {len(errs)} (model, policy) pairs")


if __name__ == "__main__":
    main(sys.argv[1:])
