"""The delayed-update strategy (policy ``"deft"``): DeFT's plans carried out on real buffers
with real nonblocking allreduces.

The plans come from :class:`aluminum_py.planning.deft.DelayedUpdateScheduler` (the four cases of
DeFT section III-B).  How they are carried out:

* DeFT's items are *pieces*: a synchronizer bucket, or an element range of it when the bucket's
  allreduce would not fit the smallest knapsack (section III-D's partition).  Pieces are listed
  in DeFT's forward order (the bucket that is ready last comes first).
* Two *slots*, each one persistent buffer per bucket, hold the gradient groups: the group being
  synchronised (the paper's current task queue: its pieces are reduced in place in its slot) and
  the future group (local gradients of held iterations, summed as they arrive).  A third group
  never exists: a new group is formed only when the current one is complete.
* Iteration t, with ``p = plan(t)``:

  - ``p.forward`` (older gradients) was launched at the end of the previous ``wait()``, so it
    runs during the optimizer step and this forward pass;
  - at the start of the backward pass (the first ``grad_ready``, or ``begin_backward()``) the
    transfers of ``p.backward`` that carry older iterations are launched;
  - as a bucket's gradients become final they are added into the future slot, and its pieces
    in ``p.now`` are launched (in plan order; buckets in bucket order as for every policy);
    when the slot's group is new and the bucket is one memory range, those pieces are reduced
    out of place from the gradients into the slot instead of being copied first;
  - ``wait()`` waits for all of them, moves the groups between the slots as the plan says, and
    if ``p.update`` writes the applied groups' sum into the gradients (divided by ranks times
    iterations when averaging); otherwise it zeroes the gradients.  Then it launches
    ``p.next_forward``.

Every rank computes the same plans, so every rank issues the same allreduces in the same order.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ..errors import Error
from ..ops import SUM
from ..planning.deft import DelayedUpdateScheduler
from .buckets import Buckets, array_module
from .strategy import Strategy, StepResult, SyncOptions


class Piece(NamedTuple):
    """One DeFT item: elements ``[start, stop)`` of synchronizer bucket ``bucket``."""

    bucket: int
    start: int
    stop: int


def split_pieces(sizes, itemsizes, cost, forward, backward):
    """DeFT's items for buckets in launch (backward) order.

    Args:
        sizes, itemsizes: per bucket, elements and bytes per element.
        cost: allreduce seconds of a byte count.
        forward, backward: per bucket, compute seconds.

    Returns ``(pieces, comm, fwd, bwd)`` in DeFT's forward order.  A bucket whose allreduce takes
    longer than ``min(F, B)`` (``B`` when there is no forward time) is cut into the fewest equal
    element ranges that each fit; its compute times go to its last piece in forward order, so
    all its pieces are ready together (as :func:`aluminum_py.planning.deft.partition`).
    """
    F, B = float(sum(forward)), float(sum(backward))
    limit = min(F, B) if F > 0 else B
    if not limit > 0:
        raise ValueError("policy 'deft' needs positive compute_times (backward seconds)")
    pieces, comm, fwd, bwd = [], [], [], []
    for b in reversed(range(len(sizes))):              # forward order
        n, w = int(sizes[b]), int(itemsizes[b])
        k = 1
        while float(cost(math.ceil(n / k) * w)) > limit:
            if k >= n:
                raise ValueError(
                    f"bucket {b}: even one element's allreduce ({float(cost(w)):.3g} s) exceeds "
                    f"the compute time DeFT can hide it under ({limit:.3g} s)")
            k = min(n, 2 * k)
        bounds = [n * j // k for j in range(k + 1)]
        for j in range(k):
            last = j == k - 1
            pieces.append(Piece(b, bounds[j], bounds[j + 1]))
            comm.append(float(cost((bounds[j + 1] - bounds[j]) * w)))
            fwd.append(float(forward[b]) if last else 0.0)
            bwd.append(float(backward[b]) if last else 0.0)
    return pieces, comm, fwd, bwd


class DelayedUpdates(Strategy):
    """The delayed-update strategy of one synchronizer (see the module docstring).

    Args:
        layout: the synchronizer's buckets.
        algorithm: all-reduce algorithm of every piece.
        average: divide the applied sums by ranks times iterations.
        cost: all-reduce seconds of a byte count (sizes DeFT's items).
        capacity_scale: multiplies DeFT's knapsack capacities.
    """

    op = SUM                               # pieces are summed; averaging happens when applied

    def __init__(self, layout: Buckets, algorithm: str, average: bool, cost,
                 capacity_scale: float = 1.0):
        self.layout = layout
        self.buckets = layout.buckets
        self.algorithm = algorithm
        self.average = average
        n = len(layout.grads)
        fwd_g = layout.forward_times if layout.forward_times is not None else [0.0] * n
        sizes = [sum(layout.flat[i].size for i in m) for m in self.buckets]
        itemsizes = [layout.grads[m[0]].dtype.itemsize for m in self.buckets]
        fwd_b = [sum(fwd_g[i] for i in m) for m in self.buckets]
        bwd_b = [sum(layout.compute_times[i] for i in m) for m in self.buckets]
        self.pieces, comm, f, b = split_pieces(sizes, itemsizes, cost, fwd_b, bwd_b)
        self._sched_args = (comm, f, b, float(capacity_scale))
        self.xp = array_module(layout.grads[0])
        self.slots = [[self.xp.empty(s, dtype=layout.grads[m[0]].dtype)
                       for m, s in zip(self.buckets, sizes)] for _ in range(2)]
        # each bucket's layout in its slot buffers: its gradients in memory order when they
        # form one memory range (so that range reduces straight into the slot), else in
        # bucket order
        self._slot_order = [
            sorted(m, key=lambda i: layout.flat[i].__array_interface__["data"][0])
            if layout.views[b] is not None else list(m) for b, m in enumerate(self.buckets)]
        self._bucket_pieces = [[k for k, p in enumerate(self.pieces) if p.bucket == bk]
                               for bk in range(len(self.buckets))]
        self.broken = None
        self._restart(0)

    @property
    def views(self):
        return self.layout.views

    def start_at(self, iteration: int) -> None:
        self._restart(iteration)

    def _restart(self, base):
        comm, f, b, scale = self._sched_args
        self.scheduler = DelayedUpdateScheduler(comm, f, b, capacity_scale=scale)
        self.base = base                   # absolute iteration of the scheduler's iteration 0
        self.t = 0
        self.slot_iters = [(), ()]         # absolute iterations each slot's group holds
        self.current = None                # slot of the group being synchronised
        self.unsent = set()                # its pieces not launched yet
        self.future = 0                    # slot accumulating held iterations
        self.requests = []
        self.began = False

    # ------------------------------------------------------------------ launching
    def _iters(self, rel):
        return tuple(self.base + x for x in rel)

    def _launch(self, k, slot, src=None):
        """Allreduce piece k into `slot`: in place, or out of place from `src` (the bucket's
        gradients, which must then stay unchanged until this step's wait)."""
        p = self.pieces[k]
        buf = self.slots[slot][p.bucket][p.start:p.stop]
        send = buf if src is None else src[p.start:p.stop]
        recv = None if src is None else buf
        self.requests.append(self.layout.comm.Iallreduce(send, recv, op=self.op,
                                                         algorithm=self.algorithm))

    def _launch_current(self, transfers):
        for x in transfers:
            if self._iters(x.iterations) != self.slot_iters[self.current]:
                raise AssertionError("DeFT plan and synchronizer disagree on the current group")
            self._launch(x.bucket, self.current)
            self.unsent.discard(x.bucket)

    def _check(self):
        if self.broken is not None:
            raise Error(f"policy 'deft': a previous wait() failed ({self.broken}); the delayed "
                        f"gradients are lost: create a new GradientSynchronizer")

    def begin_backward(self):
        """Launch the older gradients' transfers of this backward pass (once per step)."""
        self._check()
        if self.began:
            return
        self.began = True
        p = self.scheduler.plan(self.t)
        self._launch_current([x for x in p.backward if self.t not in x.iterations])

    def grad_ready(self, i: int) -> None:
        self.layout.mark_ready(i)
        for b in self.layout.complete_buckets():
            self._bucket_ready(b)

    def _bucket_ready(self, b):
        """Bucket b's gradients are final: add them to the future group; launch its pieces
        that this iteration sends now."""
        self.begin_backward()
        p = self.scheduler.plan(self.t)
        now = [x.bucket for x in p.backward
               if self.t in x.iterations and self.pieces[x.bucket].bucket == b]
        dst = self.slots[self.future][b]
        src = self.layout.views[b]          # the bucket as one memory range, or None
        if not self.slot_iters[self.future] and src is not None:
            # a fresh group and one memory range: the pieces sent now are reduced out of
            # place from the gradients into the slot (no copy); the others are copied
            for k in self._bucket_pieces[b]:
                if k not in now:
                    q = self.pieces[k]
                    dst[q.start:q.stop] = src[q.start:q.stop]
            for k in now:
                self._launch(k, self.future, src)
            return
        off = 0
        for i in self._slot_order[b]:
            f = self.layout.flat[i]
            if self.slot_iters[self.future]:
                dst[off:off + f.size] += f
            else:
                dst[off:off + f.size] = f
            off += f.size
        for k in now:
            self._launch(k, self.future)

    # ------------------------------------------------------------------ completing
    def _wait_all(self, timeout):
        try:
            for r in self.requests:
                r.Wait(timeout=timeout)
        except BaseException as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise
        self.requests = []

    def _apply(self, slots):
        """Write the sum of the groups in `slots` into the gradients; return their iterations."""
        iters = tuple(sorted(x for s in slots for x in self.slot_iters[s]))
        scale = self.layout.comm.size * len(iters) if self.average else 1
        for b, members in enumerate(self._slot_order):
            acc = self.slots[slots[0]][b] if slots else None
            for s in slots[1:]:
                acc += self.slots[s][b]
            off = 0
            for i in members:
                f = self.layout.flat[i]
                if acc is None:
                    f[...] = 0
                elif scale == 1:
                    f[...] = acc[off:off + f.size]
                else:
                    self.xp.divide(acc[off:off + f.size], scale, out=f)
                off += f.size
        for s in slots:
            self.slot_iters[s] = ()
        return iters

    def wait(self, iteration: int, timeout) -> StepResult:
        self.layout.check_all_ready()
        try:
            update, applied = self._finish_step(timeout)
        finally:
            self.layout.reset()
        return StepResult(update, applied, self.buckets, [])   # transfers span iterations

    def _finish_step(self, timeout):
        """Wait for the step's transfers and apply what the plan says: returns ``(update,
        applied iterations)``."""
        self._check()
        self.begin_backward()
        p = self.scheduler.plan(self.t)
        self._wait_all(timeout)
        t_abs = self.base + self.t
        done = []
        if p.case == 2:
            self.slot_iters[self.future] += (t_abs,)
        else:
            if self.current is not None:        # emptied by p.forward (Case 4) or now (Case 3)
                if self.unsent:
                    raise AssertionError("DeFT plan completed a group with unsent pieces")
                done.append(self.current)
            group = self.slot_iters[self.future] + (t_abs,)
            if group != self._iters(p.now_iterations):
                raise AssertionError("DeFT plan and synchronizer disagree on the new group")
            self.slot_iters[self.future] = group
            sent = {x.bucket for x in p.backward if self.t in x.iterations}
            rest = set(range(len(self.pieces))) - sent
            if rest:
                self.current, self.unsent = self.future, rest
            else:
                self.current, self.unsent = None, set()
                done.append(self.future)
            self.future = 1 - self.current if self.current is not None else 0
        applied = self._apply(done)
        expect = self._iters(p.applied_iterations[0]) if p.update else ()
        if applied != expect:
            raise AssertionError(f"DeFT applied {applied}, the plan says {expect}")
        self.scheduler.forget(self.t)      # keep memory bounded over a long run
        self.t += 1
        self.began = False
        if self.current is not None:
            self._launch_current(p.next_forward)
        return bool(done), applied

    def flush(self, timeout) -> tuple[int, ...]:
        self.layout.check_between_steps()
        self._check()
        self._wait_all(timeout)
        if self.current is not None:
            for k in sorted(self.unsent):
                self._launch(k, self.current)
        if self.slot_iters[self.future]:
            for k in range(len(self.pieces)):
                self._launch(k, self.future)
        self._wait_all(timeout)
        slots = [s for s in (self.current, self.future) if s is not None and self.slot_iters[s]]
        applied = self._apply(slots)
        self._restart(self.base + self.t)
        return applied

    @property
    def held_iterations(self) -> tuple[int, ...]:
        return tuple(sorted(x for s in (0, 1) for x in self.slot_iters[s]))


def create(comm, grads, policy: str, average: bool, algorithm: str,
           options: SyncOptions) -> DelayedUpdates:
    """The strategy of policy ``"deft"`` (buckets formed as for ``"fixed"``)."""
    layout = Buckets(comm, grads, policy, average, options)
    layout.need_profile(policy)
    return DelayedUpdates(layout, algorithm, average, layout.cost_fn(), options.capacity_scale)
