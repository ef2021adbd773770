"""LIBRA: contention-aware communication thread allocation co-optimised with tensor fusion
(paper sections III-B and IV, eqs. 7-23, Algorithm 1).

Layers are given in BACKWARD order: ``comm_bytes[i]`` is layer i's gradient size (bytes) and
``compute[i]`` its backward computation time alone (seconds). A fusion plan is a list of
inclusive ``(first, last)`` layer ranges covering all layers in order; ``threads[k]`` is the
number of GPU threads given to group k's all-reduce.

* :func:`backward_time` evaluates a plan with the stage recursion of eqs. 8-15.
* :func:`optimize` is Algorithm 1 with the limit K on the number of groups (eq. 23): it picks
  the groups and their threads; the plan's backward time is within ``1 + (L-1)/Z`` of the
  optimum over plans of at most K groups (Theorem 2; checked against exhaustive search in the
  tests).
* :func:`allocate_threads` is the DP of section IV-A for a fixed fusion plan ("LIBRA-M").
* :func:`baselines` evaluates SE, Horovod-like fixed-threshold fusion, MG-WFBP, LIBRA-M and LIBRA
  under the same model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .._planning import minplus
from .contention import ContentionModel

DEFAULT_THREADS = tuple(2 ** k for k in range(7, 13))      # 128 .. 4096, as in the paper
NCCL_DEFAULT_THREADS = 512                                  # a typical NCCL choice (one ring)


@dataclass
class Plan:
    """A fusion plan with per-group thread counts and its predicted backward time (s)."""

    groups: list
    threads: list
    predicted_time: float
    method: str = "libra"
    info: dict = field(default_factory=dict)

    def max_ctas(self, nthreads_per_cta: int = 512) -> list[int]:
        """Per-group NCCL maxCTAs (``max_ctas=`` of the GPU collectives): threads / NCCL_NTHREADS,
        rounded up."""
        return [max(1, math.ceil(t / nthreads_per_cta)) for t in self.threads]

    def as_dict(self) -> dict:
        return {"method": self.method, "groups": [list(g) for g in self.groups],
                "threads": list(self.threads), "predicted_time": self.predicted_time, **self.info}


def _check_layers(comm_bytes, compute):
    c = np.asarray(comm_bytes, dtype=float)
    b = np.asarray(compute, dtype=float)
    if c.ndim != 1 or c.shape != b.shape or len(c) == 0:
        raise ValueError("comm_bytes and compute: one value per layer, same length, not empty")
    if (c < 0).any() or (b < 0).any():
        raise ValueError("comm_bytes and compute must be non-negative")
    return c, b


def _check_groups(groups, n):
    expect = 0
    for first, last in groups:
        if first != expect or last < first:
            raise ValueError(f"groups: {groups} do not cover layers 0..{n - 1} in order")
        expect = last + 1
    if expect != n:
        raise ValueError(f"groups: {groups} do not cover layers 0..{n - 1} in order")


def backward_time(comm_bytes, compute, model: ContentionModel, groups, threads,
                  breakdown: bool = False):
    """Backward time (s) of a plan by the stage recursion of eqs. 8-15.

    Stage 0 computes group 1. Stage i (1..K) runs group i's all-reduce with threads[i-1] beside
    the remaining computation s_b^i: t_o, t_c by eq. 12; the computation left when the
    communication ends (eq. 14) runs alone until group i+1's gradients exist (t_b, eq. 13); the
    next all-reduce then starts (eq. 15). With breakdown, returns (total, per-stage list of
    (t_o, t_b, t_c)).
    """
    c, b = _check_layers(comm_bytes, compute)
    _check_groups(groups, len(c))
    if len(threads) != len(groups):
        raise ValueError(f"threads: {len(threads)} values for {len(groups)} groups")
    cg = [c[f:l + 1].sum() for f, l in groups]
    bg = [b[f:l + 1].sum() for f, l in groups]
    k = len(groups)
    total = bg[0]
    stages = [(0.0, bg[0], 0.0)]
    s = sum(bg[1:])                                  # s_b^1
    for i in range(k):
        fo, fb, fc = (float(x) for x in model.overlap(cg[i], s, threads[i]))
        later = sum(bg[i + 2:])
        tb = max(0.0, fb - later)
        total += fo + tb + fc
        stages.append((fo, tb, fc))
        s = fb - tb
    return (total, stages) if breakdown else total


def _fusion_dp(c, b, model, threads, Z, K, boundaries=None):
    """T[i][l][z] of eq. 23 (Algorithm 1), vectorised over z and the previous boundary l'.

    boundaries: the only allowed group ends (None: any layer); then exactly len(boundaries)
    groups are formed (the fixed plan of section IV-A). Returns (groups, threads).
    """
    L = len(c)
    R = np.asarray(threads, dtype=float)
    total_b = float(b.sum())
    w = total_b / Z if total_b > 0 else 0.0
    ccum = np.concatenate([[0.0], np.cumsum(c)])
    bcum = np.concatenate([[0.0], np.cumsum(b)])
    # z_min(l): chunks needed before layers 1..l have their gradients (GetMinChunkID)
    if w > 0:
        zmin = np.minimum(Z, np.ceil(bcum / w - 1e-9).astype(int))
    else:
        zmin = np.zeros(L + 1, dtype=int)
    ends = list(range(1, L + 1)) if boundaries is None else sorted(boundaries)
    allowed_prev = {0} | set(ends)
    INF = np.inf
    T = np.full((K + 1, L + 1, Z + 1), INF)
    T[0, 0, :] = np.arange(Z + 1) * w                # computing z chunks before any all-reduce
    dz = np.arange(Z + 1) * w
    # stage times for every (l', l) group: H[l'][dz] minimised over threads, split into
    # "mid" (the stage may not leave residual communication) and "end" (z = Z: it may)
    H_mid, H_end, J_mid, J_end = {}, {}, {}, {}
    for l in ends:
        prev = np.array([lp for lp in range(l) if lp in allowed_prev])
        cgrp = (ccum[l] - ccum[prev])[:, None, None]                     # (P, 1, 1)
        fo, fb, fc = model.overlap(cgrp, dz[None, :, None], R[None, None, :])
        h = fo + fb + fc                                                 # (P, Z+1, J)
        hm = np.where(fc > 1e-15, INF, h)
        H_mid[l], J_mid[l] = hm.min(axis=2), hm.argmin(axis=2)
        H_end[l], J_end[l] = h.min(axis=2), h.argmin(axis=2)
        H_mid[l] = (prev, H_mid[l])
        H_end[l] = (prev, H_end[l])
    for i in range(1, K + 1):
        for l in ends:
            if l < i:
                continue
            prev, hm = H_mid[l]
            _, he = H_end[l]
            z0 = int(zmin[l])
            A = T[i - 1, prev, :]                                         # (P, Z+1)
            best = np.full(Z + 1, INF)
            # T[i][l][z] = min over l', z0 <= z' <= z of A[l', z'] + H[l', z - z'] (in C)
            minplus(np.ascontiguousarray(A), np.ascontiguousarray(hm), z0, best)
            # z = Z: the stage may leave residual communication
            zp = np.arange(z0, Z + 1)
            cand = A[:, zp] + he[:, Z - zp]
            best[Z] = min(best[Z], cand.min()) if cand.size else best[Z]
            T[i, l, :] = best
    # best number of groups, then walk back
    i_best = K if boundaries is not None else int(np.argmin(T[1:, L, Z])) + 1
    if not np.isfinite(T[i_best, L, Z]):
        raise RuntimeError("no feasible plan (check the model parameters)")
    groups, thr = [], []
    i, l, z = i_best, L, Z
    while i > 0:
        prev, hm = H_mid[l]
        _, he = H_end[l]
        jm, je = J_mid[l], J_end[l]
        z0 = int(zmin[l])
        target = T[i, l, z]
        found = None
        for pi, lp in enumerate(prev):
            for zp in range(z0, z + 1):
                h = he[pi, z - zp] if z == Z else hm[pi, z - zp]
                v = T[i - 1, lp, zp] + h
                if np.isfinite(v) and abs(v - target) <= 1e-12 * max(1.0, abs(target)):
                    found = (lp, zp, (je if z == Z else jm)[pi, z - zp])
                    break
            if found:
                break
        lp, zp, j = found
        groups.append((int(lp), int(l) - 1))
        thr.append(int(R[j]))
        i, l, z = i - 1, int(lp), int(zp)
    if l != 0:
        raise RuntimeError("DP backtrack did not reach the first layer")
    return groups[::-1], thr[::-1]


def optimize(comm_bytes, compute, model: ContentionModel, threads=DEFAULT_THREADS,
             max_groups: int = 10, chunks: int = 150) -> Plan:
    """LIBRA (Algorithm 1, eq. 23): tensor fusion groups (at most `max_groups`) and per-group
    threads from `threads`, computation discretised into `chunks` chunks."""
    c, b = _check_layers(comm_bytes, compute)
    if max_groups < 1 or chunks < 1:
        raise ValueError("max_groups and chunks must be at least 1")
    groups, thr = _fusion_dp(c, b, model, threads, chunks, min(max_groups, len(c)))
    return Plan(groups, thr, backward_time(c, b, model, groups, thr), "libra",
                {"max_groups": max_groups, "chunks": chunks})


def allocate_threads(comm_bytes, compute, model: ContentionModel, groups,
                     threads=DEFAULT_THREADS, chunks: int = 150) -> Plan:
    """LIBRA-M (section IV-A): the best threads for a fixed fusion plan."""
    c, b = _check_layers(comm_bytes, compute)
    _check_groups(groups, len(c))
    ends = [last + 1 for _, last in groups]
    g, thr = _fusion_dp(c, b, model, threads, chunks, len(groups), boundaries=ends)
    if [tuple(x) for x in g] != [tuple(x) for x in groups]:
        # fewer groups can never be chosen here: boundaries force these groups
        raise RuntimeError("allocate_threads: DP changed the fusion plan")
    return Plan(g, thr, backward_time(c, b, model, g, thr), "libra-m", {"chunks": chunks})


# ---------------------------------------------------------------- baselines under the same model
def se_plan(comm_bytes, compute, model, nthreads=NCCL_DEFAULT_THREADS) -> Plan:
    """SynEASGD: one all-reduce of everything after all computation."""
    c, b = _check_layers(comm_bytes, compute)
    groups = [(0, len(c) - 1)]
    return Plan(groups, [nthreads], backward_time(c, b, model, groups, [nthreads]), "se")


def threshold_plan(comm_bytes, compute, model, threshold: float = 64 << 20,
                   nthreads=NCCL_DEFAULT_THREADS) -> Plan:
    """Horovod-like fusion: consecutive gradients (backward order) fused until a group holds at
    least `threshold` bytes (HOROVOD_FUSION_THRESHOLD, default 64 MiB); NCCL-default threads.
    Horovod's cycle time is not modelled (it only delays groups further)."""
    c, b = _check_layers(comm_bytes, compute)
    groups, start, acc = [], 0, 0.0
    for i, x in enumerate(c):
        acc += x
        if acc >= threshold:
            groups.append((start, i))
            start, acc = i + 1, 0.0
    if start < len(c):
        groups.append((start, len(c) - 1))
    thr = [nthreads] * len(groups)
    return Plan(groups, thr, backward_time(c, b, model, groups, thr), "horovod",
                {"threshold": threshold})


def mgwfbp_groups(compute, comm_time, startup: float) -> list[tuple[int, int]]:
    """MG-WFBP's merge rule (Shi et al., paper ref. [10]) for layers in backward order: a
    layer's gradient joins the pending group when that group's all-reduce could not start
    before the layer's gradient is ready plus one startup (merging then saves a startup without
    delaying anything). comm_time(bytes_index_range) -> seconds of the pending group's
    all-reduce; compute: backward seconds per layer."""
    ready = np.cumsum(np.asarray(compute, dtype=float))     # when each layer's gradient exists
    groups = [[0, 0]]
    comm_free = 0.0                                          # when the previous all-reduce ends
    for i in range(1, len(ready)):
        f, l = groups[-1]
        start = max(ready[l], comm_free)     # when the pending group's all-reduce would start
        if start >= ready[i] - startup:      # it could not start before layer i is ready: merge
            groups[-1][1] = i
        else:
            comm_free = start + comm_time(f, l)
            groups.append([i, i])
    return [tuple(g) for g in groups]


def mgwfbp_plan(comm_bytes, compute, model, nthreads=NCCL_DEFAULT_THREADS) -> Plan:
    """MG-WFBP with NCCL-default threads, timed with the contention-free p(c, r) + a."""
    c, b = _check_layers(comm_bytes, compute)
    a = model.startup
    groups = mgwfbp_groups(b, lambda f, l: float(model.p(c[f:l + 1].sum(), nthreads)) + a, a)
    thr = [nthreads] * len(groups)
    return Plan(groups, thr, backward_time(c, b, model, groups, thr), "mgwfbp")


def baselines(comm_bytes, compute, model, threads=DEFAULT_THREADS, max_groups=10,
              chunks=150, threshold=64 << 20) -> dict:
    """Every method's plan under the same model: se, horovod, mgwfbp, libra-m (MG-WFBP's
    groups, optimised threads) and libra."""
    mg = mgwfbp_plan(comm_bytes, compute, model)
    return {"se": se_plan(comm_bytes, compute, model),
            "horovod": threshold_plan(comm_bytes, compute, model, threshold),
            "mgwfbp": mg,
            "libra-m": allocate_threads(comm_bytes, compute, model, mg.groups, threads, chunks),
            "libra": optimize(comm_bytes, compute, model, threads, max_groups, chunks)}


def exhaustive(comm_bytes, compute, model, threads=DEFAULT_THREADS, max_groups=None) -> Plan:
    """The optimum by enumeration (small instances only: tests)."""
    import itertools
    c, b = _check_layers(comm_bytes, compute)
    L = len(c)
    K = max_groups or L
    best = None
    for ncut in range(0, min(K, L) ):
        for cuts in itertools.combinations(range(1, L), ncut):
            bounds = [0, *cuts, L]
            groups = [(bounds[i], bounds[i + 1] - 1) for i in range(len(bounds) - 1)]
            for thr in itertools.product(threads, repeat=len(groups)):
                t = backward_time(c, b, model, groups, list(thr))
                if best is None or t < best.predicted_time:
                    best = Plan(groups, list(thr), t, "exhaustive")
    return best
