"""Algorithm names and the alpha-beta-gamma selection rule used by ``algorithm="auto"``.

Costs for p ranks and n bytes (paper section III-B, plus a reduction term gamma per byte
reduced; non-powers of two add the fold: one extra exchange of n bytes in and out):

* ring:               2(p-1) a + 2(p-1)/p n b + (p-1)/p n g
* recursive doubling: log2(p') (a + n b + n g)                       (+ fold)
* rabenseifner:       2 log2(p') a + 2(p'-1)/p' n b + (p'-1)/p' n g  (+ fold)

with p' = 2^floor(log2 p).  The parameters come from AL_ALPHA / AL_BETA / AL_GAMMA.
"""
from __future__ import annotations

import math

from . import config

HOST_ALLREDUCE = ("auto", "mpi", "recursive_doubling", "rabenseifner", "ring")
GPU_ALLREDUCE = ("auto", "nccl", "ht_mpi", "ht_recursive_doubling", "ht_rabenseifner", "ht_ring")
MODELLED = ("recursive_doubling", "rabenseifner", "ring")


def algorithms(op: str = "allreduce", device: str | None = None) -> tuple[str, ...]:
    """Names usable as ``algorithm=`` for `op`: for host buffers, GPU buffers, or (None) both."""
    if op != "allreduce":
        raise ValueError(f"op: only 'allreduce' takes an algorithm argument, got {op!r}")
    if device == "host":
        return HOST_ALLREDUCE
    if device in ("cuda", "gpu"):
        return GPU_ALLREDUCE
    if device is None:
        return HOST_ALLREDUCE + tuple(a for a in GPU_ALLREDUCE if a not in HOST_ALLREDUCE)
    raise ValueError(f"device: expected 'host', 'cuda' or None, got {device!r}")


def model_time(algorithm: str, p: int, nbytes: int, params=None) -> float:
    """Predicted seconds for one allreduce of `nbytes` on `p` ranks."""
    a, b, g = params or config.model_params()
    if p <= 1:
        return 0.0
    n = float(nbytes)
    if algorithm == "ring":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    p2 = 1 << (p.bit_length() - 1)
    lg = math.log2(p2)
    fold = 0.0 if p2 == p else 2 * (a + n * b) + n * g
    if algorithm == "recursive_doubling":
        return lg * (a + n * b + n * g) + fold
    if algorithm == "rabenseifner":
        return 2 * lg * a + 2 * (p2 - 1) / p2 * n * b + (p2 - 1) / p2 * n * g + fold
    raise ValueError(f"algorithm: no cost model for {algorithm!r}")


def model_choice(p: int, nbytes: int, params=None) -> str:
    """The modelled algorithm with the lowest predicted time (ties: the first in MODELLED)."""
    return min(MODELLED, key=lambda alg: model_time(alg, p, nbytes, params))


class Selector:
    """auto's choice for one communicator, from a :class:`aluminum_py.tuning.Decider`.

    The decider is built from data rank 0 read and broadcast, so every rank makes the same
    choice for the same message.  The native call path caches choices per (bytes, itemsize).
    """

    __slots__ = ("size", "decider")

    def __init__(self, size: int, decider):
        self.size = size
        self.decider = decider

    def explain(self, nbytes: int, itemsize: int):
        return self.decider.decide(nbytes, itemsize)

    def choose(self, nbytes: int, itemsize: int) -> str:
        return self.decider.decide(nbytes, itemsize).algorithm
