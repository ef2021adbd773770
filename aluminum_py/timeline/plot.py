"""A Gantt picture of training steps from a merged timeline (``python -m aluminum_py timeline
plot``): per rank, a row of the user's regions (compute) above a row of the synchronizer's
bucket all-reduces (light: launched and queued; dark: running), on rank 0's clock, so the
overlap of communication with compute (or its absence) can be seen.  Without bucket events
the communicator ops are drawn instead, over the whole trace."""
from __future__ import annotations

import json

_REGION_COLORS = ("#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd", "#8c8c8c")


def parse_steps(text: str | None) -> tuple[int, int] | None:
    """'3' -> (3, 3); '2-4' -> (2, 4) (inclusive); None -> None (the last two steps)."""
    if text is None:
        return None
    try:
        a, _, b = text.partition("-")
        lo, hi = int(a), int(b or a)
    except ValueError:
        raise ValueError(f"--steps: expected N or A-B (step numbers), got {text!r}") from None
    if hi < lo:
        raise ValueError(f"--steps: {text!r} is an empty range")
    return lo, hi


def window(events: list, steps: tuple[int, int] | None):
    """(the selected steps, start, end in trace microseconds) and the bucket events in them."""
    buckets = [e for e in events if e.get("cat") == "bucket"]
    xs = [e for e in events if e.get("ph") == "X"]
    if not xs:
        raise ValueError("the timeline has no events")
    if not buckets:
        return None, min(e["ts"] for e in xs), max(e["ts"] + e["dur"] for e in xs), []
    have = sorted({e["args"]["step"] for e in buckets})
    lo, hi = (have[-2] if len(have) > 1 else have[-1], have[-1]) if steps is None else steps
    chosen = [e for e in buckets if lo <= e["args"]["step"] <= hi]
    if not chosen:
        raise ValueError(f"no bucket of steps {lo}-{hi} in the timeline (steps {have[0]} to "
                         f"{have[-1]} were recorded)")
    t0 = min(e["ts"] for e in chosen)
    t1 = max(e["ts"] + e["dur"] for e in chosen)
    # regions that overlap the buckets belong to the picture (the backward they overlap)
    for e in events:
        if e.get("cat") == "region" and e["ts"] < t1 and e["ts"] + e["dur"] > t0:
            t0, t1 = min(t0, e["ts"]), max(t1, e["ts"] + e["dur"])
    return (lo, hi), t0, t1, chosen


def lanes(spans: list) -> tuple[list[int], list[float]]:
    """Greedy lanes for `spans` (events sorted by start): each goes to the first lane whose
    last event has ended, so overlapping all-reduces are drawn side by side, not on top of each
    other. Returns each span's lane and every lane's end."""
    lane_of, ends = [], []
    for e in spans:
        k = next((i for i, end in enumerate(ends) if end <= e["ts"]), len(ends))
        if k == len(ends):
            ends.append(0.0)
        ends[k] = e["ts"] + e["dur"]
        lane_of.append(k)
    return lane_of, ends


def plot(trace: dict | str, out: str, steps: str | None = None, title: str | None = None):
    """Draw `trace` (a merged timeline or its file) into the image `out` (PNG, SVG, ... by its
    suffix). Returns the steps drawn ((first, last) or None for the whole trace)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    events = trace["traceEvents"]
    sel, t0, t1, buckets = window(events, parse_steps(steps))
    comm_row = buckets or [e for e in events if e.get("cat") == "op"
                           and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    regions = [e for e in events if e.get("cat") == "region"
               and e["ts"] < t1 and e["ts"] + e["dur"] > t0]
    ranks = sorted({e["pid"] for e in comm_row + regions})
    names = sorted({e["name"] for e in regions})
    color = {n: _REGION_COLORS[i % len(_REGION_COLORS)] for i, n in enumerate(names)}
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.9 * len(ranks)))
    ms = lambda t: (t - t0) / 1e3          # noqa: E731
    yticks, ylabels = [], []
    for i, r in enumerate(ranks):
        y = (len(ranks) - 1 - i) * 2.4
        for e in regions:
            if e["pid"] == r:
                ax.broken_barh([(ms(e["ts"]), e["dur"] / 1e3)], (y + 1.2, 0.9),
                               facecolor=color[e["name"]], edgecolor="none")
        mine = sorted((e for e in comm_row if e["pid"] == r), key=lambda e: e["ts"])
        lane_of, ends = lanes(mine)
        h = 0.9 / max(1, len(ends))
        for e, lane in zip(mine, lane_of):
            yb = y + 0.9 - (lane + 1) * h
            if buckets:
                b = e["args"]["bucket"]
                q = e["args"]["queued_us"]
                c = cmap(b % 10)
                ax.broken_barh([(ms(e["ts"]), q / 1e3)], (yb, h), facecolor=c, alpha=0.35,
                               edgecolor="none")
                ax.broken_barh([(ms(e["ts"] + q), (e["dur"] - q) / 1e3)], (yb, h),
                               facecolor=c, edgecolor="black", linewidth=0.3)
                if e["dur"] > 0.04 * (t1 - t0):
                    ax.text(ms(e["ts"] + e["dur"] / 2), yb + h / 2, f"b{b}", ha="center",
                            va="center", fontsize=6)
            else:
                ax.broken_barh([(ms(e["ts"]), e["dur"] / 1e3)], (yb, h), facecolor="#dd8452",
                               edgecolor="black", linewidth=0.3)
        yticks += [y + 0.45, y + 1.65]
        ylabels += [f"rank {r} {'buckets' if buckets else 'ops'}", f"rank {r} compute"]
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlim(0, max(ms(t1), 1e-3))
    ax.set_xlabel("ms (rank 0's clock)")
    handles = [matplotlib.patches.Patch(color=color[n], label=n) for n in names]
    if buckets:
        handles.append(matplotlib.patches.Patch(color=cmap(0), alpha=0.35,
                                                label="bucket launched, queued"))
        handles.append(matplotlib.patches.Patch(color=cmap(0), label="bucket all-reduce running"))
    if handles:
        ax.legend(handles=handles, fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0),
                  ncol=min(6, len(handles)), frameon=False)
    what = "whole trace" if sel is None else (f"step {sel[0]}" if sel[0] == sel[1]
                                              else f"steps {sel[0]}-{sel[1]}")
    ax.set_title(title or f"aluminum_py timeline: {what}", fontsize=10, pad=24 if handles else 6)
    ax.set_ylim(-0.3, len(ranks) * 2.4 - 0.2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return sel
