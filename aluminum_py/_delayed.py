"""DeFT's delayed updates inside the GradientSynchronizer (policy ``"deft"``).

The plans come from :class:`aluminum_py.planning.deft.DelayedUpdateScheduler` (the four cases of
DeFT section III-B); this module carries them out on real buffers with real nonblocking
allreduces:

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

from .errors import Error


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


class DelayedUpdates:
    """The DeFT runtime of one GradientSynchronizer (see the module docstring)."""

    def __init__(self, sync, cost, capacity_scale=1.0):
        self.sync = sync
        n = len(sync.grads)
        fwd_g = sync.forward_times if sync.forward_times is not None else [0.0] * n
        sizes = [sum(sync._flat[i].size for i in m) for m in sync.buckets]
        itemsizes = [sync.grads[m[0]].dtype.itemsize for m in sync.buckets]
        fwd_b = [sum(fwd_g[i] for i in m) for m in sync.buckets]
        bwd_b = [sum(sync.compute_times[i] for i in m) for m in sync.buckets]
        self.pieces, comm, f, b = split_pieces(sizes, itemsizes, cost, fwd_b, bwd_b)
        self._sched_args = (comm, f, b, float(capacity_scale))
        from .overlap import _array_module
        self.xp = _array_module(sync.grads[0])
        self.slots = [[self.xp.empty(s, dtype=sync.grads[m[0]].dtype)
                       for m, s in zip(sync.buckets, sizes)] for _ in range(2)]
        # each bucket's layout in its slot buffers: its gradients in memory order when they
        # form one memory range (so that range reduces straight into the slot), else in
        # bucket order
        self._layout = [sorted(m, key=lambda i: sync._flat[i].__array_interface__["data"][0])
                        if sync._views[b] is not None else list(m)
                        for b, m in enumerate(sync.buckets)]
        self._bucket_pieces = [[k for k, p in enumerate(self.pieces) if p.bucket == bk]
                               for bk in range(len(sync.buckets))]
        self.broken = None
        self._restart(0)

    def _restart(self, base):
        from .planning.deft import DelayedUpdateScheduler
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
        self.requests.append(self.sync.comm.Iallreduce(send, recv, op=self.sync._sum_op,
                                                       algorithm=self.sync.algorithm))

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

    def bucket_ready(self, b):
        """Bucket b's gradients are final: add them to the future group; launch its pieces
        that this iteration sends now."""
        self.begin_backward()
        sync = self.sync
        p = self.scheduler.plan(self.t)
        now = [x.bucket for x in p.backward
               if self.t in x.iterations and self.pieces[x.bucket].bucket == b]
        dst = self.slots[self.future][b]
        src = self.sync._views[b]           # the bucket as one memory range, or None
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
        for i in self._layout[b]:
            f = sync._flat[i]
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
        sync = self.sync
        iters = tuple(sorted(x for s in slots for x in self.slot_iters[s]))
        scale = sync.comm.size * len(iters) if sync.average else 1
        for b, members in enumerate(self._layout):
            acc = self.slots[slots[0]][b] if slots else None
            for s in slots[1:]:
                acc += self.slots[s][b]
            off = 0
            for i in members:
                f = sync._flat[i]
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

    def wait(self, timeout):
        """Finish the step: returns ``(update, applied iterations)``."""
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

    def flush(self, timeout):
        """Synchronise and apply everything held; returns the applied iterations."""
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
    def held_iterations(self):
        """Iterations whose gradients are not applied yet."""
        return tuple(sorted(x for s in (0, 1) for x in self.slot_iters[s]))
