"""Planning without a given profile: a planned policy (``mgwfbp``, ``adafusion``, ``osf``,
``libra``, ``deft``) constructed without ``compute_times`` (``libra``: without ``plan``) first
runs as policy ``"none"`` (one allreduce per gradient: results exact), measures the backward pass
from the ``grad_ready`` timestamps of its first steps, and then builds the policy's strategy from
what it measured (docs/overlap.md, "Without a profile").

How a step is read (every rank the same way, then the maximum over ranks, so every rank plans
the same buckets):

* The gradients' backward compute times, in backward order: the time between one gradient's
  ``grad_ready`` and the previous one's (0 when a gradient arrives before its predecessor).
* The first gradient of the backward pass: from ``begin_backward()`` when the caller calls it,
  and then everything since the previous ``wait()`` returned is the forward time (the optimizer
  step and the forward pass, as DeFT counts it). Otherwise the interval ``D`` from the previous
  ``wait()`` to the first ``grad_ready`` is split by the usual rule that the backward pass takes
  about twice the forward pass: with ``B`` the rest of the backward pass, the first gradient
  gets ``(2D - B) / 3`` (clipped to ``[0, D]``) and the forward pass the rest of ``D``.
* The forward time is spread over the gradients in proportion to their bytes.
* Per gradient, the median over the measured steps (the first ``wait()`` has no predecessor,
  so the first step is always a warm-up).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np

from ..ops import MAX
from .buckets import create as bucketed
from .strategy import Delegating, StepResult, SyncOptions

_now = time.monotonic          # the clock (a module attribute so tests can drive it)
_log = logging.getLogger("aluminum_py")

PLANNED = ("mgwfbp", "adafusion", "osf", "libra", "deft")


@dataclass(frozen=True)
class Profile:
    """The per-gradient profile a planned policy planned from (``GradientSynchronizer.profile``).

    Attributes:
        compute_times: backward seconds per gradient (model order).
        forward_times: forward seconds per gradient (model order), or None when not known.
        measured: True when the synchronizer measured it, False when it was given.
        steps: steps measured (0 when given).
        error: why the policy could not be planned from the measurement (it then keeps
            running as ``"none"``), else None.
    """

    compute_times: tuple
    forward_times: tuple | None
    measured: bool
    steps: int = 0
    error: str | None = None


def needs_measuring(policy: str, options: SyncOptions) -> bool:
    """Whether `policy` must measure its profile first (no ``compute_times``; ``libra``: no
    ``plan`` either)."""
    if policy not in PLANNED or options.compute_times is not None or options.groups is not None:
        return False
    return policy != "libra" or options.plan is None


def libra_plan(comm, grads, options: SyncOptions):
    """A LIBRA plan from a profile: ``planning.libra.optimize`` under
    ``ContentionModel.example`` for the communicator's size (GPU thread counts matter only for
    GPU gradients; for host gradients only the groups are used)."""
    from ..planning import libra
    from ..planning.contention import ContentionModel
    n = len(grads)
    nbytes = [int(grads[n - 1 - k].nbytes) for k in range(n)]            # backward order
    compute = [float(options.compute_times[n - 1 - k]) for k in range(n)]
    return libra.optimize(nbytes, compute, ContentionModel.example(nranks=max(1, comm.size)))


def measure(ready, began, last, nbytes):
    """One step's ``(compute_times, forward_total)`` (model order) from the ready times of the
    gradients, ``begin_backward``'s time (or None) and the previous ``wait()``'s return."""
    n = len(ready)
    compute = [0.0] * n
    prev = None
    for i in reversed(range(n)):                      # backward order
        if prev is not None:
            compute[i] = max(0.0, ready[i] - prev)
        prev = ready[i] if prev is None else max(prev, ready[i])
    first = n - 1
    if began is not None and began <= ready[first]:
        compute[first] = ready[first] - began
        forward = max(0.0, began - last)
    else:
        d = max(0.0, ready[first] - last)
        rest = sum(compute[:first])
        compute[first] = min(d, max(0.0, (2.0 * d - rest) / 3.0))
        forward = d - compute[first]
    return compute, forward


class MeasureThenPlan(Delegating):
    """Runs as policy ``"none"`` while measuring, then as the planned policy.

    Attributes:
        planned: the planned policy's strategy, None while measuring.
        profile: the :class:`Profile`, None while measuring.
    """

    def __init__(self, comm, grads, policy, average, algorithm, options: SyncOptions, build,
                 steps=(1, 3)):
        warmup, trials = (int(x) for x in steps)
        if warmup < 0 or trials < 1:
            raise ValueError(f"profile_steps: need warmup >= 0 and trials >= 1, got {warmup}, "
                             f"{trials}")
        self.comm, self.grads, self.policy = comm, list(grads), policy
        self.average, self.algorithm, self.options, self._build = average, algorithm, options, build
        self.measuring = bucketed(comm, self.grads, "none", average, algorithm, SyncOptions())
        self.planned = None
        self.profile = None
        self._warmup = max(1, warmup)       # the first step has no previous wait()
        self._total = self._warmup + trials
        self._step = 0
        self._samples = []                  # per measured step: compute times + [forward]
        self._nbytes = [int(g.nbytes) for g in self.grads]
        self._new_step()
        self._last = None

    def _new_step(self):
        self._ready = [None] * len(self.grads)
        self._began = None

    @property
    def active(self):
        return self.planned if self.planned is not None else self.measuring

    def grad_ready(self, i: int) -> None:
        if self.planned is None and 0 <= i < len(self._ready) and self._ready[i] is None:
            self._ready[i] = _now()
        self.active.grad_ready(i)

    def begin_backward(self) -> None:
        if self.planned is None and self._began is None:
            self._began = _now()
        self.active.begin_backward()

    def wait(self, iteration: int, timeout) -> StepResult:
        if self.planned is not None:
            return self.planned.wait(iteration, timeout)
        try:
            result = self.measuring.wait(iteration, timeout)
        except BaseException:
            self._new_step()
            self._last = None               # the next step has no clean start: not measured
            raise
        now = _now()
        if self.profile is None:            # still measuring (not: planning failed)
            if self._last is not None and self._step >= self._warmup:
                compute, forward = measure(self._ready, self._began, self._last, self._nbytes)
                self._samples.append(compute + [forward])
            self._step += 1
            if len(self._samples) == self._total - self._warmup:
                self._plan(iteration + 1)
        self._last = now
        self._new_step()
        return result

    def _plan(self, next_iteration):
        """Agree on the profile (maximum over ranks), then build the policy's strategy."""
        med = np.median(np.array(self._samples, dtype=np.float64), axis=0)
        self.comm.Allreduce(med, op=MAX, algorithm="mpi")
        compute, forward = [float(x) for x in med[:-1]], float(med[-1])
        given_fwd = self.options.forward_times
        if given_fwd is None:
            total = float(sum(self._nbytes)) or 1.0
            fwd = tuple(forward * b / total for b in self._nbytes)
        else:
            fwd = tuple(float(x) for x in given_fwd)
        opts = replace(self.options, compute_times=tuple(compute), forward_times=fwd)
        try:
            if self.policy == "libra":
                opts = replace(opts, plan=libra_plan(self.comm, self.grads, opts))
            strategy = self._build(self.comm, self.grads, self.policy, self.average,
                                   self.algorithm, opts)
        except ValueError as e:
            # e.g. DeFT cannot hide one element's allreduce under the measured compute: keep
            # running as "none" (exact), and say why
            _log.warning("policy %r: cannot plan from the measured profile (%s); running as "
                         "'none'", self.policy, e)
            self.profile = Profile(tuple(compute), fwd, True, len(self._samples), str(e))
            return
        strategy.start_at(next_iteration)
        self.planned = strategy
        self.profile = Profile(tuple(compute), fwd, True, len(self._samples))
        self.measuring = None               # its buffers go


def create(comm, grads, policy: str, average: bool, algorithm: str, options: SyncOptions,
           build, steps=(1, 3)) -> MeasureThenPlan:
    """The strategy of a planned policy that has no profile: `build` (the policy's own
    ``create``) is called with the measured profile after `steps` = ``(warmup, measured)``
    steps."""
    return MeasureThenPlan(comm, grads, policy, average, algorithm, options, build, steps)
