"""``python -m aluminum_py timeline merge rank*.json -o all.json`` and
``python -m aluminum_py timeline plot all.json -o step.png [--steps A-B]`` (docs/timeline.md)."""
from __future__ import annotations

import argparse
import sys


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m aluminum_py timeline",
                                 description="Merge and plot aluminum_py timelines.")
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="put the ranks' files on rank 0's clock, in one trace")
    m.add_argument("files", nargs="+", help="the ranks' files (AL_TIMELINE / timeline.start)")
    m.add_argument("-o", "--output", required=True)
    p = sub.add_parser("plot", help="a Gantt picture of training steps (compute vs buckets)")
    p.add_argument("trace", help="a merged trace (timeline merge) or one rank's file")
    p.add_argument("-o", "--output", required=True, help="image file (.png, .svg, ...)")
    p.add_argument("--steps", default=None,
                   help="synchronizer steps to draw: N or A-B (default: the last two)")
    p.add_argument("--title", default=None)
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "merge":
            from .merge import merge
            _, report = merge(args.files, args.output)
            for line in report:
                print(line)
            print(f"wrote {args.output}")
        else:
            from .plot import plot
            plot(args.trace, args.output, args.steps, args.title)
            print(f"wrote {args.output}")
    except (OSError, ValueError) as e:
        print(f"python -m aluminum_py timeline {args.command}: {e}", file=sys.stderr)
        return 1
    return 0
