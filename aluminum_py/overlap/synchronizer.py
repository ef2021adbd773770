"""The gradient synchronizer's front: :class:`GradientSynchronizer`, whose policy chooses, once,
the strategy that does the work (:mod:`.buckets`, :mod:`.autotune`, :mod:`.delayed`), and the
:class:`SyncInfo` its ``wait()`` returns."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .. import timeline
from . import autotune, buckets, delayed, profiled
from .strategy import Strategy, SyncOptions

POLICIES = buckets.BUCKET_POLICIES + ("deft", "auto")

# policy -> the function that builds its strategy (every other policy: bucketed)
_STRATEGIES = {"deft": delayed.create, "auto": autotune.create}


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


class GradientSynchronizer:
    """Averages (or sums) gradients over the ranks of `comm`, overlapping with backward
    (docs/overlap.md).

    Args:
        comm: an aluminum_py.Communicator.
        grads: arrays (numpy, or GPU arrays for a GPU communicator) in model (forward) order;
            each must stay the same object across steps (they are reduced in place).
        policy: one of POLICIES (default ``"auto"``, the recommended one).
        average: divide by the number of ranks (floating gradients) instead of summing.
        algorithm: allreduce algorithm for every bucket (default "auto").
        threshold, cycle_time: policy "fixed" (threshold: also "deft"'s buckets).
        compute_times, forward_times: per-gradient profile (seconds), for the planned policies
            (``mgwfbp``, ``adafusion``, ``osf``, ``libra``, ``deft``). Without
            ``compute_times`` they measure it: the first ``sum(profile_steps)`` steps run as
            ``"none"`` (results exact), then the policy plans from the measurement
            (:attr:`profile`; aluminum_py.overlap.profiled).
        cost: allreduce time as a function of bytes (callable), for "mgwfbp" / "adafusion".
        plan: a LIBRA Plan (policy "libra"); groups index layers in backward order. Without
            one, "libra" plans with ``planning.libra.optimize`` from the profile.
        groups: explicit buckets (inclusive ranges over backward order) for any policy but
            "none" (overrides the policy's own grouping; used by benchmarks and tests).
        channel_aware: policy "adafusion": also count the time the channel is still busy with
            the previous bucket (aluminum_py.planning.osf.adaptive_fusion).
        capacity_scale: policy "deft": multiplies DeFT's knapsack capacities (the Preserver's
            feedback; see aluminum_py.planning.deft.tune_capacity).
        candidates: policy "auto": ``(label, policy, options)`` triples to try instead of the
            default list (aluminum_py.overlap.autotune.default_candidates).
        tune_steps: policy "auto": ``(warmup, trials)`` rounds; each round runs one step with
            every candidate; warm-up rounds are not measured (default ``(1, 5)``).
        profile_steps: ``(warmup, measured)`` steps of a planned policy that measures its
            profile (default ``(1, 3)``; the first step is always a warm-up).
    """

    def __init__(self, comm, grads, policy: str = "auto", average: bool = True, *,
                 algorithm: str = "auto", threshold: int = 64 << 20, cycle_time=None,
                 compute_times=None, forward_times=None, cost=None, plan=None, groups=None,
                 channel_aware: bool = False, capacity_scale: float = 1.0, candidates=None,
                 tune_steps=(1, 5), profile_steps=(1, 3)):
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
        options = SyncOptions(threshold=threshold, cycle_time=cycle_time,
                              compute_times=compute_times, forward_times=forward_times,
                              cost=cost, plan=plan, groups=groups, channel_aware=channel_aware,
                              capacity_scale=capacity_scale, candidates=candidates,
                              tune_steps=tuple(tune_steps))
        self.comm, self.grads, self.policy = comm, list(grads), policy
        self.average, self.algorithm, self.iteration = bool(average), algorithm, 0
        create = _STRATEGIES.get(policy, buckets.create)
        self._given_profile = None
        if profiled.needs_measuring(policy, options):
            self._strategy: Strategy = profiled.create(comm, self.grads, policy, self.average,
                                                       algorithm, options, create,
                                                       tuple(profile_steps))
        else:
            if policy == "libra" and options.plan is None and options.groups is None:
                # planned from the given compute_times
                options = replace(options,
                                  plan=profiled.libra_plan(comm, self.grads, options))
            if policy in profiled.PLANNED and compute_times is not None:
                self._given_profile = profiled.Profile(
                    tuple(float(x) for x in compute_times),
                    None if forward_times is None else tuple(float(x) for x in forward_times),
                    False)
            self._strategy = create(comm, self.grads, policy, self.average, algorithm, options)

    # the strategy under its policy's name, for introspection (tests; bench overlap's
    # prediction of "deft")
    @property
    def _auto(self):
        return self._strategy if self.policy == "auto" else None

    @property
    def _deft(self):
        s = getattr(self._strategy, "planned", self._strategy)
        return s if isinstance(s, delayed.DelayedUpdates) else None

    @property
    def profile(self) -> "profiled.Profile | None":
        """The per-gradient profile a planned policy plans from: the one given
        (``compute_times``), or the one it measured (``measured=True``), None while it is
        still measuring and for policies that plan nothing (``none``, ``fixed``, ``auto``,
        ``libra`` with a ``plan``)."""
        return getattr(self._strategy, "profile", self._given_profile)

    @property
    def buckets(self) -> list[list[int]]:
        """Per bucket (launch order), its gradient indices (model order); under policy
        "auto", those of the candidate that runs the next step."""
        return self._strategy.buckets

    @property
    def max_ctas(self) -> list[int] | None:
        """Per bucket, the NCCL thread-block limit of its all-reduce (policy "libra" with GPU
        gradients), else None."""
        return self._strategy.max_ctas

    @property
    def op(self):
        """The op of the bucket all-reduces (AVG or SUM)."""
        return self._strategy.op

    @property
    def chosen(self) -> str | None:
        """Policy "auto": the label of the candidate kept, None while tuning (and for the
        other policies)."""
        return self._strategy.chosen_label

    @property
    def tuning_report(self) -> dict | None:
        """Policy "auto", once chosen: candidate label -> median step seconds (max over
        ranks)."""
        return self._strategy.tuning_report

    @property
    def held_iterations(self) -> tuple:
        """Iterations whose gradients have not been applied yet (policy "deft")."""
        return self._strategy.held_iterations

    def grad_ready(self, i: int) -> None:
        """Gradient i (model order) is final for this step; launches every bucket that is now
        complete, in bucket order."""
        self._strategy.grad_ready(i)

    def begin_backward(self) -> None:
        """Optional, policy "deft": the backward pass starts now, so the older gradients this
        backward pass sends are launched now rather than at the first ``grad_ready``."""
        self._strategy.begin_backward()

    def wait(self, timeout=None) -> SyncInfo:
        """Wait for every bucket; afterwards every gradient holds the result. Raises if some
        gradient was never reported ready this step."""
        step = self._strategy.wait(self.iteration, timeout)
        if step.timings and timeline.recording():
            timeline.record_buckets(self.iteration, step.buckets, step.timings)
        info = self._info(self.iteration, step.update, step.iterations, step.buckets,
                          step.timings)
        self.iteration += 1
        return info

    def flush(self, timeout=None) -> SyncInfo:
        """Policy "deft": synchronise every gradient still held (delayed) and write their
        average (or sum) into the gradient arrays; call it after the last ``wait()`` of a
        training run (collective).  ``update`` is False, with zeroed gradients, when nothing
        was held.  Other policies hold nothing: it returns at once with ``update=False``."""
        iters = self._strategy.flush(timeout)
        return self._info(self.iteration - 1, bool(iters), iters, self.buckets, ())

    @staticmethod
    def _info(iteration, update, iters, bucket_list, timings) -> SyncInfo:
        nb = len(bucket_list)
        return SyncInfo(iteration, [iters[-1] if iters else None] * nb,
                        [list(m) for m in bucket_list], update, [tuple(iters)] * nb,
                        list(timings))

    # per bucket: its flat view when it is one memory range, and its fusion buffer (tests)
    @property
    def _views(self):
        return self._strategy.views

    @property
    def _buffers(self):
        return self._strategy.buffers
