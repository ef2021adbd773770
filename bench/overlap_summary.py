"""Summarise repeated `python -m aluminum_py bench overlap --json RUN.json` runs: per model and
policy the median over runs of the measured and predicted iteration times, the prediction
errors of both models (median over policies and models), and the policies' speed-ups.

    python bench/overlap_summary.py bench/results/overlap_*_run*.json

Files that are not `bench overlap --json` results (a glob such as r*.json also matches a
`bench crossover` tuning table) are skipped, each named on stderr with the reason.
"""
import json
import sys
from collections import defaultdict

import numpy as np

from aluminum_py.bench.overlap import speedups


ROW_KEYS = ("policy", "measured", "predicted", "model")


def load_run(path):
    """(the run, None) for a `bench overlap --json` file, else (None, why it is not one): a
    glob such as r*.json also matches other files, e.g. a `bench crossover` tuning table."""
    try:
        with open(path) as f:
            run = json.load(f)
    except OSError as e:
        return None, e.strerror or str(e)
    except ValueError as e:
        return None, f"not JSON ({e})"
    if not isinstance(run, dict) or "model" not in run or not isinstance(run.get("runs"), list):
        keys = ", ".join(map(str, run)) if isinstance(run, dict) else type(run).__name__
        return None, f"not a `bench overlap --json` result (no \"model\" and \"runs\"; has {keys})"
    bad = next((r for r in run["runs"] if not isinstance(r, dict)
                or any(k not in r for k in ROW_KEYS)), None)
    if bad is not None:
        return None, f"a row of \"runs\" lacks one of {', '.join(ROW_KEYS)}: {bad!r}"[:300]
    return run, None


def main(paths):
    runs = defaultdict(lambda: defaultdict(list))          # model -> policy -> [row]
    for p in paths:
        run, why = load_run(p)
        if run is None:
            print(f"overlap_summary.py: skipping {p}: {why}", file=sys.stderr)
            continue
        for r in run["runs"]:
            runs[run["model"]][r["policy"]].append(r)
    if not runs:
        print(f"overlap_summary.py: no `bench overlap --json` results among the {len(paths)} "
              f"file(s) given", file=sys.stderr)
        return 1
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


    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
