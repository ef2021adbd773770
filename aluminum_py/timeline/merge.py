"""Merge the ranks' timeline files onto rank 0's clock (``python -m aluminum_py timeline merge``).

Each file carries its rank's clock offset (``otherData.clock``, :mod:`.clock`): rank 0's clock
is the rank's plus ``offset_us``.  An offset measured to another reference rank is chained
through that rank's own offset.  The merged trace starts at 0 (``otherData.origin_us``: the
rank-0 clock time of that 0) and keeps every rank's events under ``pid`` = its rank.
"""
from __future__ import annotations

import json


def load(path: str) -> dict:
    """A rank's timeline file, checked to be one."""
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a complete timeline file ({e}); was the program "
                             "stopped before the timeline was written?") from None
    if not isinstance(d, dict) or "aluminum_py_timeline" not in d.get("otherData", {}):
        raise ValueError(f"{path}: not an aluminum_py timeline file (no otherData)")
    return d


def offsets(metas: dict[int, dict]) -> dict[int, tuple[float | None, float | None]]:
    """rank -> (offset to world rank 0's clock, uncertainty), microseconds; (None, None) when
    no chain of measured offsets reaches rank 0."""
    out = {}
    for rank, meta in metas.items():
        off, unc, seen, r = 0.0, 0.0, set(), rank
        while r != 0:
            c = metas.get(r, {}).get("clock")
            if c is None or r in seen:
                off = unc = None
                break
            seen.add(r)
            off += c["offset_us"]
            unc += c["uncertainty_us"]
            r = c["reference"]
        out[rank] = (off, unc)
    return out


def merge(paths, out: str | None = None) -> tuple[dict, list[str]]:
    """Merge the files `paths` (one per rank); write `out` if given. Returns the merged trace
    and one report line per rank (offset, uncertainty, events, dropped events)."""
    traces = [load(p) for p in paths]
    metas = {}
    for p, t in zip(paths, traces):
        r = t["otherData"]["rank"]
        if r in metas:
            raise ValueError(f"{p}: rank {r} appears twice")
        metas[r] = t["otherData"]
    offs = offsets(metas)
    shifted = []
    for t in traces:
        r = t["otherData"]["rank"]
        off = offs[r][0] or 0.0
        for e in t["traceEvents"]:
            if e.get("ph") != "M":
                e = dict(e, ts=round(e["ts"] + off, 3))
            shifted.append(e)
    timed = [e["ts"] for e in shifted if e.get("ph") != "M"]
    origin = min(timed) if timed else 0.0
    for e in shifted:
        if e.get("ph") != "M":
            e["ts"] = round(e["ts"] - origin, 3)
    report, ranks = [], {}
    for r in sorted(metas):
        off, unc = offs[r]
        m = metas[r]
        ranks[str(r)] = {"offset_us": off, "uncertainty_us": unc, "events": m["events"],
                         "dropped_events": m["dropped_events"],
                         "unfinished_ops": m["unfinished_ops"]}
        clock = ("offset unknown (no clock sync reached rank 0; shown unshifted)" if off is None
                 else f"offset {off:+.1f} us +- {unc:.1f} us")
        report.append(f"rank {r}: {clock}, {m['events']} events, "
                      f"{m['dropped_events']} dropped")
    for r in sorted(metas):
        off, unc = offs[r]
        label = "" if off is None else f"clock {off:+.1f} us +- {unc:.1f}"
        shifted.append({"ph": "M", "name": "process_labels", "pid": r, "tid": 0, "ts": 0,
                        "args": {"labels": label or "clock offset unknown"}})
    merged = {"displayTimeUnit": "ms", "traceEvents": shifted,
              "otherData": {"aluminum_py_timeline_merged": 1, "origin_us": origin, "ranks": ranks}}
    if out is not None:
        with open(out, "w") as f:
            json.dump(merged, f, separators=(",", ":"))
    return merged, report
