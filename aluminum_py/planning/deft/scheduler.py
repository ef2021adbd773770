"""DeFT's two-stage scheduling with delayed updates (section III-B, Fig. 4, Algorithm 2):
:class:`DelayedUpdateScheduler` gives each training iteration's :class:`IterationPlan` -- which
bucket all-reduces (:class:`Transfer`) run in its forward and backward passes and which
iterations' gradients its parameter update applies.

The gradient of bucket ``i`` (forward order, :mod:`~aluminum_py.planning.deft.model`) exists once
the backward compute of buckets ``N-1 .. i`` is done.  The *window* of bucket ``i`` is the
backward compute left after that: ``sum(backward[:i])``; bucket 0's window is 0 (the paper's
"hard dependency": its all-reduce can never overlap the backward pass of its own iteration).

Where Algorithm 2 disagrees with the text and Fig. 4, this module follows the text (as
docs/overlap.md says).  Alg. 2's Case 3 branch (lines 26-32) empties ``CurrentTaskList`` after
``order2``, so the new buckets that ``RecursiveKnapsack`` did not pick are lost; the text copies
them into the current task queue.  Alg. 2's Case 4 branch (lines 17-22) neither merges the
future task queue into the new buckets nor updates the parameters, and since
``CurrentTaskList`` is then non-empty line 45 also adds the whole gradient to
``FutureTaskList``, so the unpicked buckets would be sent twice; the text merges (Fig. 4,
iteration 5), keeps each bucket once, and "performs a parameter update at the end of this
iteration" with the group completed during the forward pass.  Alg. 2 also never merges the
future queue in Case 3; the text does ("stored (or merged) into the future task queue").
:class:`DelayedUpdateScheduler` states the rules followed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from .knapsacks import knapsack, multi_link_greedy, nested_knapsack
from .model import EPS, MU_GLOO


class Transfer(NamedTuple):
    """One all-reduce of one bucket: it carries the sum of this rank's local gradients of the
    listed ``iterations`` (more than one when gradients were accumulated and merged), on
    ``link`` (0: the fast link, 1: the second, slower one)."""

    bucket: int
    iterations: tuple[int, ...]
    link: int = 0


@dataclass(frozen=True)
class IterationPlan:
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
    text and Fig. 4 describe them (where Alg. 2 disagrees, the text wins: see the module docstring).

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
            if x > big * (1 + EPS) + EPS:
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
        self._plans: list[IterationPlan] = []         # iterations _forgotten, _forgotten + 1, ...
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
                if sum(ws) <= cap * (1 + EPS) + EPS:
                    return list(idx)
                sel = knapsack(ws, ws, cap, self.resolution)
            else:
                sel = nested_knapsack(ws, None, [win[k] for k in idx], cap, self.resolution)
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
    def _step(self) -> IterationPlan:
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
        s = IterationPlan(
            iteration=t, cases=cases + (case,), case=case, forward=fwd,
            backward=tuple(old + new), now=now, now_iterations=now_iters,
            held=tuple(i for i in range(n - 1, -1, -1) if i not in set(now)),
            delayed=tuple(x.bucket for x in self._next_forward),
            next_forward=self._next_forward, update=bool(applied),
            applied_iteration=tuple((merged[-1] if merged else None) for _ in range(n)),
            applied_iterations=tuple(merged for _ in range(n)))
        self._plans.append(s)
        return s

    def plan(self, iteration: int) -> IterationPlan:
        """The :class:`IterationPlan` of ``iteration`` (0-based)."""
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

    def run(self, iterations: int) -> list[IterationPlan]:
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

