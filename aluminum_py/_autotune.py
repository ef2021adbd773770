"""Policy ``"auto"`` of :class:`aluminum_py.overlap.GradientSynchronizer`: measure, then keep.

Every fusion policy is a guess about the machine: the planned ones (``osf``, ``adafusion``,
``mgwfbp``) are as good as their cost model, and a fixed threshold must be tuned per model and
cluster (Horovod's autotuner searches it online for the same reason).  ``"auto"`` runs real
training steps with each candidate grouping, round-robin, and keeps the one whose steps were
fastest:

* Candidates: no fusion, fixed thresholds of 1, 4, 16 and 64 MiB, and -- when the profile
  (``compute_times``) is given -- ``osf``, ``adafusion`` (channel-aware) and ``mgwfbp`` on the
  profile and ``cost``; a ``libra`` plan if given.  Candidates that form the same buckets are
  tried once.  ``candidates=`` replaces the list: ``(label, policy, options)`` triples.
* Schedule: ``warmup + trials`` rounds; round r runs one step with each candidate in turn.
  Warm-up rounds are not measured.  A step's time runs from the previous ``wait()``'s return
  to this one's (compute, exposed communication and the caller's own work: the quantity to
  minimise).
* Choice: per candidate the median of its measured steps, the maximum over ranks (one small
  allreduce, so every rank keeps the same candidate); the smallest wins.  The others are
  dropped (their fusion buffers are freed).
* Results: every candidate's results equal plain per-gradient allreduces, so tuning changes
  timing only.  ``deft`` is never a candidate (it changes which gradients are applied).
* GPU gradients: ``wait()`` only makes the stream wait, so during tuning each step is timed
  after ``cupy.cuda.Device().synchronize()``; afterwards nothing synchronizes.  Every
  candidate with multi-gradient buckets holds its own fusion buffers while tuning.
"""
from __future__ import annotations

import time

import numpy as np

_now = time.monotonic          # the clock (a module attribute so tests can drive it)

DEFAULT_THRESHOLDS = (1 << 20, 4 << 20, 16 << 20, 64 << 20)


def default_candidates(opts: dict) -> list[tuple[str, str, dict]]:
    """The candidate list for the options the synchronizer was given (see module doc)."""
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


class AutoTune:
    """The tuning state of one ``policy="auto"`` synchronizer."""

    def __init__(self, comm, grads, average, algorithm, candidates, warmup, trials):
        from .overlap import GradientSynchronizer, _array_module
        if warmup < 0 or trials < 1:
            raise ValueError(f"tune_steps: need warmup >= 0 and trials >= 1, got {warmup}, "
                             f"{trials}")
        self.comm = comm
        xp = _array_module(grads[0])
        # GPU gradients: wait() only orders the stream, so a tuning step is timed after the
        # device finishes it (the host would otherwise time its own enqueueing)
        self._sync_device = None if xp is np else (lambda: xp.cuda.Device().synchronize())
        self.labels, self.syncs, seen = [], [], set()
        for label, policy, opts in candidates:
            if policy in ("auto", "deft"):
                raise ValueError(f"candidates: policy {policy!r} cannot be a candidate")
            s = GradientSynchronizer(comm, grads, policy=policy, average=average,
                                     algorithm=algorithm, **opts)
            key = tuple(tuple(b) for b in s.buckets)
            if key in seen:                     # the same buckets: try them once
                continue
            seen.add(key)
            self.labels.append(label)
            self.syncs.append(s)
        if not self.syncs:
            raise ValueError("candidates: empty")
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
        return self.syncs[self._index]

    def wait(self, timeout):
        c = self._index
        info = self.syncs[c].wait(timeout)
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
        return info

    def _choose(self):
        from .ops import MAX
        med = np.array([np.median(s) if s else np.inf for s in self.samples], dtype=np.float64)
        self.comm.Allreduce(med, op=MAX, algorithm="mpi")
        k = int(np.argmin(med))
        self.report = dict(zip(self.labels, med.tolist()))
        self.chosen = k
        self.syncs = [s if i == k else None for i, s in enumerate(self.syncs)]
