"""A Gantt picture of training steps from a merged timeline (``python -m aluminum_py timeline
plot``): per rank, a row of the user's regions (compute) above a row of the synchronizer's
bucket all-reduces (light: launched and queued; dark: running), on rank 0's clock, so the
overlap of communication with compute (or its absence) can be seen.  Without bucket events
the communicator ops are drawn instead, over the whole trace, coloured and labelled by kind and
algorithm.  Every colour drawn has its legend entry."""
from __future__ import annotations

import json

_REGION_COLORS = ("#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd", "#8c8c8c")
# buckets and ops: matplotlib's tab10, those least like the region colours first
_COMM_COLORS = ("#ff7f0e", "#d62728", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#2ca02c",
                "#9467bd", "#1f77b4", "#7f7f7f")


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


def op_label(e: dict) -> str:
    """An op event's kind and algorithm: 'Allreduce/ring' -> 'Allreduce ring'."""
    return e["name"].replace("/", " ")


def legend_handles(names: list, color: dict, buckets: list, ops: list) -> list:
    """(handle, label) pairs naming every colour drawn: the regions; per bucket colour its
    buckets, with the light (queued) and dark (running) shade side by side; per op kind and
    algorithm its colour."""
    from matplotlib.patches import Patch
    out = [(Patch(color=color[n]), n) for n in names]
    if buckets:
        by_color = {}
        for b in sorted({e["args"]["bucket"] for e in buckets}):
            by_color.setdefault(b % len(_COMM_COLORS), []).append(f"b{b}")
        for k, bs in sorted(by_color.items()):
            c = _COMM_COLORS[k]
            out.append(((Patch(facecolor=c, alpha=0.35), Patch(facecolor=c, edgecolor="black",
                                                                linewidth=0.3)),
                        f"{', '.join(bs)}: queued | running"))
    else:
        out += [(Patch(facecolor=_COMM_COLORS[i % len(_COMM_COLORS)], edgecolor="black",
                       linewidth=0.3), n) for i, n in enumerate(ops)]
    return out


def plot(trace: dict | str, out: str, steps: str | None = None, title: str | None = None):
    """Draw `trace` (a merged timeline or its file) into the image `out` (PNG, SVG, ... by its
    suffix). Returns the steps drawn ((first, last) or None for the whole trace)."""
    fig, sel = figure(trace, steps, title)
    import matplotlib.pyplot as plt
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return sel


def figure(trace: dict | str, steps: str | None = None, title: str | None = None):
    """The matplotlib figure :func:`plot` saves, and the steps drawn."""
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
    ops = [] if buckets else sorted({op_label(e) for e in comm_row})
    op_color = {n: _COMM_COLORS[i % len(_COMM_COLORS)] for i, n in enumerate(ops)}
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
                c = _COMM_COLORS[b % len(_COMM_COLORS)]
                ax.broken_barh([(ms(e["ts"]), q / 1e3)], (yb, h), facecolor=c, alpha=0.35,
                               edgecolor="none")
                ax.broken_barh([(ms(e["ts"] + q), (e["dur"] - q) / 1e3)], (yb, h),
                               facecolor=c, edgecolor="black", linewidth=0.3)
                text = f"b{b}"
            else:
                ax.broken_barh([(ms(e["ts"]), e["dur"] / 1e3)], (yb, h),
                               facecolor=op_color[op_label(e)], edgecolor="black", linewidth=0.3)
                text = op_label(e)
            if e["dur"] > 0.04 * (t1 - t0):
                ax.text(ms(e["ts"] + e["dur"] / 2), yb + h / 2, text, ha="center",
                        va="center", fontsize=6, clip_on=True)
        yticks += [y + 0.45, y + 1.65]
        ylabels += [f"rank {r} {'buckets' if buckets else 'ops'}", f"rank {r} compute"]
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlim(0, max(ms(t1), 1e-3))
    ax.set_xlabel("ms (rank 0's clock)")
    handles = legend_handles(names, color, buckets, ops)
    if handles:
        from matplotlib.legend_handler import HandlerTuple
        ax.legend([h for h, _ in handles], [label for _, label in handles], fontsize=7,
                  loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=min(5, len(handles)),
                  frameon=False, handler_map={tuple: HandlerTuple(ndivide=None, pad=0)})
    what = "whole trace" if sel is None else (f"step {sel[0]}" if sel[0] == sel[1]
                                              else f"steps {sel[0]}-{sel[1]}")
    rows = -(-len(handles) // 5)                       # the legend's rows, above the axes
    ax.set_title(title or f"aluminum_py timeline: {what}", fontsize=10, pad=6 + 13 * rows)
    ax.set_ylim(-0.3, len(ranks) * 2.4 - 0.2)
    fig.tight_layout()
    return fig, sel
