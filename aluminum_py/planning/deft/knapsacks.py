"""DeFT's knapsacks (sections III-A to III-C): the exact 0/1 knapsack on discretised times
(Problem 1, :func:`knapsack`), Algorithm 1's backward-stage knapsack in which every item can only
start once its gradient exists (:func:`recursive_knapsack`: capacities nested along the backward
order) and the greedy for two or more links (Problem 2, :func:`multi_link_greedy`).

Where the paper disagrees with itself (and what this module follows):

* Algorithm 1 as printed always returns ``NaiveKnapsack(CommTimeList, remainTime)``: ``order2``
  solves the same problem with one item and some capacity fewer, so ``sum(order1) >=
  sum(order2)``; and the naive knapsack ignores that an item can only start once its gradient
  exists, so its choice may not fit the backward pass.  :func:`recursive_knapsack` solves what
  the recursion is built for -- each suffix of the backward order must fit into the compute
  left after its first item is ready (remainTime shrinking by T_{N-1}, T_{N-2}, ... as items
  are peeled off) -- exactly, by dynamic programming; its choice always fits.
* Problem 2 writes the second knapsack's capacity as ``mu * sum(t_j)``; section III-C says the
  NCCL knapsack is mu times the gloo one and III-D calls "the forward time divided by mu" the
  smallest capacity.  Item weights are fast-link (NCCL) times, so the slow link's capacity is
  ``sum(t_j) / mu``; this module follows III-C/III-D (a slow-link transfer takes ``mu`` times
  its weight).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .model import EPS

_MAX_STEPS = 1 << 20    # largest knapsack grid used without being asked (columns)
_AUTO_STEPS = 1 << 16   # grid size when the times are not integers


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
    return np.ceil(np.asarray(x, dtype=float) / res - EPS).astype(np.int64)


def _steps_down(x, res):
    return int(math.floor(x / res + EPS))


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


def nested_knapsack(weights, values, windows, capacity, resolution):
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
    exactly by one DP over the items latest-ready first (the module docstring says why Alg. 1
    as printed is not used literally).

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
    return nested_knapsack(comm, values, windows, capacity, resolution)


def _link_fits(chosen: list[int], p: int, dur: float, durs: dict, windows, cap: float) -> bool:
    """Would item p (duration ``dur`` on this link) still fit with the link's ``chosen`` items?"""
    total = sum(durs[q] for q in chosen) + dur
    if total > cap * (1 + EPS) + EPS:
        return False
    if windows is None:
        return True
    for q in sorted(chosen + [p]):
        suffix = sum(durs[r] for r in chosen if r >= q) + (dur if p >= q else 0.0)
        if suffix > windows[q] * (1 + EPS) + EPS:
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

