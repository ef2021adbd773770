"""DeFT's model of a training iteration: gradient buckets with their compute and all-reduce
times (:class:`Bucket`), the speed ratio of the two links, and the tensor partition of section
III-D (:func:`partition`).

A model is a list of buckets in FORWARD order: bucket 0 is the paper's bucket #1, next to the
input, computed first in the forward pass and LAST in the backward pass; bucket N-1 is the
paper's bucket #N, whose gradient exists first.  Every time is in one unit of the caller's
choice (:data:`~aluminum_py.planning.deft.tables.TABLE_II` is in microseconds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MU_GLOO = 1.65          # NCCL is 1.59-1.69x faster than gloo; the paper uses 1.65 (section III-C)
EPS = 1e-9              # tolerance of time comparisons (sums of floating-point times)


@dataclass(frozen=True)
class Bucket:
    """One gradient bucket: forward and backward compute time and all-reduce time on the fast link
    (one time unit throughout; microseconds for :data:`TABLE_II`)."""

    forward: float
    backward: float
    comm: float
    name: str = ""

    def __post_init__(self):
        for k in ("forward", "backward", "comm"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(v)
                    and v >= 0):
                raise ValueError(f"Bucket.{k} must be a finite non-negative time, got {v!r}")



def as_buckets(buckets) -> tuple[Bucket, ...]:
    out = []
    for b in buckets:
        out.append(b if isinstance(b, Bucket) else Bucket(*b))
    if not out:
        raise ValueError("buckets: at least one bucket is needed")
    return tuple(out)


def partition(buckets, max_comm: float) -> tuple[Bucket, ...]:
    """Cut every bucket whose all-reduce takes longer than ``max_comm`` into ``ceil(comm /
    max_comm)`` pieces of (nearly) equal time (section III-D).  Integer times stay integers.

    The pieces keep the bucket's place in the forward order.  The bucket's forward and backward
    compute go to its last piece in forward order (the first one in backward order), so all
    pieces' gradients exist at the same moment and the bucket's forward compute waits for all
    its pieces, as for the unpartitioned bucket.  Piece names are ``name + "a"``, ``"b"``, ...
    No per-piece startup cost is added.
    """
    if not max_comm > 0:
        raise ValueError(f"partition: max_comm must be positive, got {max_comm!r}")
    out = []
    for b in as_buckets(buckets):
        k = max(1, math.ceil(b.comm / max_comm - EPS))
        if k == 1:
            out.append(b)
            continue
        if float(b.comm).is_integer():
            q, r = divmod(int(b.comm), k)
            parts = [q + 1] * r + [q] * (k - r)
        else:
            parts = [b.comm / k] * k
        for j, c in enumerate(parts):
            last = j == k - 1
            out.append(Bucket(b.forward if last else 0, b.backward if last else 0, c,
                              f"{b.name}{chr(ord('a') + j) if j < 26 else j}"))
    return tuple(out)

