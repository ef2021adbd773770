"""A discrete-event simulator of data-parallel training for DeFT's comparisons (section V):
one compute stream and one or two communication links, under WFBP, priority scheduling or
DeFT's plans (:func:`simulate`, whose result is a :class:`SimResult` of :class:`Span` timelines).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .model import MU_GLOO, Bucket, as_buckets, partition
from .scheduler import DelayedUpdateScheduler


@dataclass(frozen=True)
class Span:
    """One operation on a stream: ``[start, end)`` (time units of the input), a label such as
    ``"F3"``, ``"B3"`` or ``"C3"`` (bucket 3's forward, backward, all-reduce) and the iteration
    it belongs to (for an all-reduce: the newest iteration whose gradient it carries)."""

    start: float
    end: float
    label: str
    iteration: int


@dataclass
class SimResult:
    """Result of :func:`simulate`.

    Attributes:
        policy, links: as simulated.
        iteration_time: steady-state iteration time: the mean of ``iteration_times`` after the
            warm-up iterations (time units of the input).
        iteration_times: per iteration, the time from the start of its forward pass to the
            start of the next one.
        timelines: per stream (``"compute"``, ``"link0"``, ``"link1"``), its operations in
            start order.
        updates: ``(iteration, applied iterations)`` for every parameter update, at the end of
            that iteration (WFBP/priority: every iteration applies itself).
        updates_per_iteration: parameter updates per iteration over the measured iterations.
        buckets: the buckets simulated (after :func:`partition`).
    """

    policy: str
    links: int
    iteration_time: float
    iteration_times: list[float]
    timelines: dict[str, list[Span]]
    updates: list[tuple[int, tuple[int, ...]]]
    updates_per_iteration: float
    buckets: tuple[Bucket, ...]
    info: dict = field(default_factory=dict)

    def compute_idle(self, iteration: int) -> float:
        """Idle time of the compute stream during ``iteration`` (the bubbles)."""
        busy = sum(s.end - s.start for s in self.timelines["compute"] if s.iteration == iteration)
        return self.iteration_times[iteration] - busy


@dataclass
class _Task:
    kind: str                  # "compute", "mark" (compute stream, zero time), "comm"
    dur: float                 # compute time, or fast-link time for comm
    deps: list
    label: str
    iteration: int
    link: int | None = None    # comm: fixed link (in-order queue) or None (pooled)
    key: tuple = ()
    start: float = math.nan
    end: float = math.nan
    on: str = ""


def _run_des(tasks: list[_Task], compute_order: list[int], link_orders: list[list[int]],
             pooled: list[int], speeds: Sequence[float]) -> None:
    """Discrete-event simulation.  The compute stream runs ``compute_order`` in order, each task
    once its dependencies are done.  Link l runs ``link_orders[l]`` in order (fixed
    assignment) and serves the ``pooled`` tasks: whenever links are free, the ready pooled
    tasks are taken in ``key`` order, each to the link where it would finish first; a task
    whose best link is busy waits for it.  Non-preemptive.  Fills start/end/on."""
    L = len(speeds)
    ntask = len(tasks)
    missing = [len(tk.deps) for tk in tasks]          # unfinished dependencies
    dependents: list[list[int]] = [[] for _ in range(ntask)]
    for tid, tk in enumerate(tasks):
        for d in tk.deps:
            dependents[d].append(tid)
    is_pooled = [False] * ntask
    for tid in pooled:
        is_pooled[tid] = True
    released: list = []                               # ready pooled tasks, a heap by key
    for tid in pooled:
        if missing[tid] == 0:
            heapq.heappush(released, (tasks[tid].key, tid))
    time = 0.0
    heap: list = []
    seq = 0
    comp_busy = False
    comp_i = 0
    link_busy = [False] * L
    link_until = [0.0] * L
    link_i = [0] * L
    remaining = ntask

    def start(tid, on, dur):
        nonlocal seq
        tk = tasks[tid]
        tk.start, tk.end, tk.on = time, time + dur, on
        heapq.heappush(heap, (tk.end, seq, tid))
        seq += 1

    while remaining:
        progress = True
        while progress:
            progress = False
            if not comp_busy and comp_i < len(compute_order) and \
                    missing[compute_order[comp_i]] == 0:
                tid = compute_order[comp_i]
                comp_i += 1
                comp_busy = True
                start(tid, "compute", tasks[tid].dur)
                progress = True
            for l in range(L):
                if not link_busy[l] and link_i[l] < len(link_orders[l]) and \
                        missing[link_orders[l][link_i[l]]] == 0:
                    tid = link_orders[l][link_i[l]]
                    link_i[l] += 1
                    link_busy[l] = True
                    d = tasks[tid].dur / speeds[l]
                    link_until[l] = time + d
                    start(tid, f"link{l}", d)
                    progress = True
            if released and not all(link_busy):
                keep = []
                while released and not all(link_busy):
                    key, tid = heapq.heappop(released)
                    d = [tasks[tid].dur / speeds[l] for l in range(L)]
                    fin = [(link_until[l] if link_busy[l] else time) + d[l] for l in range(L)]
                    best = min(range(L), key=lambda l: (fin[l], l))
                    if link_busy[best]:
                        keep.append((key, tid))       # waits for its best link
                        continue
                    link_busy[best] = True
                    link_until[best] = time + d[best]
                    start(tid, f"link{best}", d[best])
                    progress = True
                for item in keep:
                    heapq.heappush(released, item)
        if not heap:
            stuck = [tasks[i].label for i in range(ntask) if math.isnan(tasks[i].end)][:5]
            raise RuntimeError(f"simulation deadlock (waiting: {stuck})")
        end, _, tid = heapq.heappop(heap)
        time = end
        remaining -= 1
        on = tasks[tid].on
        if on == "compute":
            comp_busy = False
        else:
            link_busy[int(on[4:])] = False
        for x in dependents[tid]:
            missing[x] -= 1
            if missing[x] == 0 and is_pooled[x]:
                heapq.heappush(released, (tasks[x].key, x))


def _auto_piece(buckets: tuple[Bucket, ...], links: int, mu: float) -> float:
    """Section III-D: no transfer longer than the smallest knapsack, min(F, B) (/ mu with the
    slow link)."""
    F = sum(b.forward for b in buckets)
    B = sum(b.backward for b in buckets)
    return min(F, B) / (mu if links == 2 else 1.0)


def simulate(buckets, schedule_policy: str = "wfbp", links: int = 1, *, iterations: int = 40,
             warmup: int = 8, mu: float = MU_GLOO, partition_time: float | str | None = "auto",
             capacity_scale: float = 1.0, resolution: float | None = None) -> SimResult:
    """Discrete-event simulation of data-parallel training: one compute stream (forward of
    buckets 0..N-1, then backward N-1..0, per iteration) and ``links`` communication streams
    (link 1, when present, takes ``mu`` times as long per transfer).  Parameter updates take
    no time.

    Policies:

    * ``"wfbp"`` (PyTorch DDP): each bucket's all-reduce is queued when its gradient exists,
      first come first served; the next iteration starts when all of them are done.
    * ``"priority"`` (ByteScheduler / P3): whenever a link is free it takes the ready transfer
      of the LOWEST bucket index (closest to the input); the next forward pass starts at once
      and the forward compute of bucket i waits only for bucket i's all-reduce, so
      communication overlaps the next forward pass.
    * ``"deft"``: :class:`DelayedUpdateScheduler`'s plans.  Forward-stage transfers start with
      the forward pass and are waited for before the backward pass; backward-stage transfers
      start with the backward pass (older gradients) or when their gradient exists, and are
      waited for at the end of the iteration, where the update (if any) happens.  Forward
      passes never wait for communication (delayed update).

    With two links, WFBP and priority send each transfer on the link where it would finish
    first; DeFT uses the links its plans assign.

    Args:
        buckets: :class:`Bucket` objects or ``(forward, backward, comm)`` tuples, forward order.
        schedule_policy: ``"wfbp"``, ``"priority"`` or ``"deft"``.
        links: 1 or 2.
        iterations: iterations simulated; ``warmup``: the first ones left out of the mean.
        mu: slow-link time ratio (1.65).
        partition_time: largest transfer time (pieces, :func:`partition`); ``None``: no
            partition; ``"auto"``: none for WFBP, for priority and DeFT the smallest DeFT
            knapsack (``min(F, B)``, divided by mu with two links; section III-D).
        capacity_scale, resolution: passed to :class:`DelayedUpdateScheduler`.

    Returns:
        :class:`SimResult`.
    """
    bk = as_buckets(buckets)
    if schedule_policy not in ("wfbp", "priority", "deft"):
        raise ValueError(f"schedule_policy must be 'wfbp', 'priority' or 'deft', "
                         f"got {schedule_policy!r}")
    if links not in (1, 2):
        raise ValueError(f"links must be 1 or 2, got {links!r}")
    if not (iterations >= 1 and 0 <= warmup < iterations):
        raise ValueError("need iterations >= 1 and 0 <= warmup < iterations")
    if partition_time == "auto":
        partition_time = None if schedule_policy == "wfbp" else _auto_piece(bk, links, mu)
    if partition_time is not None:
        bk = partition(bk, partition_time)
    n = len(bk)
    speeds = (1.0,) if links == 1 else (1.0, 1.0 / mu)
    tasks: list[_Task] = []
    compute_order: list[int] = []
    link_orders: list[list[int]] = [[] for _ in range(links)]
    pooled: list[int] = []
    starts: list[int] = []
    updates: list[tuple[int, tuple[int, ...]]] = []
    sched = None
    if schedule_policy == "deft":
        sched = DelayedUpdateScheduler([b.comm for b in bk], [b.forward for b in bk],
                                       [b.backward for b in bk], links=links, mu=mu,
                                       capacity_scale=capacity_scale, resolution=resolution)

    def add(t: _Task) -> int:
        tasks.append(t)
        return len(tasks) - 1

    prev_comm: list[int] = []            # all-reduces of the previous iteration, per bucket
    prev_end: list[int] = []             # what the next iteration's start waits for (deft)
    T = iterations + 1                   # one more, to time the last measured iteration
    for t in range(T):
        if schedule_policy == "wfbp":
            st = add(_Task("mark", 0.0, list(prev_comm), f"start{t}", t))
        elif schedule_policy == "deft":
            st = add(_Task("mark", 0.0, list(prev_end), f"start{t}", t))
        else:
            st = add(_Task("mark", 0.0, [], f"start{t}", t))
        compute_order.append(st)
        fwd_x: list[int] = []
        plan = sched.plan(t) if sched is not None else None
        if plan is not None:
            for x in plan.forward:
                tid = add(_Task("comm", bk[x.bucket].comm, [st], f"C{x.bucket}",
                                max(x.iterations), link=x.link))
                link_orders[x.link].append(tid)
                fwd_x.append(tid)
        for i in range(n):
            deps = [prev_comm[i]] if schedule_policy == "priority" and prev_comm else []
            compute_order.append(add(_Task("compute", bk[i].forward, deps, f"F{i}", t)))
            if i == 0:
                starts.append(compute_order[-1])     # the iteration starts with F0
        bw = add(_Task("mark", 0.0, fwd_x, f"backward{t}", t))
        compute_order.append(bw)
        bwd: dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            bwd[i] = add(_Task("compute", bk[i].backward, [], f"B{i}", t))
            compute_order.append(bwd[i])
        comm_now: list[int] = [0] * n
        if plan is None:
            for pos, i in enumerate(range(n - 1, -1, -1)):
                key = (t, pos) if schedule_policy == "wfbp" else (t, i)
                comm_now[i] = add(_Task("comm", bk[i].comm, [bwd[i]], f"C{i}", t, key=key))
                pooled.append(comm_now[i])
            prev_comm = comm_now
            updates.append((t, (t,)))
        else:
            back_x = []
            for x in plan.backward:
                dep = bwd[x.bucket] if t in x.iterations else bw
                tid = add(_Task("comm", bk[x.bucket].comm, [dep], f"C{x.bucket}",
                                max(x.iterations), link=x.link))
                link_orders[x.link].append(tid)
                back_x.append(tid)
            prev_end = back_x
            if plan.update:
                updates.append((t, plan.applied_iterations[0]))
    _run_des(tasks, compute_order, link_orders, pooled, speeds)
    t0 = [tasks[s].start for s in starts]
    times = [t0[k + 1] - t0[k] for k in range(iterations)]
    timelines: dict[str, list[Span]] = {"compute": []}
    for l in range(links):
        timelines[f"link{l}"] = []
    for tk in tasks:
        if tk.kind != "mark" and tk.iteration < iterations:
            timelines[tk.on].append(Span(tk.start, tk.end, tk.label, tk.iteration))
    for v in timelines.values():
        v.sort(key=lambda s: (s.start, s.end))
    measured = times[warmup:]
    nupd = sum(1 for t, _ in updates if warmup <= t < iterations)
    return SimResult(schedule_policy, links, float(np.mean(measured)), times, timelines,
                     [u for u in updates if u[0] < iterations], nupd / len(measured), bk,
                     {"partition_time": partition_time, "mu": mu,
                      "capacity_scale": capacity_scale})

