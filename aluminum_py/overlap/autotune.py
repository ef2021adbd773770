"""The autotune strategy (policy ``"auto"``): runs training steps with each candidate grouping
(a :class:`~aluminum_py.overlap.buckets.BucketedStrategy` per candidate), round-robin, and keeps
the one whose steps were fastest (docs/overlap.md, "Measured tuning").

Each candidate is a guess about the machine: the planned policies are as good as their cost
model, and a fixed threshold must be tuned per model and cluster.  A step's time runs from the
previous ``wait()``'s return to this one's; the choice is the smallest median over the measured
steps, the maximum over ranks (one small allreduce, so every rank keeps the same candidate).
``deft`` is never a candidate: it changes which gradients are applied, not only the timing.
"""
from __future__ import annotations

import time

import numpy as np

from ..ops import MAX
from .buckets import BUCKET_POLICIES, array_module
from .buckets import create as bucketed
from .strategy import Delegating, StepResult, SyncOptions

_now = time.monotonic          # the clock (a module attribute so tests can drive it)

DEFAULT_THRESHOLDS = (1 << 20, 4 << 20, 16 << 20, 64 << 20)


def default_candidates(opts: dict) -> list[tuple[str, str, dict]]:
    """The candidate list for the options the synchronizer was given: no fusion, fixed
    thresholds of 1, 4, 16 and 64 MiB, and with a profile (``compute_times``) ``osf``,
    channel-aware ``adafusion`` and ``mgwfbp``; ``libra`` when a plan is given.  Triples
    ``(label, policy, options)``."""
    cands = [("none", "none", {})]
    cands += [(f"fixed {t >> 20} MiB", "fixed", {"threshold": t}) for t in DEFAULT_THRESHOLDS]
    profile = {k: opts[k] for k in ("compute_times", "forward_times", "cost")
               if opts.get(k) is not None}
    if "compute_times" in profile:
        cands += [("osf", "osf", dict(profile)),
                  ("adafusion", "adafusion", dict(profile, channel_aware=True)),
                  ("mgwfbp", "mgwfbp", dict(profile))]
    if opts.get("plan") is not None:
        cands.append(("libra", "libra", {"plan": opts["plan"]}))
    return cands


class AutoTune(Delegating):
    """The tuning state of one ``policy="auto"`` synchronizer; every call goes to the candidate
    that runs the current step (:attr:`active`).

    Attributes:
        labels, syncs: per distinct candidate, its label and strategy (None once dropped).
        order: the candidate of each tuning step; ``step``: tuning steps done.
        chosen: the index of the candidate kept, None while tuning.
        report: label -> median step seconds (max over ranks), once chosen.
    """

    def __init__(self, comm, grads, average, algorithm, candidates, warmup, trials):
        if warmup < 0 or trials < 1:
            raise ValueError(f"tune_steps: need warmup >= 0 and trials >= 1, got {warmup}, "
                             f"{trials}")
        self.comm = comm
        self.labels, self.syncs, seen = [], [], set()
        for label, policy, opts in candidates:
            if policy not in BUCKET_POLICIES:
                raise ValueError(f"candidates: policy {policy!r} cannot be a candidate")
            s = bucketed(comm, grads, policy, average, algorithm, SyncOptions(**opts))
            key = tuple(tuple(b) for b in s.buckets)
            if key in seen:                     # the same buckets: try them once
                continue
            seen.add(key)
            self.labels.append(label)
            self.syncs.append(s)
        if not self.syncs:
            raise ValueError("candidates: empty")
        xp = array_module(grads[0])
        # GPU gradients: wait() only orders the stream, so a tuning step is timed after the
        # device finishes it (the host would otherwise time its own enqueueing)
        self._sync_device = None if xp is np else (lambda: xp.cuda.Device().synchronize())
        c = len(self.syncs)
        self.order = [k for _ in range(warmup + trials) for k in range(c)]
        self.measured_from = warmup * c         # steps before this are warm-up
        self.samples = [[] for _ in range(c)]
        self.step = 0
        self.last = None                        # when the previous wait() returned
        self.chosen = None if c > 1 else 0
        self.report = None                      # label -> median step seconds, once chosen

    @property
    def _index(self):
        """The candidate that runs the current step."""
        return self.order[self.step] if self.chosen is None else self.chosen

    @property
    def active(self):
        """The candidate that runs the current step (it does the work)."""
        return self.syncs[self._index]

    @property
    def chosen_label(self) -> str | None:
        return None if self.chosen is None else self.labels[self.chosen]

    @property
    def tuning_report(self) -> dict | None:
        return self.report

    def wait(self, iteration: int, timeout) -> StepResult:
        c = self._index
        result = self.syncs[c].wait(iteration, timeout)
        if self.chosen is None and self._sync_device is not None:
            self._sync_device()
        now = _now()
        if self.chosen is None:
            if self.last is not None and self.step >= self.measured_from:
                self.samples[c].append(now - self.last)
            self.step += 1
            if self.step == len(self.order):
                self._choose()
        self.last = now
        return result

    def _choose(self):
        med = np.array([np.median(s) if s else np.inf for s in self.samples], dtype=np.float64)
        self.comm.Allreduce(med, op=MAX, algorithm="mpi")
        k = int(np.argmin(med))
        self.report = dict(zip(self.labels, med.tolist()))
        self.chosen = k
        self.syncs = [s if i == k else None for i, s in enumerate(self.syncs)]


def create(comm, grads, policy: str, average: bool, algorithm: str,
           options: SyncOptions) -> AutoTune:
    """The strategy of policy ``"auto"``: the given ``candidates``, else
    :func:`default_candidates` for the options."""
    if options.groups is not None:
        raise ValueError("groups= fixes the buckets; policy 'auto' chooses them (pass "
                         "candidates= to choose among explicit groupings)")
    candidates = options.candidates
    if candidates is None:
        candidates = default_candidates(dict(
            compute_times=options.compute_times, forward_times=options.forward_times,
            cost=options.cost, plan=options.plan))
    return AutoTune(comm, grads, average, algorithm, candidates, *options.tune_steps)
