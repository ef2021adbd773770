"""Summarise ``bench/peers.py --json`` runs, one line per run: ``auto`` over the fastest
contender (the worst size, and at how many sizes it is within 1.10x and 1.25x: issue 31's
targets), the same paired by iteration where the run has ``auto_paired`` (per contender,
the median over iterations of ``auto``'s time over the contender's in the same iteration),
``auto`` against the algorithm it ran at each size (timed as a contender of its
own in the same run: the benchmark's own noise for two identical calls; its worst and at how
many sizes it is over 1.10x), ``shm`` against DeepSpeed's op and against Rabenseifner (1-64 MiB) where the run has
them, and ``shm`` at the largest size against the run's memory bound; and the sizes where
learning saw the machine change state (``learned``'s ``state_change``), and the shifts it
let go as blips (``learned``'s ``shifts`` not taken: their round and how long they lasted).

    python bench/peers_summary.py RUN.json [RUN.json ...]
"""
from __future__ import annotations

import json
import os
import sys

NOT_CONTENDERS = {"bytes", "iterations", "algorithm", "wrong", "learn_calls", "learn_us",
                  "auto_paired", "learned", "page_offsets"}


def paired_worst(rows: list) -> list:
    """Per row (size) that has ``auto_paired``: (the largest of its paired ratios, bytes, the
    contender it is against)."""
    return [max((v, r["bytes"], k) for k, v in r["auto_paired"].items())
            for r in rows if r.get("auto_paired")]


def summary(run: dict) -> str:
    rows = run["rows"]
    keys = [k for k in rows[0] if k not in NOT_CONTENDERS and not k.endswith("_min")]
    parts = []
    if "auto" in keys:
        over = [(r["auto"] / min(r[k] for k in keys), r["bytes"], min(keys, key=r.get))
                for r in rows]
        worst = max(over)
        parts.append(f"auto/fastest worst {worst[0]:.2f}x at {worst[1]} B ({worst[2]}), "
                     f"<=1.10x at {sum(o[0] <= 1.10 for o in over)}/{len(over)}, "
                     f"<=1.25x at {sum(o[0] <= 1.25 for o in over)}/{len(over)}")
        paired = paired_worst(rows)
        if paired:
            worst = max(paired)
            parts.append(f"paired worst {worst[0]:.2f}x at {worst[1]} B ({worst[2]}), "
                         f"<=1.10x at {sum(p[0] <= 1.10 for p in paired)}/{len(paired)}, "
                         f"<=1.25x at {sum(p[0] <= 1.25 for p in paired)}/{len(paired)}")
        same = [(r["auto"] / r[r["algorithm"]], r["bytes"], r["algorithm"]) for r in rows
                if r.get("algorithm") in keys]
        if same:
            worst = max(same)
            parts.append(f"auto/its own algorithm worst {worst[0]:.2f}x at {worst[1]} B "
                         f"({worst[2]}), >1.10x at {sum(o[0] > 1.10 for o in same)}/{len(same)}")
    if "shm" in keys and "deepspeed_shm" in keys:
        ds = min((r["deepspeed_shm"] / r["shm"], r["bytes"]) for r in rows)
        parts.append(f"shm vs DeepSpeed worst {ds[0]:.2f}x at {ds[1]} B")
    if "shm" in keys and "rabenseifner" in keys:
        rb = min((r["rabenseifner"] / r["shm"], r["bytes"]) for r in rows if r["bytes"] >= 1 << 20)
        parts.append(f"shm vs rabenseifner (1-64 MiB) worst {rb[0]:.2f}x at {rb[1]} B")
    if "shm" in keys:
        big = rows[-1]
        parts.append(f"{big['bytes']} B shm {big['shm']:.0f} us, bound {run['bound_us']:.0f} us "
                     f"({big['shm'] / run['bound_us']:.2f}x)")
    changed = [f"{r['bytes']} B from round {r['learned']['state_change']}" for r in rows
               if (r.get("learned") or {}).get("state_change")]
    if changed:
        parts.append("learning saw a change of state at " + ", ".join(changed))
    blips = [f"{r['bytes']} B round {x['round']} ({x['seconds'] * 1e3:.0f} ms)" for r in rows
             for x in (r.get("learned") or {}).get("shifts", []) if not x["taken"]]
    if blips:
        parts.append("shifts let go (under CHANGE_SECONDS) at " + ", ".join(blips))
    return "; ".join(parts)


def main(paths) -> int:
    for path in paths:
        with open(path) as f:
            print(f"{os.path.basename(path)}: {summary(json.load(f))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
