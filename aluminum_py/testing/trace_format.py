"""A checker of the Trace Event Format (the JSON that Chrome's about:tracing and Perfetto open),
written from its specification, independent of aluminum_py.timeline: the tests check the
timeline's files with it."""
from __future__ import annotations

# the phases the specification defines (Duration B/E, Complete X, Instant i/I, Counter C,
# Async b/n/e and S/T/p/F, Flow s/t/f, Sample P, Object N/O/D, Metadata M, Memory dump V/v,
# Mark R, Clock sync c, Context (/)), and the metadata event names
PHASES = set("BEXiICbneSTpFstfPNODMVvRc()")
METADATA = {"process_name", "process_labels", "process_sort_index", "thread_name",
            "thread_sort_index"}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def problems(trace) -> list[str]:
    """What is wrong with `trace` (the parsed JSON), [] if nothing: the object form has a
    ``traceEvents`` list; every event has ``ph``, ``ts``, ``pid`` and ``tid``; complete events
    have a ``name`` and a ``dur`` >= 0; metadata events have a known name and ``args``; and the
    complete events of one thread nest (none ends inside another it started after)."""
    out = []
    if isinstance(trace, dict):
        events = trace.get("traceEvents")
        if not isinstance(events, list):
            return ["the object form needs a traceEvents list"]
        if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
            out.append(f"displayTimeUnit {trace['displayTimeUnit']!r} is not ms or ns")
    elif isinstance(trace, list):
        events = trace
    else:
        return [f"a trace is a JSON object or array, not {type(trace).__name__}"]
    threads: dict = {}
    for i, e in enumerate(events):
        where = f"event {i} ({e.get('name') if isinstance(e, dict) else e!r})"
        if not isinstance(e, dict):
            out.append(f"{where}: not an object")
            continue
        missing = [k for k in ("ph", "ts", "pid", "tid") if k not in e]
        if missing:
            out.append(f"{where}: missing {', '.join(missing)}")
            continue
        if e["ph"] not in PHASES:
            out.append(f"{where}: unknown phase {e['ph']!r}")
        if not _number(e["ts"]):
            out.append(f"{where}: ts {e['ts']!r} is not a number")
        if e["ph"] == "X":
            if not isinstance(e.get("name"), str):
                out.append(f"{where}: a complete event needs a name")
            if not _number(e.get("dur")) or e["dur"] < 0:
                out.append(f"{where}: a complete event needs dur >= 0, has {e.get('dur')!r}")
            else:
                threads.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"],
                                                                     where))
        if e["ph"] == "M":
            if e.get("name") not in METADATA:
                out.append(f"{where}: unknown metadata event")
            if not isinstance(e.get("args"), dict):
                out.append(f"{where}: a metadata event needs args")
    for key, spans in threads.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list = []
        for s in spans:
            while stack and stack[-1][1] <= s[0] + 1e-3:      # ended (to the rounding)
                stack.pop()
            if stack and s[1] > stack[-1][1] + 1e-3:     # 1 ns: the times' rounding
                out.append(f"thread {key}: {s[2]} [{s[0]}, {s[1]}] overlaps {stack[-1][2]} "
                           f"[{stack[-1][0]}, {stack[-1][1]}] without nesting")
            stack.append(s)
    return out
