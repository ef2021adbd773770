"""Overlap for frameworks: start each gradient bucket's allreduce as soon as its gradients exist
(Aluminum section III-A), with a fusion policy deciding the buckets.

    sync = GradientSynchronizer(comm, grads, policy="adafusion")
    for step in range(n):
        ... forward ...
        for i in reversed(range(len(grads))):     # backward: gradient i is final
            ... compute grads[i] ...
            sync.grad_ready(i)
        info = sync.wait()                        # every gradient holds the average over ranks
        ... optimizer step ...

Buckets are groups of consecutive gradients in backward order (the order they become ready).
A single-gradient bucket is reduced in place; larger buckets are packed into a persistent flat
buffer (allocated once), reduced, and unpacked at ``wait()``. Buckets are launched in bucket
order (a bucket that completes early waits for the ones before it), so every rank issues the same
collectives in the same order even if ``grad_ready`` calls arrive in a different order.

Policies:

* ``"none"``: one nonblocking allreduce per gradient (WFBP).
* ``"fixed"``: Horovod-like: consecutive gradients fused up to ``threshold`` bytes (default
  64 MiB); with ``cycle_time`` (seconds) and ``compute_times`` a bucket also closes once the
  predicted time since its first gradient reaches the cycle time. (Horovod's cycle is a wall-clock
  timer coordinated across ranks; a per-rank timer here would let ranks disagree on the buckets,
  so the prediction from the profile stands in for it.)
* ``"mgwfbp"``: MG-WFBP's merge rule on ``compute_times`` and the allreduce ``cost``.
* ``"adafusion"``: OSF's adaptive fusion (eq. 17) on the profile and ``cost`` (default: the
  cost model); ``channel_aware=True`` also counts the time the channel is still busy with the
  previous bucket (see aluminum_py.planning.osf.adaptive_fusion).
* ``"osf"``: the grouping OSF's timeline predicts fastest for the profile and ``cost``
  (aluminum_py.planning.osf.optimal_groups: exact dynamic programming; never predicted slower
  than WFBP, any fixed threshold or adafusion).
* ``"libra"``: a :class:`aluminum_py.planning.libra.Plan`: its groups, and for GPU gradients its
  per-group ``max_ctas`` (NCCL thread-block limits; host gradients have no thread limits, so only
  the groups apply and ``sync.max_ctas`` is None).
* ``"auto"``: runs the first steps with each candidate grouping in turn (no fusion, fixed
  thresholds, and with a profile ``osf``, channel-aware ``adafusion`` and ``mgwfbp``) and keeps
  the one whose measured steps were fastest (aluminum_py._autotune); ``sync.chosen`` names it
  and ``sync.tuning_report`` gives each candidate's median step time.
* ``"deft"``: DeFT's knapsack scheduling with delayed updates (buckets as ``"fixed"``; the
  plans of aluminum_py.planning.deft.DelayedUpdateScheduler on the profile and ``cost``):
  some buckets are synchronised during the next iteration's forward pass, and ``wait()``
  reports in ``SyncInfo.update`` / ``applied_iterations`` which iterations' gradients the
  arrays now hold (see aluminum_py._delayed).  Call ``flush()`` after the last step.

Profile options (seconds, gradient order of ``grads``): ``compute_times`` (backward time of each
gradient's layer) and ``forward_times``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .errors import Error
from .ops import AVG, SUM

POLICIES = ("none", "fixed", "mgwfbp", "adafusion", "osf", "libra", "deft", "auto")


@dataclass
class SyncInfo:
    """What ``wait()`` returns.

    Attributes:
        iteration: the iteration that was completed.
        applied: per bucket, the newest iteration whose gradients it now holds (``iteration``
            except under policy ``"deft"``; None when no update).
        buckets: per bucket, its gradient indices (model order).
        update: whether the gradients hold synchronised values to apply (always True except
            under ``"deft"``, whose gradients are then zero: skip the optimizer step).
        applied_iterations: per bucket, every iteration whose gradients it holds (``"deft"``
            sums a group of iterations; averaging divides by ranks times their number).
        timings: per bucket, ``(launched, started, completed)`` of its all-reduce this step,
            seconds on the ``time.monotonic()`` clock: when ``grad_ready`` launched it, when
            the progress engine started it and when it completed (see ``Request.times``).
            Empty under ``"deft"`` (its transfers are pieces of several iterations) and for
            GPU gradients (their all-reduces complete on the device stream).
    """

    iteration: int
    applied: list = field(default_factory=list)
    buckets: list = field(default_factory=list)
    update: bool = True
    applied_iterations: list = field(default_factory=list)
    timings: list = field(default_factory=list)


def _array_module(a):
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


class GradientSynchronizer:
    """Averages (or sums) gradients over the ranks of `comm`, overlapping with backward.

    Args:
        comm: an aluminum_py.Communicator.
        grads: arrays (numpy, or GPU arrays for a GPU communicator) in model (forward) order;
            each must stay the same object across steps (they are reduced in place).
        policy: one of POLICIES.
        average: divide by the number of ranks (floating gradients) instead of summing.
        algorithm: allreduce algorithm for every bucket (default "auto").
        threshold, cycle_time: policy "fixed" (threshold: also "deft"'s buckets).
        compute_times, forward_times: per-gradient profile (seconds), for the planned policies.
        cost: allreduce time as a function of bytes (callable), for "mgwfbp" / "adafusion".
        plan: a LIBRA Plan (policy "libra"); groups index layers in backward order.
        groups: explicit buckets (inclusive ranges over backward order) for any policy but
            "none" (overrides the policy's own grouping; used by benchmarks and tests).
        capacity_scale: policy "deft": multiplies DeFT's knapsack capacities (the Preserver's
            feedback; see aluminum_py.planning.deft.tune_capacity).
        candidates: policy "auto": ``(label, policy, options)`` triples to try instead of the
            default list (aluminum_py._autotune.default_candidates).
        tune_steps: policy "auto": ``(warmup, trials)`` rounds; each round runs one step with
            every candidate; warm-up rounds are not measured (default ``(1, 5)``).
    """

    def __init__(self, comm, grads, policy: str = "adafusion", average: bool = True, *,
                 algorithm: str = "auto", threshold: int = 64 << 20, cycle_time=None,
                 compute_times=None, forward_times=None, cost=None, plan=None, groups=None,
                 channel_aware: bool = False, capacity_scale: float = 1.0, candidates=None,
                 tune_steps=(1, 5)):
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self._auto = None
        if policy == "auto":
            from ._autotune import AutoTune, default_candidates
            if groups is not None:
                raise ValueError("groups= fixes the buckets; policy 'auto' chooses them (pass "
                                 "candidates= to choose among explicit groupings)")
            if candidates is None:
                candidates = default_candidates(dict(
                    compute_times=compute_times, forward_times=forward_times, cost=cost,
                    plan=plan))
            self.comm, self.grads, self.policy = comm, list(grads), policy
            self.average, self.algorithm, self.iteration = bool(average), algorithm, 0
            self._deft = None
            self._auto = AutoTune(comm, grads, average, algorithm, candidates, *tune_steps)
            self._follow_auto()
            return
        self.comm = comm
        self.grads = list(grads)
        if not self.grads:
            raise ValueError("grads: empty list")
        self.policy = policy
        self.algorithm = algorithm
        n = len(self.grads)
        for i, g in enumerate(self.grads):
            if not g.flags.c_contiguous:
                raise ValueError(f"grads[{i}] is not C-contiguous (it is reduced in place)")
        self._flat = [g.reshape(-1) for g in self.grads]      # views
        kinds = {np.dtype(g.dtype).kind for g in self.grads}
        if average and not kinds <= {"f", "c"}:
            raise ValueError("average=True needs floating-point gradients; pass average=False")
        self.average = bool(average)
        self.op = AVG if average else SUM
        self._sum_op = SUM
        self.nbytes_bw = [self._flat[n - 1 - k].nbytes for k in range(n)]   # backward order
        self.compute_times = None if compute_times is None else list(compute_times)
        self.forward_times = None if forward_times is None else list(forward_times)
        for name, v in (("compute_times", self.compute_times), ("forward_times", self.forward_times)):
            if v is not None and len(v) != n:
                raise ValueError(f"{name}: {len(v)} values for {n} gradients")
        self.max_ctas = None
        self._cost = cost
        self._channel_aware = channel_aware
        if groups is not None:
            bw_groups = [tuple(g) for g in groups]
        else:
            bw_groups = self._plan_groups(policy, threshold, cycle_time, plan)
        self._check_groups(bw_groups, n)
        bw_groups = self._split_by_dtype(bw_groups)
        # buckets: lists of gradient indices (model order), in launch order
        self.buckets = [[n - 1 - k for k in range(f, l + 1)] for f, l in bw_groups]
        self._bucket_of = {}
        for b, members in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = b
        # per bucket: its gradients as one flat array when they are one memory range (a single
        # gradient, or adjacent ones: allocate them with gradient_arena), reduced in place
        # without copies; else a persistent fusion buffer (allocated once)
        self._buffers, self._views = [], []
        for members in self.buckets:
            view = self._flat[members[0]] if len(members) == 1 else self._adjacent_view(members)
            self._views.append(view)
            if view is not None or policy == "deft":
                self._buffers.append(None)
            else:
                xp = _array_module(self.grads[members[0]])
                total = sum(self._flat[i].size for i in members)
                self._buffers.append(xp.empty(total, dtype=self.grads[members[0]].dtype))
        if policy == "libra" and plan is not None and _array_module(self.grads[0]) is not np:
            self.max_ctas = plan.max_ctas()
        self._check_same_buckets()
        self._deft = None
        if policy == "deft":
            from ._delayed import DelayedUpdates
            self._need_profile(policy)
            self._deft = DelayedUpdates(self, self._cost_fn(), capacity_scale)
        self.iteration = 0
        self._reset()

    # ------------------------------------------------------------------ planning
    def _need_profile(self, policy):
        if self.compute_times is None:
            raise ValueError(f"policy {policy!r} needs compute_times (backward seconds per gradient)")

    def _cost_fn(self):
        if self._cost is not None:
            return self._cost
        from .algorithms import model_choice, model_time
        p = self.comm.size

        def cost(nbytes):           # the cost model's best algorithm
            return model_time(model_choice(p, nbytes), p, nbytes) if nbytes > 0 else 0.0
        return cost

    def _plan_groups(self, policy, threshold, cycle_time, plan):
        n = len(self.grads)
        if policy == "none":
            return [(k, k) for k in range(n)]
        if policy in ("fixed", "deft"):
            ready = None
            if cycle_time is not None:
                if self.compute_times is None:
                    raise ValueError("cycle_time: needs compute_times to predict ready times")
                ready = np.cumsum(self.compute_times[::-1])
            return _threshold_groups(self.nbytes_bw, threshold, ready, cycle_time)
        if policy == "mgwfbp":
            from .planning.libra import mgwfbp_groups
            self._need_profile(policy)
            cost = self._cost_fn()
            startup = float(cost(1))
            nb = self.nbytes_bw
            return mgwfbp_groups(self.compute_times[::-1],
                                 lambda f, l: float(cost(sum(nb[f:l + 1]))), startup)
        if policy in ("adafusion", "osf"):
            from .planning import osf
            self._need_profile(policy)
            fwd = self.forward_times if self.forward_times is not None else [0.0] * n
            args = (fwd, self.compute_times, [f.nbytes for f in self._flat], self._cost_fn())
            if policy == "osf":
                return [tuple(g) for g in osf.optimal_groups(*args)]
            return [tuple(g) for g in osf.adaptive_fusion(*args,
                                                          channel_aware=self._channel_aware)]
        if policy == "libra":
            if plan is None:
                raise ValueError("policy 'libra' needs plan= (aluminum_py.planning.libra.Plan)")
            return [tuple(g) for g in plan.groups]
        raise AssertionError(policy)

    def _adjacent_view(self, members):
        """A flat view covering the bucket's gradients if they tile one memory range of a
        common base array (host arrays from gradient_arena), else None."""
        if len(members) < 2 or _array_module(self.grads[members[0]]) is not np:
            return None
        flats = [self._flat[i] for i in members]
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
        from .ops import MAX, MIN
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
    def _reset(self):
        self._ready = [False] * len(self.grads)
        self._pending = [len(m) for m in self.buckets]
        self._next = 0
        self._requests = [None] * len(self.buckets)
        self._launched = [0.0] * len(self.buckets)

    # ------------------------------------------------------------------ policy "auto"
    def _follow_auto(self):
        """Mirror the candidate that runs the next step (its buckets, options, op)."""
        s = self._auto.active
        self.buckets, self.max_ctas, self.op = s.buckets, s.max_ctas, s.op

    @property
    def chosen(self) -> str | None:
        """Policy "auto": the label of the candidate kept, None while tuning (and for the
        other policies)."""
        a = self._auto
        return None if a is None or a.chosen is None else a.labels[a.chosen]

    @property
    def tuning_report(self) -> dict | None:
        """Policy "auto", once chosen: candidate label -> median step seconds (max over
        ranks)."""
        return None if self._auto is None else self._auto.report

    def grad_ready(self, i: int) -> None:
        """Gradient i (model order) is final for this step; launches every bucket that is now
        complete, in bucket order."""
        if self._auto is not None:
            return self._auto.active.grad_ready(i)
        if not 0 <= i < len(self.grads):
            raise ValueError(f"i: {i} is not a gradient index (0..{len(self.grads) - 1})")
        if self._ready[i]:
            raise Error(f"grad_ready({i}) called twice in one step")
        self._ready[i] = True
        b = self._bucket_of[i]
        self._pending[b] -= 1
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            if self._deft is not None:
                self._deft.bucket_ready(self._next)
            else:
                self._launch(self._next)
            self._next += 1

    def begin_backward(self) -> None:
        """Optional, policy "deft": the backward pass starts now, so the older gradients this
        backward pass sends are launched now rather than at the first ``grad_ready``."""
        if self._auto is not None:
            return self._auto.active.begin_backward()
        if self._deft is not None:
            self._deft.begin_backward()

    def _launch(self, b):
        members = self.buckets[b]
        kw = {}
        if self.max_ctas is not None:
            kw["max_ctas"] = self.max_ctas[b]
        if self._views[b] is not None:
            buf = self._views[b]
        else:
            buf = self._buffers[b]
            off = 0
            for i in members:
                f = self._flat[i]
                buf[off:off + f.size] = f
                off += f.size
        self._launched[b] = time.monotonic()
        self._requests[b] = self.comm.Iallreduce(buf, op=self.op, algorithm=self.algorithm, **kw)

    def wait(self, timeout=None) -> SyncInfo:
        """Wait for every bucket; afterwards every gradient holds the result. Raises if some
        gradient was never reported ready this step."""
        if self._auto is not None:
            info = self._auto.wait(timeout)
            info.iteration = self.iteration
            info.applied = [self.iteration] * len(info.buckets)
            info.applied_iterations = [(self.iteration,)] * len(info.buckets)
            self.iteration += 1
            self._follow_auto()
            return info
        missing = [i for i, r in enumerate(self._ready) if not r]
        if missing:
            raise Error(f"wait(): gradients {missing[:8]} were never reported with grad_ready")
        if self._deft is not None:
            try:
                update, iters = self._deft.wait(timeout)
            finally:
                self._reset()
            return self._info(update, iters)
        try:
            for b, req in enumerate(self._requests):
                req.Wait(timeout=timeout)
                if self._buffers[b] is not None:
                    buf, off = self._buffers[b], 0
                    for i in self.buckets[b]:
                        f = self._flat[i]
                        f[...] = buf[off:off + f.size]
                        off += f.size
        except BaseException:
            self._reset()           # the next step starts clean; pending ops keep their buffers
            raise
        times = [getattr(r, "times", None) for r in self._requests]   # GPU requests: none
        timings = ([(t,) + r for t, r in zip(self._launched, times)]
                   if all(r is not None for r in times) else [])
        self._reset()
        return self._info(True, (self.iteration,), timings=timings)

    def _info(self, update, iters, advance=True, timings=()):
        nb = len(self.buckets)
        info = SyncInfo(self.iteration if advance else self.iteration - 1,
                        [iters[-1] if iters else None] * nb, [list(m) for m in self.buckets],
                        update, [tuple(iters)] * nb, list(timings))
        self.iteration += advance
        return info

    def flush(self, timeout=None) -> SyncInfo:
        """Policy "deft": synchronise every gradient still held (delayed) and write their
        average (or sum) into the gradient arrays; call it after the last ``wait()`` of a
        training run (collective).  ``update`` is False, with zeroed gradients, when nothing
        was held.  Other policies hold nothing: it returns at once with ``update=False``."""
        if self._auto is not None:
            self._auto.active.flush(timeout)
            return self._info(False, (), advance=False)
        if any(self._ready):
            raise Error("flush(): called in the middle of a step (after grad_ready, before wait)")
        if self._deft is None:
            return self._info(False, (), advance=False)
        iters = self._deft.flush(timeout)
        return self._info(bool(iters), iters, advance=False)

    @property
    def held_iterations(self) -> tuple:
        """Iterations whose gradients have not been applied yet (policy "deft")."""
        return self._deft.held_iterations if self._deft is not None else ()


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
