"""Gradient buckets and the bucketed strategy: a policy's grouping of consecutive gradients
(backward order) into buckets, identical on every rank (:class:`Buckets`, which also tracks
which gradients are ready in the current step), and :class:`BucketedStrategy`, one nonblocking
all-reduce per bucket, launched in bucket order as soon as the bucket is complete.

A bucket that is one memory range (a single gradient, or adjacent views from
:func:`gradient_arena`) is reduced in place; any other bucket is packed into a persistent fusion
buffer (allocated once) and unpacked at ``wait()``.
"""
from __future__ import annotations

import time

import numpy as np

from ..errors import Error
from ..ops import AVG, MAX, MIN, SUM
from .strategy import Strategy, StepResult, SyncOptions

BUCKET_POLICIES = ("none", "fixed", "mgwfbp", "adafusion", "osf", "libra")


def array_module(a):
    """numpy, or cupy for a GPU array."""
    if hasattr(a, "__cuda_array_interface__"):
        import cupy
        return cupy
    return np


def _threshold_groups(nbytes, threshold, ready_times=None, cycle_time=None):
    groups, start, acc = [], 0, 0
    for i, n in enumerate(nbytes):
        acc += n
        timed_out = (cycle_time is not None and ready_times is not None
                     and ready_times[i] - ready_times[start] >= cycle_time)
        if acc >= threshold or timed_out:
            groups.append((start, i))
            start, acc = i + 1, 0
    if start < len(nbytes):
        groups.append((start, len(nbytes) - 1))
    return groups


def gradient_arena(shapes, dtype=np.float32):
    """Gradient arrays (model order) that are views into one flat array, so every bucket of
    consecutive gradients is one contiguous range and is reduced in place without packing
    (as PyTorch DDP's gradient_as_bucket_view). Returns (arena, grads)."""
    sizes = [int(np.prod(s)) for s in shapes]
    arena = np.zeros(sum(sizes), dtype=dtype)
    grads, off = [], 0
    for shape, n in zip(shapes, sizes):
        grads.append(arena[off:off + n].reshape(shape))
        off += n
    return arena, grads


class Buckets:
    """The gradients of one synchronizer, grouped into buckets by `policy` (``"deft"``: as
    ``"fixed"``), and which of them are ready in the current step.

    Attributes:
        comm, grads: as given to the synchronizer; ``flat``: each gradient as a flat view.
        compute_times, forward_times: the profile (seconds per gradient, model order) or None.
        buckets: per bucket (launch order), its gradient indices (model order).
        views: per bucket, one flat array covering its gradients when they are one memory
            range, else None.

    Raises ValueError for bad gradients or options, and :class:`~aluminum_py.Error` when the
    ranks formed different buckets (the check is collective).
    """

    def __init__(self, comm, grads, policy: str, average: bool, options: SyncOptions):
        self.comm = comm
        self.grads = list(grads)
        if not self.grads:
            raise ValueError("grads: empty list")
        n = len(self.grads)
        for i, g in enumerate(self.grads):
            if not g.flags.c_contiguous:
                raise ValueError(f"grads[{i}] is not C-contiguous (it is reduced in place)")
        self.flat = [g.reshape(-1) for g in self.grads]      # views
        kinds = {np.dtype(g.dtype).kind for g in self.grads}
        if average and not kinds <= {"f", "c"}:
            raise ValueError("average=True needs floating-point gradients; pass average=False")
        self.nbytes_bw = [self.flat[n - 1 - k].nbytes for k in range(n)]   # backward order
        ct, ft = options.compute_times, options.forward_times
        self.compute_times = None if ct is None else list(ct)
        self.forward_times = None if ft is None else list(ft)
        for name, v in (("compute_times", self.compute_times),
                        ("forward_times", self.forward_times)):
            if v is not None and len(v) != n:
                raise ValueError(f"{name}: {len(v)} values for {n} gradients")
        self._cost = options.cost
        if options.groups is not None:
            bw_groups = [tuple(g) for g in options.groups]
        else:
            bw_groups = self._plan_groups(policy, options)
        self._check_groups(bw_groups, n)
        bw_groups = self._split_by_dtype(bw_groups)
        self.buckets = [[n - 1 - k for k in range(f, l + 1)] for f, l in bw_groups]
        self._bucket_of = {}
        for b, members in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = b
        self.views = [self.flat[m[0]] if len(m) == 1 else self._adjacent_view(m)
                      for m in self.buckets]
        self._check_same_buckets()
        self.reset()

    # ------------------------------------------------------------------ planning
    def need_profile(self, policy):
        if self.compute_times is None:
            raise ValueError(f"policy {policy!r} needs compute_times "
                             f"(backward seconds per gradient)")

    def cost_fn(self):
        """The all-reduce seconds of a byte count: the given ``cost``, else the cost model's
        best algorithm."""
        if self._cost is not None:
            return self._cost
        from ..algorithms import model_choice, model_time
        p = self.comm.size

        def cost(nbytes):           # the cost model's best algorithm
            return model_time(model_choice(p, nbytes), p, nbytes) if nbytes > 0 else 0.0
        return cost

    def _plan_groups(self, policy, options):
        n = len(self.grads)
        if policy == "none":
            return [(k, k) for k in range(n)]
        if policy in ("fixed", "deft"):
            ready = None
            if options.cycle_time is not None:
                if self.compute_times is None:
                    raise ValueError("cycle_time: needs compute_times to predict ready times")
                ready = np.cumsum(self.compute_times[::-1])
            return _threshold_groups(self.nbytes_bw, options.threshold, ready, options.cycle_time)
        if policy == "mgwfbp":
            from ..planning.libra import mgwfbp_groups
            self.need_profile(policy)
            cost = self.cost_fn()
            startup = float(cost(1))
            nb = self.nbytes_bw
            return mgwfbp_groups(self.compute_times[::-1],
                                 lambda f, l: float(cost(sum(nb[f:l + 1]))), startup)
        if policy in ("adafusion", "osf"):
            from ..planning import osf
            self.need_profile(policy)
            fwd = self.forward_times if self.forward_times is not None else [0.0] * n
            args = (fwd, self.compute_times, [f.nbytes for f in self.flat], self.cost_fn())
            if policy == "osf":
                return [tuple(g) for g in osf.optimal_groups(*args)]
            return [tuple(g) for g in osf.adaptive_fusion(*args,
                                                          channel_aware=options.channel_aware)]
        if policy == "libra":
            if options.plan is None:
                raise ValueError("policy 'libra' needs plan= (aluminum_py.planning.libra.Plan)")
            return [tuple(g) for g in options.plan.groups]
        raise AssertionError(policy)

    def _adjacent_view(self, members):
        """A flat view covering the bucket's gradients if they tile one memory range of a
        common base array (host arrays from gradient_arena), else None."""
        if len(members) < 2 or array_module(self.grads[members[0]]) is not np:
            return None
        flats = [self.flat[i] for i in members]
        base = flats[0].base if flats[0].base is not None else flats[0]
        while getattr(base, "base", None) is not None:
            base = base.base
        spans = sorted((f.__array_interface__["data"][0], f.nbytes) for f in flats)
        for (a, n), (b, _) in zip(spans, spans[1:]):
            if a + n != b:
                return None
        start, total = spans[0][0], sum(n for _, n in spans)
        if not isinstance(base, np.ndarray) or not base.flags.c_contiguous:
            return None
        b0 = base.__array_interface__["data"][0]
        if not (b0 <= start and start + total <= b0 + base.nbytes):
            return None
        flat = base.reshape(-1).view(np.uint8)[start - b0:start - b0 + total]
        return flat.view(flats[0].dtype)

    def _check_same_buckets(self):
        """Every rank must form the same buckets (or the allreduces would not match): compare a
        fingerprint of the bucket boundaries across ranks (two small allreduces, collective)."""
        h = 0
        for b in self.buckets:
            h = (h * 1000003 + len(b) * 7919 + b[0]) % (1 << 61)
        mine = np.array([len(self.buckets), h], dtype=np.int64)
        hi, lo = mine.copy(), mine.copy()
        self.comm.Allreduce(hi, op=MAX, algorithm="mpi")
        self.comm.Allreduce(lo, op=MIN, algorithm="mpi")
        if not (np.array_equal(hi, mine) and np.array_equal(lo, mine)):
            raise Error("the ranks formed different gradient buckets (different profiles, "
                        "plans or gradient lists?); every rank must pass the same ones")

    def _split_by_dtype(self, groups):
        """Buckets hold one dtype: a group whose gradients differ in dtype is split there."""
        n = len(self.grads)
        out = []
        for f, l in groups:
            start = f
            for k in range(f + 1, l + 1):
                if self.grads[n - 1 - k].dtype != self.grads[n - k].dtype:
                    out.append((start, k - 1))
                    start = k
            out.append((start, l))
        return out

    @staticmethod
    def _check_groups(groups, n):
        expect = 0
        for f, l in groups:
            if f != expect or l < f:
                raise ValueError(f"groups: {groups} do not cover gradients 0..{n - 1} "
                                 f"(backward order) in order")
            expect = l + 1
        if expect != n:
            raise ValueError(f"groups: {groups} do not cover gradients 0..{n - 1} in order")

    # ------------------------------------------------------------------ one step
    def reset(self):
        """A new step: no gradient ready."""
        self._ready = [False] * len(self.grads)
        self._pending = [len(m) for m in self.buckets]
        self._next = 0

    def mark_ready(self, i: int) -> None:
        """Gradient i (model order) is final for this step."""
        if not 0 <= i < len(self.grads):
            raise ValueError(f"i: {i} is not a gradient index (0..{len(self.grads) - 1})")
        if self._ready[i]:
            raise Error(f"grad_ready({i}) called twice in one step")
        self._ready[i] = True
        self._pending[self._bucket_of[i]] -= 1

    def complete_buckets(self):
        """Yields, in bucket order, every bucket that is complete and not yielded yet this step
        and whose predecessors all are; a bucket counts as yielded once the consumer's work on
        it returns (every rank then launches the same buckets in the same order)."""
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            yield self._next
            self._next += 1

    def check_all_ready(self):
        missing = [i for i, r in enumerate(self._ready) if not r]
        if missing:
            raise Error(f"wait(): gradients {missing[:8]} were never reported with grad_ready")

    def check_between_steps(self):
        if any(self._ready):
            raise Error("flush(): called in the middle of a step (after grad_ready, before wait)")


class BucketedStrategy(Strategy):
    """One nonblocking all-reduce per bucket (policies of :data:`BUCKET_POLICIES`).

    Attributes (besides :class:`Strategy`'s): ``layout`` (the :class:`Buckets`), ``buffers``
    (per bucket, its fusion buffer, or None when the bucket is reduced in place).
    """

    def __init__(self, layout: Buckets, op, algorithm: str, max_ctas=None):
        self.layout = layout
        self.buckets = layout.buckets
        self.op = op
        self.algorithm = algorithm
        self.max_ctas = max_ctas
        self.buffers = []
        for members, view in zip(layout.buckets, layout.views):
            if view is not None:
                self.buffers.append(None)
            else:
                xp = array_module(layout.grads[members[0]])
                total = sum(layout.flat[i].size for i in members)
                self.buffers.append(xp.empty(total, dtype=layout.grads[members[0]].dtype))
        self._reset()

    @property
    def views(self):
        return self.layout.views

    def _reset(self):
        self.layout.reset()
        self._requests = [None] * len(self.buckets)
        self._launched = [0.0] * len(self.buckets)

    def grad_ready(self, i: int) -> None:
        self.layout.mark_ready(i)
        for b in self.layout.complete_buckets():
            self._launch(b)

    def _launch(self, b):
        kw = {}
        if self.max_ctas is not None:
            kw["max_ctas"] = self.max_ctas[b]
        if self.layout.views[b] is not None:
            buf = self.layout.views[b]
        else:
            buf = self.buffers[b]
            off = 0
            for i in self.buckets[b]:
                f = self.layout.flat[i]
                buf[off:off + f.size] = f
                off += f.size
        self._launched[b] = time.monotonic()
        self._requests[b] = self.layout.comm.Iallreduce(buf, op=self.op,
                                                        algorithm=self.algorithm, **kw)

    def wait(self, iteration: int, timeout) -> StepResult:
        self.layout.check_all_ready()
        try:
            for b, req in enumerate(self._requests):
                req.Wait(timeout=timeout)
                if self.buffers[b] is not None:
                    buf, off = self.buffers[b], 0
                    for i in self.buckets[b]:
                        f = self.layout.flat[i]
                        f[...] = buf[off:off + f.size]
                        off += f.size
        except BaseException:
            self._reset()           # the next step starts clean; pending ops keep their buffers
            raise
        times = [getattr(r, "times", None) for r in self._requests]   # GPU requests: none
        timings = ([(t,) + r for t, r in zip(self._launched, times)]
                   if all(r is not None for r in times) else [])
        self._reset()
        return StepResult(True, (iteration,), self.buckets, timings)

    def flush(self, timeout) -> tuple[int, ...]:
        self.layout.check_between_steps()
        return ()                   # nothing is ever held


def create(comm, grads, policy: str, average: bool, algorithm: str,
           options: SyncOptions) -> BucketedStrategy:
    """The strategy of a policy of :data:`BUCKET_POLICIES`."""
    layout = Buckets(comm, grads, policy, average, options)
    max_ctas = None
    if policy == "libra" and options.plan is not None and array_module(grads[0]) is not np:
        max_ctas = options.plan.max_ctas()     # host gradients have no thread limits
    return BucketedStrategy(layout, AVG if average else SUM, algorithm, max_ctas)
