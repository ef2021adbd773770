"""How far each contender's calls spread above its median, from bench/peers_trace.py's traces:
per trace and size, each contender's median, 90th percentile and maximum (ms), and the ratio of
each contender's median to the first one's.  Made for the slot stores' trials (docs/performance.md,
"Trials within a call"): a trial of 3 whole calls puts calls of 3-4x the median into a
contender's samples, a trial within a call one of about 1.2x.

    python bench/trace_spread.py TRACE.jsonl [TRACE.jsonl ...] [--show shm,rabenseifner]
        [--min-bytes 2MiB]
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

from aluminum_py.bench.timing import parse_bytes


def spread(path: str, show: list[str], min_bytes: int) -> list[str]:
    """One line per size of the trace at `path`."""
    rows = [json.loads(line) for line in open(path)]
    lines = []
    for n in sorted({r["bytes"] for r in rows if r["bytes"] >= min_bytes}):
        us = {name: [r["us"] for r in rows if r["bytes"] == n and r["name"] == name]
              for name in show}
        cells, first = [], None
        for name, t in us.items():
            if not t:
                continue
            med = float(np.median(t))
            first = first or med
            cells.append(f"{name} {med / 1e3:.2f}/{np.percentile(t, 90) / 1e3:.2f}/"
                         f"{max(t) / 1e3:.1f} ({med / first:.2f})")
        lines.append(f"{os.path.basename(path)} {n >> 20:>3} MiB: " + "  ".join(cells))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--show", default="shm,rabenseifner,auto")
    ap.add_argument("--min-bytes", default="2MiB")
    args = ap.parse_args(argv)
    print("# per size, each contender: median/p90/max ms (median over the first contender's)")
    for path in args.traces:
        print("\n".join(spread(path, args.show.split(","), parse_bytes(args.min_bytes))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
