"""DeFT: knapsack communication scheduling with delayed updates (Meng & Sun,
``shared/papers/deft-communication-scheduling.txt``, sections III-IV, Algorithms 1-2).

Buckets and time
----------------
A model is a list of gradient buckets in FORWARD order: bucket 0 is the paper's bucket #1, next
to the input, computed first in the forward pass and LAST in the backward pass; bucket N-1 is the
paper's bucket #N, whose gradient exists first.  Each :class:`Bucket` has its forward compute
time, backward compute time and all-reduce time on the fast link.  Every function here works in
one time unit of your choice; :data:`TABLE_II` is in microseconds, so its results are too.

The gradient of bucket ``i`` exists once the backward compute of buckets ``N-1 .. i`` is done.
The *window* of bucket ``i`` is the backward compute left after that: ``sum(backward[:i])``;
bucket 0's window is 0 (the paper's "hard dependency": its all-reduce can never overlap the
backward pass of its own iteration).

What is here
------------
* :func:`knapsack` -- exact 0/1 knapsack on discretised times (Problem 1).
* :func:`recursive_knapsack` -- Algorithm 1: the backward-stage knapsack in which every item can
  only start once its gradient exists (capacities nested along the backward order).
* :func:`multi_link_greedy` -- the greedy for two (or more) links of Problem 2 (section III-C).
* :class:`DelayedUpdateScheduler` -- the four-case delayed-update state machine (section III-B,
  Fig. 4): :meth:`~DelayedUpdateScheduler.plan` gives each iteration's :class:`Schedule`.
* :func:`preserver_ok` (with :func:`expected_next_loss`, :func:`preserver_ratio`) -- the
  Preserver's convergence check (section IV-C); :func:`tune_capacity` -- its feedback loop.
* :func:`simulate` -- a discrete-event simulator with one compute stream and one or two
  communication streams, for the policies ``"wfbp"``, ``"priority"`` and ``"deft"``.
* :func:`partition` -- the tensor partition of section III-D.

Where the paper disagrees with itself (and what this module follows)
--------------------------------------------------------------------
1. Algorithm 2 versus the text and Fig. 4 (DESIGN.md: follow the text).  Alg. 2's Case 3 branch
   (lines 26-32) empties ``CurrentTaskList`` after ``order2``, so the new buckets that
   ``RecursiveKnapsack`` did not pick are lost; the text copies them into the current task queue.
   Alg. 2's Case 4 branch (lines 17-22) neither merges the future task queue into the new
   buckets nor updates the parameters, and since ``CurrentTaskList`` is then non-empty line 45
   also adds the whole gradient to ``FutureTaskList``, so the unpicked buckets would be sent
   twice; the text merges (Fig. 4, iteration 5), keeps each bucket once, and "performs a
   parameter update at the end of this iteration" with the group completed during the forward
   pass.  Alg. 2 also never
   merges the future queue in Case 3; the text does ("stored (or merged) into the future task
   queue").  This module follows the text; :class:`DelayedUpdateScheduler` states the rules.
2. Algorithm 1 as printed always returns ``NaiveKnapsack(CommTimeList, remainTime)``: ``order2``
   solves the same problem with one item and some capacity fewer, so ``sum(order1) >=
   sum(order2)``; and the naive knapsack ignores that an item can only start once its gradient
   exists, so its choice may not fit the backward pass.  :func:`recursive_knapsack` solves what
   the recursion is built for -- each suffix of the backward order must fit into the compute
   left after its first item is ready (remainTime shrinking by T_{N-1}, T_{N-2}, ... as items
   are peeled off) -- exactly, by dynamic programming; its choice always fits.
3. Problem 2 writes the second knapsack's capacity as ``mu * sum(t_j)``; section III-C says the
   NCCL knapsack is mu times the gloo one and III-D calls "the forward time divided by mu" the
   smallest capacity.  Item weights are fast-link (NCCL) times, so the slow link's capacity is
   ``sum(t_j) / mu``; this module follows III-C/III-D (a slow-link transfer takes ``mu`` times
   its weight).
4. The Preserver's expectation (section IV-C, eq. 1) has ``(s_t - S* - eta Delta s_t)`` in its
   first term; ``Delta s_t`` is the random step, the expectation needs its mean ``mu_t`` (the
   reflected Gaussian of Yin et al., ref. [25], and the definition of ``a`` in the same
   equation).  :func:`expected_next_loss` uses ``mu_t``.
5. Table II's header says "ms" but the entries are microseconds (forward total 37166 = Table I's
   37 ms); its communication column sums to 247725, not the printed 257725 (see
   :data:`TABLE_II`).

Simulated iteration times on Table II
-------------------------------------
``python -m aluminum_py.planning.deft`` prints this table (:func:`table_ii_report`: steady
state, mean over iterations 8-199 of 200; microseconds).  Priority scheduling and DeFT use the
partition DeFT needs (section III-D): with one link bucket #4 (178643 us) is cut into 5 pieces of
at most the forward time (37166 us), with two links every bucket above forward/mu = 22525 us is
cut (#4 into 8, #5 into 2); "priority-unsplit" is priority scheduling on the buckets as they are.
On two links WFBP and priority scheduling send each transfer on the link where it would finish
first (the paper's baselines use one link; the two-link rows are this model's extension).

================  =====  ==============  ================  =================
policy            links  iteration (us)  speed-up vs WFBP  updates/iteration
================  =====  ==============  ================  =================
wfbp              1      285053          1.00              1.00
priority          1      248316          1.15              1.00
priority-unsplit  1      253299          1.13              1.00
deft              1      130285          2.19              0.50
wfbp              2      256376          1.00              1.00
priority          2      165984.5        1.54              1.00
priority-unsplit  2      216493          1.18              1.00
deft              2      130285          1.97              0.80
================  =====  ==============  ================  =================

WFBP on one link is the hand-computable 37166 (forward) + 247887 (the link starts 162 us into
the backward pass, when #6's gradient exists, and never idles: 162 + 247725).  DeFT hides all
communication: its iteration is the compute time, 37166 + 93119 = 130285 us, on one link and
on two; what the second link buys is update frequency (0.50 -> 0.80 updates per iteration, close
to the 1/CR of section III-B: CR = 247725 / 130285 = 1.90 on one link, about 1.18 on two with
the slow link's 1/1.65 share), which is what the Preserver checks.

Compared with the paper: it reports (VGG-19, 16 A100s, Fig. 10b and section V-B) DeFT 90%-115%
faster than PyTorch DDP, ByteScheduler and US-Byte, whose runs use one link.  Against the
one-link baselines the model gives +119% over WFBP (2.19x) and +91% over priority scheduling
(1.91x; +94% unsplit) -- the same range.  The paper's figures are time-to-solution with its
Preserver active, so they include the extra capacity that check may add; the model's are the
compute-bound limit with ``capacity_scale = 1``.  Table I's 258 ms and coverage rate 1.98 for
VGG-19 agree with the printed total 257725; with the column's 247725 us the rate is 1.90.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

__all__ = [
    "Bucket", "TABLE_II", "TABLE_II_PRINTED_TOTAL", "partition",
    "Selection", "MultiSelection", "knapsack", "recursive_knapsack", "multi_link_greedy",
    "windows_from_compute",
    "Transfer", "Schedule", "DelayedUpdateScheduler",
    "expected_next_loss", "preserver_ratio", "preserver_ok", "tune_capacity",
    "Span", "SimResult", "simulate", "table_ii_report",
]

MU_GLOO = 1.65          # NCCL is 1.59-1.69x faster than gloo; the paper uses 1.65 (section III-C)
_MAX_STEPS = 1 << 20    # largest knapsack grid used without being asked (columns)
_AUTO_STEPS = 1 << 16   # grid size when the times are not integers
_EPS = 1e-9


# ----------------------------------------------------------------------------- buckets, Table II
@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: forward and backward compute time and all-reduce time on the fast link
    (one time unit throughout; microseconds for :data:`TABLE_II`)."""

    forward: float
    backward: float
    comm: float
    name: str = ""

    def __post_init__(self):
        for k in ("forward", "backward", "comm"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(v)
                    and v >= 0):
                raise ValueError(f"Bucket.{k} must be a finite non-negative time, got {v!r}")


# DeFT Table II: VGG-19 buckets, forward order (#1 is next to the input), exactly as printed.  The
# header says (ms) but the values are microseconds: the forward total 37166 is Table I's 37 ms.
# The printed "total" row reads 37166 / 93119 / 257725; the communication column sums to 247725
# (a misprint of the total, DESIGN.md).  Table I's 258 ms for VGG-19 agrees with the misprinted
# total, so one entry could be the misprint instead; we keep the entries as printed.
TABLE_II: tuple[Bucket, ...] = (
    Bucket(1238, 72496, 1968, "#1"),
    Bucket(28799, 12786, 11262, "#2"),
    Bucket(4801, 4872, 15447, "#3"),
    Bucket(1899, 2319, 178643, "#4"),
    Bucket(326, 484, 31754, "#5"),
    Bucket(103, 162, 8651, "#6"),
)
TABLE_II_PRINTED_TOTAL = (37166, 93119, 257725)    # as printed; the last should be 247725


def _as_buckets(buckets) -> tuple[Bucket, ...]:
    out = []
    for b in buckets:
        out.append(b if isinstance(b, Bucket) else Bucket(*b))
    if not out:
        raise ValueError("buckets: at least one bucket is needed")
    return tuple(out)


def partition(buckets, max_comm: float) -> tuple[Bucket, ...]:
    """Cut every bucket whose all-reduce takes longer than ``max_comm`` into ``ceil(comm /
    max_comm)`` pieces of (nearly) equal time (section III-D).  Integer times stay integers.

    The pieces keep the bucket's place in the forward order.  The bucket's forward and backward
    compute go to its last piece in forward order (the first one in backward order), so all
    pieces' gradients exist at the same moment and the bucket's forward compute waits for all
    its pieces, as for the unpartitioned bucket.  Piece names are ``name + "a"``, ``"b"``, ...
    No per-piece startup cost is added.
    """
    if not max_comm > 0:
        raise ValueError(f"partition: max_comm must be positive, got {max_comm!r}")
    out = []
    for b in _as_buckets(buckets):
        k = max(1, math.ceil(b.comm / max_comm - _EPS))
        if k == 1:
            out.append(b)
            continue
        if float(b.comm).is_integer():
            q, r = divmod(int(b.comm), k)
            parts = [q + 1] * r + [q] * (k - r)
        else:
            parts = [b.comm / k] * k
        for j, c in enumerate(parts):
            last = j == k - 1
            out.append(Bucket(b.forward if last else 0, b.backward if last else 0, c,
                              f"{b.name}{chr(ord('a') + j) if j < 26 else j}"))
    return tuple(out)


# ----------------------------------------------------------------------------------- knapsacks
class Selection(NamedTuple):
    """A knapsack's choice: the chosen item ``indices`` (ascending) and their total ``value``."""

    indices: tuple[int, ...]
    value: float


class MultiSelection(NamedTuple):
    """A multi-knapsack's choice: per link, the chosen item indices (ascending), and the total
    value over all links."""

    links: tuple[tuple[int, ...], ...]
    value: float


def _check_items(weights, values):
    w = np.asarray(weights, dtype=float).reshape(-1)
    v = w.copy() if values is None else np.asarray(values, dtype=float).reshape(-1)
    if w.shape != v.shape:
        raise ValueError("weights and values: one value per item")
    if not np.all(np.isfinite(w)) or (w < 0).any():
        raise ValueError("weights must be finite and non-negative")
    if not np.all(np.isfinite(v)):
        raise ValueError("values must be finite")
    return w, v


def _resolution(weights, caps, resolution):
    """The time step of the knapsack grid.  Given: used as is.  None: 1 when every weight and
    finite capacity is an integer and the largest capacity is at most 2**20, else the largest
    capacity / 2**16."""
    if resolution is not None:
        if not (resolution > 0 and math.isfinite(resolution)):
            raise ValueError(f"resolution must be a positive time, got {resolution!r}")
        return float(resolution)
    top = max([c for c in caps if math.isfinite(c)] or [float(np.sum(weights))])
    integral = (all(float(x).is_integer() for x in weights)
                and all(float(c).is_integer() for c in caps if math.isfinite(c)))
    if integral and top <= _MAX_STEPS:
        return 1.0
    return top / _AUTO_STEPS if top > 0 else 1.0


def _steps_up(x, res):
    return np.ceil(np.asarray(x, dtype=float) / res - _EPS).astype(np.int64)


def _steps_down(x, res):
    return int(math.floor(x / res + _EPS))


def _dp(w_steps, values, item_caps, total_cap, order):
    """Exact-weight 0/1 DP.  Items are added in ``order``; an item may be taken only if the total
    weight (in steps) after adding it is at most its cap.  Returns the best item set."""
    W = int(max(0, total_cap))
    if W > _MAX_STEPS * 8:
        raise ValueError(f"knapsack grid of {W} steps is too large: pass a coarser resolution")
    dp = np.full(W + 1, -np.inf)
    dp[0] = 0.0
    take = np.zeros((len(order), W + 1), dtype=bool)
    for r, i in enumerate(order):
        wi, ci = int(w_steps[i]), min(int(item_caps[i]), W)
        if wi > ci:
            continue
        cand = np.full(W + 1, -np.inf)
        cand[wi:ci + 1] = dp[0:ci + 1 - wi] + values[i]
        better = cand > dp
        dp = np.where(better, cand, dp)
        take[r] = better
    w = int(np.argmax(dp))            # the lightest of the best sets
    chosen = []
    for r in range(len(order) - 1, -1, -1):
        if take[r, w]:
            i = order[r]
            chosen.append(i)
            w -= int(w_steps[i])
    return tuple(sorted(chosen))


def knapsack(weights, values, capacity: float, resolution: float | None = None) -> Selection:
    """Exact 0/1 knapsack on discretised times (the paper's Problem 1, ``NaiveKnapsack``).

    Maximise ``sum(values[i])`` over the chosen items subject to ``sum(weights[i]) <= capacity``.

    Args:
        weights: item weights, non-negative times (DeFT: all-reduce times).
        values: item values (DeFT: the same all-reduce times: the overlapped communication).
        capacity: the knapsack capacity, a time (DeFT: the forward or backward compute time).
        resolution: the grid step.  Weights are rounded UP and the capacity DOWN to multiples
            of it, so the chosen items always fit the real capacity, and the result is optimal
            for the rounded problem (exactly optimal when every time is a multiple of the step).
            None: 1 when all times are integers (capacity up to 2**20), else capacity / 2**16.

    Returns:
        :class:`Selection` ``(indices, value)`` -- ascending indices of the chosen items.

    Cost: O(len(weights) * capacity / resolution) time and bytes of memory.
    """
    w, v = _check_items(weights, values)
    if capacity < 0 or len(w) == 0:
        return Selection((), 0.0)
    res = _resolution(w, [capacity], resolution)
    ws = _steps_up(w, res)
    cap = _steps_down(capacity, res)
    n = len(w)
    chosen = _dp(ws, v, [cap] * n, cap, list(range(n)))
    return Selection(chosen, float(sum(v[i] for i in chosen)))


def _nested_knapsack(weights, values, windows, capacity, resolution):
    """Knapsack with nested capacities: items in the order they become ready; every chosen item
    p needs ``sum(weights[q] for chosen q >= p) <= windows[p]``, and the total fits
    ``capacity``."""
    w, v = _check_items(weights, values)
    win = np.asarray(windows, dtype=float).reshape(-1)
    if win.shape != w.shape:
        raise ValueError("windows: one value per item")
    if len(w) == 0 or capacity < 0:
        return Selection((), 0.0)
    if not math.isfinite(capacity):
        capacity = float(np.sum(w))
    res = _resolution(w, [capacity, *[x for x in win if math.isfinite(x)]], resolution)
    ws = _steps_up(w, res)
    cap = _steps_down(capacity, res)
    caps = [min(cap, _steps_down(x, res)) if math.isfinite(x) else cap for x in win]
    # latest-ready first: the running total when item p is added is exactly the suffix sum of p
    chosen = _dp(ws, v, caps, cap, list(range(len(w) - 1, -1, -1)))
    return Selection(chosen, float(sum(v[i] for i in chosen)))


def windows_from_compute(compute) -> list[float]:
    """``windows[p] = sum(compute[p+1:])``: the compute left after item p's gradient exists,
    items in backward (ready) order."""
    c = [float(x) for x in compute]
    out, acc = [0.0] * len(c), 0.0
    for p in range(len(c) - 1, -1, -1):
        out[p] = acc
        acc += c[p]
    return out


def recursive_knapsack(comm, compute, capacity: float | None = None, *, values=None,
                       resolution: float | None = None) -> Selection:
    """Algorithm 1 (RecursiveKnapsack): which new gradients to all-reduce during the backward
    pass on one link, each starting only once its gradient exists.

    Items are given in BACKWARD order (the paper's ``{C_N, ..., C_1}``): ``comm[p]`` is item p's
    all-reduce time, ``compute[p]`` the backward compute that produces item p's gradient (it
    runs after ``compute[p-1]``).  Item p's *window* is the compute left after its gradient
    exists, ``W_p = sum(compute[p+1:])``.  The chosen set is the most valuable one such that,
    sending the chosen items in ready order on one link from time 0,

        for every chosen p:  sum(comm[q] for chosen q >= p) <= W_p      (each suffix fits)
        sum(comm[q] for chosen q) <= capacity                           (the link's time)

    -- exactly the condition for every chosen all-reduce to end before the backward compute
    does, when the link is free from ``sum(compute) - capacity`` on.  The paper's recursion
    peels off C_N and shrinks remainTime by T_{N-1}; these are its nested capacities, solved
    exactly by one DP over the items latest-ready first (see the module docstring, item 2, for
    why Alg. 1 as printed is not used literally).

    Args:
        comm: all-reduce times, backward order.
        compute: backward compute times, backward order (``compute[0]`` only delays item 0).
        capacity: total time the link has; None: ``W_0 = sum(compute[1:])`` (Alg. 2, line 19).
        values: item values; None: ``comm`` (maximise the overlapped communication).
        resolution: grid step, as for :func:`knapsack` (weights up, capacities down).

    Returns:
        :class:`Selection` -- ascending positions (in the backward order given) and value.
    """
    windows = windows_from_compute(compute)
    if len(windows) != len(np.asarray(comm).reshape(-1)):
        raise ValueError("comm and compute: one value per item")
    if capacity is None:
        capacity = windows[0] if windows else 0.0
    return _nested_knapsack(comm, values, windows, capacity, resolution)


def _link_fits(chosen: list[int], p: int, dur: float, durs: dict, windows, cap: float) -> bool:
    """Would item p (duration ``dur`` on this link) still fit with the link's ``chosen`` items?"""
    total = sum(durs[q] for q in chosen) + dur
    if total > cap * (1 + _EPS) + _EPS:
        return False
    if windows is None:
        return True
    for q in sorted(chosen + [p]):
        suffix = sum(durs[r] for r in chosen if r >= q) + (dur if p >= q else 0.0)
        if suffix > windows[q] * (1 + _EPS) + _EPS:
            return False
    return True


def multi_link_greedy(weights, capacities, *, speeds=None, windows=None,
                      values=None) -> MultiSelection:
    """The paper's greedy for the 0/1 multi-knapsack (Problem 2, section III-C).

    "Sort the capacity of each knapsack and the time of each bucket, then start with the
    knapsack with smaller capacity, and prioritise placing the bucket with longer time":
    knapsacks (links) in ascending capacity, and for each one the unplaced items in descending
    weight, each placed when it still fits.  O(items x links) placement steps.

    Args:
        weights: item weights = all-reduce times on the FAST link.
        capacities: per link, the time it has (e.g. the forward compute time for each link).
        speeds: per link, relative speed; an item takes ``weight / speeds[l]`` on link l
            (None: all 1).  Two links with the paper's gloo/NCCL ratio: ``(1, 1/1.65)``; the
            slow knapsack's capacity in weight units is then ``capacity / 1.65``.
        windows: optional per-item windows (items in ready order, as for
            :func:`recursive_knapsack`): on each link every suffix of its items in ready order
            must fit the window of its first item.  None: no data dependencies (forward stage).
        values: item values for the reported total; None: the weights.

    Returns:
        :class:`MultiSelection` -- per link (in the order given) the placed items, and the total
        value of all placed items.
    """
    w, v = _check_items(weights, values)
    caps = [float(c) for c in capacities]
    if not caps:
        raise ValueError("capacities: at least one link")
    sp = [1.0] * len(caps) if speeds is None else [float(s) for s in speeds]
    if len(sp) != len(caps) or any(not s > 0 for s in sp):
        raise ValueError("speeds: one positive value per link")
    win = None if windows is None else [float(x) for x in windows]
    if win is not None and len(win) != len(w):
        raise ValueError("windows: one value per item")
    link_order = sorted(range(len(caps)), key=lambda l: (caps[l] * sp[l], l))
    item_order = sorted(range(len(w)), key=lambda i: (-w[i], i))
    placed: dict[int, int] = {}
    chosen = {l: [] for l in range(len(caps))}
    durs = {l: {} for l in range(len(caps))}
    for l in link_order:
        for i in item_order:
            if i in placed:
                continue
            d = w[i] / sp[l]
            if _link_fits(chosen[l], i, d, durs[l], win, caps[l]):
                chosen[l].append(i)
                durs[l][i] = d
                placed[i] = l
    links = tuple(tuple(sorted(chosen[l])) for l in range(len(caps)))
    return MultiSelection(links, float(sum(v[i] for i in placed)))


# ------------------------------------------------------------------- delayed-update scheduler
class Transfer(NamedTuple):
    """One all-reduce of one bucket: it carries the sum of this rank's local gradients of the
    listed ``iterations`` (more than one when gradients were accumulated and merged), on
    ``link`` (0: the fast link, 1: the second, slower one)."""

    bucket: int
    iterations: tuple[int, ...]
    link: int = 0


@dataclass(frozen=True)
class Schedule:
    """What happens in one training iteration under DeFT (see :class:`DelayedUpdateScheduler`).

    Attributes:
        iteration: the iteration (0-based).
        cases: the paper's cases that applied: ``(1, c)`` when the forward stage had buckets to
            schedule (Case 1), else ``(c,)``; ``c`` = :attr:`case`.
        case: the backward stage's case, 2, 3 or 4.
        forward: all-reduces started when this iteration's forward pass starts (Case 1; older
            iterations' gradients); they are waited for before the backward pass starts.
        backward: all-reduces of this backward pass, in start order per link: first the older
            gradients left in the current task queue (Cases 2 and 3; they start when the
            backward pass starts), then this iteration's (merged) buckets, each when its
            gradient exists (descending bucket index).  All are waited for at the end of the
            backward pass, before the parameter update.
        now: the buckets of THIS iteration's gradient (merged with the held gradients listed in
            :attr:`now_iterations`) all-reduced during this backward pass, in ready order.
        now_iterations: the iterations whose gradients the ``now`` transfers carry (this one
            and, in Cases 3/4, those accumulated in the future task queue); ``()`` in Case 2.
        held: this iteration's buckets NOT sent in this backward pass (the complement of
            ``now``): kept locally, to be sent later (current task queue) or accumulated
            (future task queue, Case 2).
        delayed: the buckets all-reduced during the NEXT iteration's forward pass, i.e.
            ``[t.bucket for t in next_forward]`` (``plan(iteration + 1).forward``).
        next_forward: those transfers, with the iterations they carry.
        update: whether the parameters are updated at the end of this iteration.
        applied_iteration: per bucket, the newest iteration whose gradient is applied to that
            bucket's parameters at the end of this iteration, or None (no update).
        applied_iterations: per bucket, every iteration whose gradient is applied at the end
            of this iteration (summed; ``()`` when none).
    """

    iteration: int
    cases: tuple[int, ...]
    case: int
    forward: tuple[Transfer, ...]
    backward: tuple[Transfer, ...]
    now: tuple[int, ...]
    now_iterations: tuple[int, ...]
    held: tuple[int, ...]
    delayed: tuple[int, ...]
    next_forward: tuple[Transfer, ...]
    update: bool
    applied_iteration: tuple[int | None, ...]
    applied_iterations: tuple[tuple[int, ...], ...]


class DelayedUpdateScheduler:
    """DeFT's two-stage scheduling with delayed updates: the four cases of section III-B as the
    text and Fig. 4 describe them (where Alg. 2 disagrees, the text wins; module docstring).

    Args:
        comm: per bucket (forward order), the all-reduce time on the fast link.
        forward: per bucket, forward compute time.
        backward: per bucket, backward compute time.
        links: 1 or 2 communication links; the second one is ``mu`` times slower.
        mu: speed ratio of the two links (gloo/NCCL, 1.65 in the paper).
        capacity_scale: multiplies every knapsack capacity (the Preserver's feedback, section
            IV-C: more than 1 lets communication outgrow compute, so updates come more often
            while the iterations stall).
        resolution: grid step of the exact knapsacks (see :func:`knapsack`).

    Raises:
        ValueError: bad lengths or times, or a bucket longer than every knapsack (it could never
            be sent: :func:`partition` it first, as section III-D does).

    Gradient groups.  A *group* is a set of consecutive iterations whose local gradients are
    summed and synchronised together (one all-reduce per bucket) and applied in one update.
    Two queues hold groups (paper: task queues): the *current* queue holds the buckets of the
    group being synchronised that are still unsent; the *future* queue holds whole gradients
    kept locally (no bucket of them sent yet).

    Per iteration ``t`` (``F``, ``B``: total forward and backward compute time;
    ``W_i = sum(backward[:i])`` the window of bucket i):

    * Case 1 (forward stage), when the current queue is not empty: an exact 0/1 knapsack over
      its buckets with capacity F (per link; two links: see below) picks the transfers run
      during the forward pass.  They are waited for before the backward pass.
    * At the start of the backward pass:

      - Case 2: the current queue is not empty and B cannot carry all of it: a knapsack over
        the current queue with capacity B picks the transfers of this backward pass (they
        have no data dependency: they start at once).  This iteration's whole gradient goes
        to the future queue (added to what it holds).  ``now`` is empty.
      - Case 3: the current queue is not empty and B carries all of it: those transfers go
        first (starting at once); the current group is then complete.  This iteration's
        gradient is merged with the future queue's into a new group; :func:`recursive_knapsack`
        over its buckets with the windows ``W_i`` and capacity ``B - (time taken by the old
        transfers)`` picks ``now``; the rest becomes the current queue.
      - Case 4: the current queue is empty (Fig. 4's first iteration is the special case with
        both queues empty): as Case 3 without old transfers (capacity B).

    * End of the iteration: every group whose buckets are all synchronised and that has not
      been applied yet is applied (oldest first): in Case 3 the group just finished, in Case 4
      the one finished during this forward pass (and in both, the new group too if ``now``
      took all its buckets, which needs bucket 0's all-reduce to take no time).  Every
      forward pass runs on the parameters as of the latest update (the paper's delayed update:
      iteration t's gradient is applied at the end of iteration t+1 at the earliest, unless
      bucket 0's all-reduce takes no time).

    So a bucket that is ``delayed`` from iteration t into the forward pass of t+1 has its
    gradient applied at the end of t+1 when that forward pass empties the current queue
    (Case 4 at t+1) or t+1's backward pass does (Case 3) -- exactly one iteration later; it
    waits longer only while the current queue cannot be emptied (Case 2).

    Two links: every knapsack becomes a two-knapsack problem (the slow link has the same time,
    so ``capacity / mu`` in fast-link units); the choice is the better of the paper's
    :func:`multi_link_greedy` and "the exact single-link solution on the fast link, then the
    greedy on the slow link for the rest" (never worse than one link).

    Use: call :meth:`plan` with the iteration number (any order; plans are computed in order
    and cached).  Everything is deterministic, so every rank computes the same plans.  A
    gradient synchronizer following ``p = plan(t)``: at the start of the forward pass start
    ``p.forward`` (buffers of the groups they name), wait for them before the backward pass;
    at the start of the backward pass start the ``p.backward`` transfers that do not carry
    iteration t; as bucket i's gradient becomes final, add it into its group's accumulation
    buffer (the group ``p.now_iterations`` in Cases 3/4, the future queue's in Case 2) and, if
    i is in ``p.now``, start its transfer; at the end wait for all, and if ``p.update`` apply
    the synchronised gradients of ``p.applied_iterations``.
    """

    def __init__(self, comm, forward, backward, *, links: int = 1, mu: float = MU_GLOO,
                 capacity_scale: float = 1.0, resolution: float | None = None):
        c = [float(x) for x in comm]
        f = [float(x) for x in forward]
        b = [float(x) for x in backward]
        if not (len(c) == len(f) == len(b)) or not c:
            raise ValueError("comm, forward, backward: one value per bucket, not empty")
        if any(not (math.isfinite(x) and x >= 0) for x in c + f + b):
            raise ValueError("times must be finite and non-negative")
        if links not in (1, 2):
            raise ValueError(f"links must be 1 or 2, got {links!r}")
        if not (mu >= 1 and math.isfinite(mu)):
            raise ValueError(f"mu (slow/fast link time ratio) must be >= 1, got {mu!r}")
        if not (capacity_scale > 0 and math.isfinite(capacity_scale)):
            raise ValueError(f"capacity_scale must be positive, got {capacity_scale!r}")
        self.n = len(c)
        self.comm = tuple(c)
        self.forward_times = tuple(f)
        self.backward_times = tuple(b)
        self.links = links
        self.mu = float(mu)
        self.capacity_scale = float(capacity_scale)
        self.resolution = resolution
        self.speeds = (1.0,) if links == 1 else (1.0, 1.0 / self.mu)
        self.F = sum(f) * capacity_scale
        self.B = sum(b) * capacity_scale
        acc, win = 0.0, []
        for x in b:                       # W_i = sum(backward[:i])
            win.append(acc * capacity_scale)
            acc += x
        self.windows = tuple(win)
        big = max(self.F, self.B)
        for i, x in enumerate(c):
            if x > big * (1 + _EPS) + _EPS:
                raise ValueError(
                    f"bucket {i}: all-reduce time {x:g} exceeds both the forward ({self.F:g}) and "
                    f"the backward ({self.B:g}) capacity, so it could never be sent; partition "
                    f"it (deft.partition, paper section III-D)")
        # state between iterations
        self._current: list[int] = []
        self._current_group: tuple[int, ...] = ()
        self._future: tuple[int, ...] = ()
        self._completed: list[tuple[int, ...]] = []
        self._next_forward: tuple[Transfer, ...] = ()
        self._plans: list[Schedule] = []              # iterations _forgotten, _forgotten + 1, ...
        self._forgotten = 0                           # plans before this one were dropped
        self._applied_groups: list[tuple[int, tuple[int, ...]]] = []

    # -- selection helpers -------------------------------------------------------------------
    def _select(self, items: list[int], caps: Sequence[float], ready_order: bool):
        """Choose among ``items`` (bucket indices) for the links with times ``caps``.
        ready_order: respect the windows (new gradients; items then in ready order)."""
        if not items:
            return [[] for _ in caps], 0.0
        if ready_order:
            items = sorted(items, reverse=True)          # backward = ready order
        w = [self.comm[i] for i in items]
        win = [self.windows[i] for i in items] if ready_order else None

        def single(ws, cap, idx):
            if win is None:
                if sum(ws) <= cap * (1 + _EPS) + _EPS:
                    return list(idx)
                sel = knapsack(ws, ws, cap, self.resolution)
            else:
                sel = _nested_knapsack(ws, None, [win[k] for k in idx], cap, self.resolution)
            return [idx[k] for k in sel.indices]

        if self.links == 1:
            chosen = single(w, caps[0], list(range(len(items))))
            per_link = [chosen]
        else:
            g = multi_link_greedy(w, caps, speeds=self.speeds, windows=win)
            cand_a = [list(x) for x in g.links]
            fast = single(w, caps[0], list(range(len(items))))
            rest = [k for k in range(len(items)) if k not in set(fast)]
            slow = multi_link_greedy([w[k] for k in rest], [caps[1]], speeds=[self.speeds[1]],
                                     windows=None if win is None else [win[k] for k in rest])
            cand_b = [fast, [rest[k] for k in slow.links[0]]]
            va = sum(w[k] for l in cand_a for k in l)
            vb = sum(w[k] for l in cand_b for k in l)
            per_link = cand_a if va >= vb else cand_b
        out = [[items[k] for k in l] for l in per_link]
        return out, sum(self.comm[i] for l in out for i in l)

    def _forward_transfers(self) -> tuple[Transfer, ...]:
        if not self._current:
            return ()
        per_link, _ = self._select(self._current, [self.F] * self.links, ready_order=False)
        return tuple(Transfer(i, self._current_group, l)
                     for l, sel in enumerate(per_link) for i in sorted(sel))

    # -- the state machine -------------------------------------------------------------------
    def _step(self) -> Schedule:
        t = self._forgotten + len(self._plans)
        n = self.n
        fwd = self._next_forward
        cases = (1,) if self._current else ()
        sent = {x.bucket for x in fwd}
        self._current = [i for i in self._current if i not in sent]
        if not self._current and self._current_group:
            self._completed.append(self._current_group)         # finished in the forward pass
            self._current_group = ()
        old: list[Transfer] = []
        new: list[Transfer] = []
        now: tuple[int, ...] = ()
        now_iters: tuple[int, ...] = ()
        if self._current:
            per_link, _ = self._select(self._current, [self.B] * self.links, ready_order=False)
            picked = {i for l in per_link for i in l}
            old = [Transfer(i, self._current_group, l)
                   for l, sel in enumerate(per_link) for i in sorted(sel)]
            if picked == set(self._current):
                case = 3
                self._completed.append(self._current_group)
                self._current, self._current_group = [], ()
                loads = [sum(self.comm[x.bucket] / self.speeds[x.link] for x in old
                             if x.link == l) for l in range(self.links)]
                caps = [self.B - ld for ld in loads]
            else:
                case = 2
                self._current = [i for i in self._current if i not in picked]
                self._future = self._future + (t,)
        else:
            case = 4
            caps = [self.B] * self.links
        if case in (3, 4):
            group = self._future + (t,)
            self._future = ()
            per_link, _ = self._select(list(range(n)), caps, ready_order=True)
            link_of = {i: l for l, sel in enumerate(per_link) for i in sel}
            now = tuple(sorted(link_of, reverse=True))
            now_iters = group
            new = [Transfer(i, group, link_of[i]) for i in now]
            rest = [i for i in range(n) if i not in link_of]
            if rest:
                self._current, self._current_group = rest, group
            else:
                self._completed.append(group)
        applied = self._completed
        self._completed = []
        for g in applied:
            self._applied_groups.append((t, g))
        merged = tuple(sorted(x for g in applied for x in g))
        self._next_forward = self._forward_transfers()
        s = Schedule(
            iteration=t, cases=cases + (case,), case=case, forward=fwd,
            backward=tuple(old + new), now=now, now_iterations=now_iters,
            held=tuple(i for i in range(n - 1, -1, -1) if i not in set(now)),
            delayed=tuple(x.bucket for x in self._next_forward),
            next_forward=self._next_forward, update=bool(applied),
            applied_iteration=tuple((merged[-1] if merged else None) for _ in range(n)),
            applied_iterations=tuple(merged for _ in range(n)))
        self._plans.append(s)
        return s

    def plan(self, iteration: int) -> Schedule:
        """The :class:`Schedule` of ``iteration`` (0-based)."""
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        if iteration < self._forgotten:
            raise ValueError(f"iteration {iteration}: plans before {self._forgotten} were "
                             f"dropped by forget()")
        while self._forgotten + len(self._plans) <= iteration:
            self._step()
        return self._plans[iteration - self._forgotten]

    def forget(self, before: int) -> None:
        """Drop the plans and update records of iterations before `before` (a long training
        run keeps memory bounded; :meth:`plan` of a dropped iteration then raises)."""
        drop = min(max(0, before - self._forgotten), len(self._plans))
        del self._plans[:drop]
        self._forgotten += drop
        self._applied_groups = [(t, g) for t, g in self._applied_groups if t >= before]

    def run(self, iterations: int) -> list[Schedule]:
        """The schedules of iterations ``0 .. iterations-1``."""
        return [self.plan(t) for t in range(iterations)]

    def applied_groups(self, iterations: int) -> list[tuple[int, tuple[int, ...]]]:
        """``(iteration of the update, iterations applied)`` for every update in the first
        ``iterations`` iterations."""
        if iterations > 0:
            self.plan(iterations - 1)
        return [(t, g) for t, g in self._applied_groups if t < iterations]

    def batch_multipliers(self, iterations: int) -> list[int]:
        """The Preserver's view (section IV-C1): the sizes k_1, k_2, ... of the groups applied
        in the first ``iterations`` iterations -- the update with group j uses k_j batches."""
        return [len(g) for _, g in self.applied_groups(iterations)]


# ----------------------------------------------------------------------------------- Preserver
def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def expected_next_loss(s: float, grad_mean: float, grad_std: float, lr: float,
                       batch_size: float, target: float = 0.0) -> float:
    """Expected loss after one step of the Gaussian walk with rebound (paper eq. 1, ref. [25]).

    ``s_{t+1} = s_t - eta ds`` if that is ``>= S*``, else ``2 S* + eta ds - s_t``, with
    ``ds ~ N(mu_t, sigma_t^2 / B)``.  Hence ``s_{t+1} - S* = |s_t - S* - eta ds|`` and

        E_B(s_{t+1}) = (s_t - S* - eta mu_t) (Phi(a) - Phi(-a))
                       + (eta sigma_t / sqrt(B)) sqrt(2/pi) exp(-a^2/2) + S*,
        a = (s_t - S* - eta mu_t) sqrt(B) / (eta sigma_t)

    (the paper prints ``eta Delta s_t`` in the first term; the expectation has the mean
    ``mu_t``).  Args: ``s`` = s_t, ``grad_mean`` = mu_t, ``grad_std`` = sigma_t, ``lr`` = eta,
    ``batch_size`` = B, ``target`` = S*.
    """
    if batch_size <= 0 or lr < 0 or grad_std < 0:
        raise ValueError("batch_size must be positive, lr and grad_std non-negative")
    m = s - target - lr * grad_mean
    scale = lr * grad_std / math.sqrt(batch_size)
    if scale == 0:
        return target + abs(m)
    a = m / scale
    return m * (_phi(a) - _phi(-a)) + scale * math.sqrt(2 / math.pi) * math.exp(-a * a / 2) + target


def _per_iteration(x, n, name):
    if np.ndim(x) == 0:
        return [float(x)] * n
    xs = [float(v) for v in x]
    if len(xs) != n:
        raise ValueError(f"{name}: a scalar or one value per iteration ({n})")
    return xs


def preserver_ratio(batch_multipliers, s0: float, grad_mean, grad_std, lr: float,
                    batch_size: float, target: float = 0.0) -> float:
    """``E_B(s_{A+N}) / E_{k B}(s_{A+N})``: expected loss after N = sum(k) iterations of plain
    training (O_B: N steps of batch B) over that of DeFT's sequence (O_D: one step of batch
    k_j B per group), both iterating :func:`expected_next_loss` from ``s0`` (section IV-C2).
    ``grad_mean``/``grad_std`` are scalars or one value per iteration; a merged step uses the
    values of its first iteration (where it starts)."""
    ks = [int(k) for k in batch_multipliers]
    if not ks or any(k < 1 for k in ks):
        raise ValueError("batch_multipliers: positive integers, at least one")
    n = sum(ks)
    mu = _per_iteration(grad_mean, n, "grad_mean")
    sd = _per_iteration(grad_std, n, "grad_std")
    sb = s0
    for i in range(n):
        sb = expected_next_loss(sb, mu[i], sd[i], lr, batch_size, target)
    sd_, p = s0, 0
    for k in ks:
        sd_ = expected_next_loss(sd_, mu[p], sd[p], lr, k * batch_size, target)
        p += k
    if sd_ == 0:
        return 1.0 if sb == 0 else math.inf
    return sb / sd_


def preserver_ok(batch_multipliers, s0: float, grad_mean, grad_std, lr: float,
                 batch_size: float, target: float = 0.0, eps: float = 0.01) -> bool:
    """The Preserver's convergence check (section IV-C): accept DeFT's schedule when

        1 - eps <= E_B(s_{A+N}) / E_{k_m B}(s_{A+N}) <= 1 + eps

    where both expectations iterate eq. 1 (see :func:`expected_next_loss`)

        E_B(s_{t+1}) = (s_t - S* - eta mu_t)(Phi(a) - Phi(-a))
                       + (eta sigma_t / sqrt(B)) sqrt(2/pi) e^{-a^2/2} + S*,
        a = (s_t - S* - eta mu_t) sqrt(B) / (eta sigma_t),

    N times with batch B (plain training) and once per group with batch k_j B (DeFT's variable
    batch sequence ``batch_multipliers`` = k_1..k_m, sum N; e.g. from
    :meth:`DelayedUpdateScheduler.batch_multipliers`).  The paper uses eps = 0.01."""
    r = preserver_ratio(batch_multipliers, s0, grad_mean, grad_std, lr, batch_size, target)
    return 1 - eps <= r <= 1 + eps


def tune_capacity(comm, forward, backward, *, s0: float, grad_mean, grad_std, lr: float,
                  batch_size: float, target: float = 0.0, eps: float = 0.01, links: int = 1,
                  mu: float = MU_GLOO, growth: float = 1.1, max_tries: int = 10,
                  horizon: int = 64, resolution: float | None = None):
    """The Preserver's feedback loop (section IV-C3): build the scheduler, check its batch
    sequence over ``horizon`` iterations with :func:`preserver_ok`, and while it fails grow the
    knapsack capacities by ``growth`` (up to ``max_tries`` times, as the paper).  ``grad_mean``
    and ``grad_std`` must be scalars here.  Returns ``(scheduler, ratio, passed)``."""
    scale = 1.0
    sched = ratio = None
    for _ in range(max_tries + 1):
        sched = DelayedUpdateScheduler(comm, forward, backward, links=links, mu=mu,
                                       capacity_scale=scale, resolution=resolution)
        ks = sched.batch_multipliers(horizon)
        if not ks:
            ratio = 0.0
        else:
            ratio = preserver_ratio(ks, s0, grad_mean, grad_std, lr, batch_size, target)
        if 1 - eps <= ratio <= 1 + eps:
            return sched, ratio, True
        scale *= growth
    return sched, ratio, False


# ----------------------------------------------------------------------------------- simulator
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
    bk = _as_buckets(buckets)
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


def table_ii_report(iterations: int = 200, warmup: int = 8) -> list[dict]:
    """Simulated iteration times on :data:`TABLE_II` for WFBP, priority scheduling (with DeFT's
    partition, and ``"priority-unsplit"`` without any) and DeFT on one and two links (the
    table in the module docstring).  Speed-ups are against WFBP on the same links."""
    rows = []
    for links in (1, 2):
        base = None
        for name, policy, part in (("wfbp", "wfbp", "auto"), ("priority", "priority", "auto"),
                                   ("priority-unsplit", "priority", None),
                                   ("deft", "deft", "auto")):
            r = simulate(TABLE_II, policy, links, iterations=iterations, warmup=warmup,
                         partition_time=part)
            base = r.iteration_time if base is None else base
            rows.append({"policy": name, "links": links, "iteration_us": r.iteration_time,
                         "speedup_vs_wfbp": base / r.iteration_time,
                         "updates_per_iteration": r.updates_per_iteration,
                         "pieces": len(r.buckets)})
    return rows


if __name__ == "__main__":          # python -m aluminum_py.planning.deft
    print("DeFT Table II (VGG-19) simulation, microseconds; compute per iteration "
          f"{sum(b.forward + b.backward for b in TABLE_II):g} us, "
          f"communication {sum(b.comm for b in TABLE_II):g} us")
    print(f"{'policy':18s}{'links':>6s}{'iteration (us)':>16s}{'vs WFBP':>10s}"
          f"{'updates/it':>12s}{'pieces':>8s}")
    for row in table_ii_report():
        print(f"{row['policy']:18s}{row['links']:6d}{row['iteration_us']:16.1f}"
              f"{row['speedup_vs_wfbp']:10.2f}{row['updates_per_iteration']:12.2f}"
              f"{row['pieces']:8d}")
