"""Overlap for frameworks: the gradient synchronizer, which starts each gradient bucket's
all-reduce as soon as the bucket's gradients exist (Aluminum section III-A) and completes them
before the optimizer step (docs/overlap.md).

* :mod:`.synchronizer` -- :class:`GradientSynchronizer`, the front, and :class:`SyncInfo`.
* :mod:`.strategy` -- the interface of the strategies it delegates to.
* :mod:`.buckets` -- bucket formation per policy and the bucketed strategy; :func:`gradient_arena`.
* :mod:`.autotune` -- policy ``"auto"``: measure the candidate groupings, keep the fastest.
* :mod:`.delayed` -- policy ``"deft"``: DeFT's delayed updates.
* :mod:`.profiled` -- a planned policy without a profile: measure the first steps, then plan.
"""
from .buckets import gradient_arena
from .profiled import Profile
from .synchronizer import POLICIES, GradientSynchronizer, SyncInfo

__all__ = ["GradientSynchronizer", "SyncInfo", "Profile", "POLICIES", "gradient_arena"]
