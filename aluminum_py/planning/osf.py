"""OSF: the scaling model with computation/communication overlap and tensor fusion, and adaptive
tensor fusion (Liu et al., "Modeling and Optimizing the Scaling Performance in Distributed Deep
Learning Training", WWW '22; equations 2-18).

Layer order.  Every per-layer input is in FORWARD order, as in the paper: index 0 is the paper's
layer 1 (the input layer), index n-1 is layer n (the output layer).  The backward pass runs
n -> 1, so layer n's gradient is ready first.  ``t_f[i]`` and ``t_b[i]`` are layer i's forward
and backward times (seconds; ``t_b=None`` means ``2 * t_f``, eq. 6) and ``m[i]`` its gradient
size (bytes; the paper's D^(i), which it calls the parameter size).

Fusion groups are the exception: they are inclusive ``(first, last)`` index ranges in BACKWARD
order (the order gradients become ready), covering 0..n-1 in order, as in
:mod:`aluminum_py.planning.libra`.  Backward index k is forward index n-1-k.

Costs.  ``t_update(D)`` (eq. 7: all-reduce plus aggregation of D bytes) is any callable from
bytes to seconds; :class:`AllreduceCost` gives alpha-beta and the piecewise model of eq. 18,
fitted to crossover data or built from a tuning-table entry.  Every function here takes
``t_update(0) = 0``: a step that sends nothing costs nothing (without it, eq. 15 would charge
the per-message overhead for every layer that only adds to the fusion buffer).

Times.  As in the paper, tau (eqs. 8, 15) and T_update (eqs. 9, 16) are measured from the end of
layer n's backward pass.  The iteration time is ``T_comp + T_update - T_overlap`` (the
denominator of eqs. 3 and 11) = ``sum(t_f) + t_b[n-1] + T_update``, and a scaling factor is
``T_comp / iteration time``.

* :func:`csf` (eq. 2); :func:`terms_no_fusion`, :func:`iteration_time_no_fusion`,
  :func:`scaling_factor_no_fusion` (eqs. 3-10); :func:`terms_fusion`,
  :func:`iteration_time_fusion`, :func:`scaling_factor_fusion` (eqs. 11-16).
* :meth:`AllreduceCost.plus` and :func:`calibrate_per_op`: a per-operation host cost fitted to
  one measured iteration (not in the paper).
* :func:`adaptive_fusion` (eq. 17), :func:`optimal_groups` (the grouping OSF's timeline
  predicts fastest; not in the paper), :func:`buffer_groups` (the groups eqs. 12-14 form),
  :func:`predict_iteration` / :func:`schedule` (any explicit grouping).

Misprints and ambiguities in the paper, and what this module does:

* Eq. 8 sums backward times from j=i+1; layer i's gradient exists only after layer i's own
  backward, so the sum starts at j=i, as eq. 15 does.
* Eq. 13 flushes the buffer on ``t_backward^(i) > timeout``; the text ("a timeout occurs before
  the backward pass of layer i-1 completes"), eq. 14 and eq. 12 all mean layer i-1's backward.
  Eq. 12 uses ``>=`` where eqs. 13-14 use ``>``.  Taken literally the three disagree and bytes
  are lost (a buffer restarted by eq. 12 but never sent by eq. 13).  Here one predicate is used
  in all three: the buffer holding layer i is flushed by the timeout iff ``t_b(i-1) > timeout``
  (so gradients ready at the same instant are fused even with timeout 0); every byte is sent
  exactly once.
* Eq. 15 adds the fusion wait after ``tau``, i.e. after the channel became free, while the
  wait physically runs from when the gradient was ready.  :func:`terms_fusion` keeps the
  paper's recursion; :func:`predict_iteration` with the groups and waits of
  :func:`buffer_groups` gives the other reading (start = max(channel free, ready + wait)); it
  is never later than the paper's and equal when no wait occurs.
* Eq. 17 writes ``t_wait^(i)``; the wait that fusing layer i into the buffer B^(i+1) causes is
  the buffer waiting for layer i's backward, ``t_b(i)`` (eq. 14's ``t_wait^(i+1)`` in the
  buffer-full case).  That is what :func:`adaptive_fusion` uses.
* Eq. 18 is undefined at D = 0 (log2); t(0) = 0 as everywhere.  Its values are clamped at 0 s
  (a fitted logarithm can go negative below the smallest size measured).
* CSF (eq. 2) needs T_comm; the paper's reading (section 3.2: "all tensors in CSF are
  transferred in one All-Reduce operation") is used: ``T_comm = t_update(sum m)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


def fit_alpha_beta(sizes, times) -> dict:
    """Least-squares t = alpha + beta * n over the measured sizes (seconds, seconds per byte),
    weighted by 1/t so small sizes count as much as large ones (relative error)."""
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if len(n) == 1:
        return {"alpha": float(t[0]), "beta": 0.0}
    w = 1.0 / np.maximum(t, 1e-12)
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    return {"alpha": float(max(alpha, 0.0)), "beta": float(max(beta, 0.0))}


Cost = Callable[[float], float]


# ---------------------------------------------------------------------------------- cost models
class AllreduceCost:
    """``t_update(nbytes)``: all-reduce time (seconds) of a message of ``nbytes`` bytes.

    Build one with :meth:`alpha_beta`, :meth:`piecewise`, :meth:`fit` or
    :meth:`from_tuning_entry`.  Calling it is vectorised: a scalar gives a float, an array an
    array.  ``cost(0) == 0`` for every kind; negative sizes raise ValueError.
    """

    kind = "abstract"

    def __call__(self, nbytes):
        x = np.asarray(nbytes, dtype=float)
        if np.isnan(x).any() or (x < 0).any():
            raise ValueError(f"nbytes must be non-negative, got {nbytes!r}")
        pos = x > 0
        t = np.where(pos, self._positive(np.where(pos, x, 1.0)), 0.0)
        return float(t) if t.ndim == 0 else t

    def _positive(self, x: np.ndarray) -> np.ndarray:           # x > 0, bytes
        raise NotImplementedError

    def plus(self, per_op: float) -> "OffsetCost":
        """This cost plus ``per_op`` seconds for every all-reduce of more than 0 bytes: a
        per-operation host cost (the caller's call, the engine's hand-off and wake-ups) that a
        burst measurement does not show; see :func:`calibrate_per_op`."""
        if not (per_op >= 0 and math.isfinite(per_op)):
            raise ValueError(f"per_op must be a non-negative time, got {per_op!r}")
        return OffsetCost(self, float(per_op))

    def as_dict(self) -> dict:
        raise NotImplementedError

    # -- constructors ----------------------------------------------------------------------
    @staticmethod
    def alpha_beta(alpha: float, beta: float) -> AlphaBetaCost:
        """``t(n) = alpha + beta * n`` for n > 0 bytes, ``t(0) = 0``; alpha in seconds, beta in
        seconds per byte.  Eq. 7 has this form with alpha = delta and beta =
        ``2(N-1)/(N bandwidth) + (N-1)/(N pi s)`` (the paper's beta is the bandwidth, not this)."""
        if not (alpha >= 0 and beta >= 0):
            raise ValueError(f"alpha and beta must be non-negative, got {alpha}, {beta}")
        return AlphaBetaCost(float(alpha), float(beta))

    @staticmethod
    def piecewise(a1: float, b1: float, a2: float, b2: float,
                  threshold: float) -> PiecewiseCost:
        """Eq. 18: ``a1 * log2(D) + b1`` (seconds) for ``0 < D < threshold`` bytes, else
        ``a2 * D + b2``; a1 in seconds per doubling, a2 in seconds per byte, b1 and b2 in
        seconds, threshold in bytes (the paper uses the link's bandwidth-delay product)."""
        return PiecewiseCost(float(a1), float(b1), float(a2), float(b2), float(threshold))

    @staticmethod
    def fit(sizes_bytes, times_s, kind: str = "alpha_beta",
            threshold: float | None = None) -> AllreduceCost:
        """Least-squares fit to measured all-reduce times (e.g. one crossover sweep).

        Args:
            sizes_bytes: message sizes (bytes, positive).
            times_s: measured time (seconds) at each size.
            kind: ``"alpha_beta"`` (t = alpha + beta n), ``"piecewise"`` (eq. 18) or
                ``"table"`` (log-log interpolation of the points themselves, see
                :class:`TableCost`).
            threshold: piecewise only: D_Thresh in bytes.  None: every split of the sorted
                sizes with at least two points on each side is fitted and the one with the
                smallest error kept; the threshold is then placed where the two fitted pieces
                meet if they meet between the last logarithmic and the first linear size,
                else at the first linear size.

        Residuals are relative (weighted by 1/t), as in :func:`fit_alpha_beta`,
        so small messages count as much as large ones.  Raises ValueError on bad data (and, for
        "piecewise", fewer than two points on a side).
        """
        n, t = _check_samples(sizes_bytes, times_s)
        if kind == "alpha_beta":
            f = fit_alpha_beta(n, t)
            return AlphaBetaCost(f["alpha"], f["beta"])
        if kind == "piecewise":
            return _fit_piecewise(n, t, threshold)
        if kind == "table":
            return TableCost(tuple(n.tolist()), tuple(t.tolist()))
        raise ValueError(f"kind: {kind!r} is not 'alpha_beta', 'piecewise' or 'table'")

    @staticmethod
    def from_tuning_entry(entry: dict, algorithm: str | None = None,
                          kind: str = "piecewise",
                          threshold: float | None = None) -> AllreduceCost:
        """The cost from one :mod:`aluminum_py.tuning` entry (``entry["sizes"]`` in bytes,
        ``entry["times"][alg]`` median seconds per size).

        ``algorithm=None`` uses the per-size minimum over the entry's algorithms (what ``auto``
        achieves); otherwise that algorithm's times.  ``kind`` and ``threshold`` as in
        :meth:`fit`.
        """
        sizes = entry["sizes"]
        times = entry["times"]
        if not times:
            raise ValueError("tuning entry has no times")
        if algorithm is None:
            t = np.min(np.array([list(map(float, ts)) for ts in times.values()]), axis=0)
        elif algorithm in times:
            t = np.asarray(times[algorithm], dtype=float)
        else:
            raise ValueError(f"algorithm: {algorithm!r} not in the entry (it has "
                             f"{', '.join(times)})")
        return AllreduceCost.fit(sizes, t, kind=kind, threshold=threshold)


@dataclass(frozen=True)
class AlphaBetaCost(AllreduceCost):
    """``alpha + beta * n`` seconds for n > 0 bytes; 0 for n = 0."""

    alpha: float            # seconds
    beta: float             # seconds per byte
    kind = "alpha_beta"

    def _positive(self, x):
        return np.maximum(self.alpha + self.beta * x, 0.0)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "alpha": self.alpha, "beta": self.beta}


@dataclass(frozen=True)
class PiecewiseCost(AllreduceCost):
    """Eq. 18: ``a1 log2(D) + b1`` below ``threshold`` bytes, ``a2 D + b2`` from it on;
    seconds, clamped at 0; 0 for D = 0."""

    a1: float               # seconds per doubling of D
    b1: float               # seconds
    a2: float               # seconds per byte
    b2: float               # seconds
    threshold: float        # bytes (D_Thresh)
    kind = "piecewise"

    def _positive(self, x):
        small = self.a1 * np.log2(x) + self.b1
        large = self.a2 * x + self.b2
        return np.maximum(np.where(x < self.threshold, small, large), 0.0)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "a1": self.a1, "b1": self.b1, "a2": self.a2, "b2": self.b2,
                "threshold": self.threshold}


@dataclass(frozen=True)
class TableCost(AllreduceCost):
    """Measured points: log-log interpolation between sizes (bytes), the smallest size's time
    below it, and beyond the largest size its time plus a fitted beta (s/byte) per extra byte
    (the extrapolation :mod:`aluminum_py.tuning` uses); 0 for 0 bytes."""

    sizes: tuple            # bytes, increasing
    times: tuple            # seconds
    beta: float = field(default=float("nan"))
    kind = "table"

    def __post_init__(self):
        if math.isnan(self.beta):
            object.__setattr__(self, "beta", fit_alpha_beta(self.sizes, self.times)["beta"])

    def _positive(self, x):
        s = np.log(np.asarray(self.sizes))
        lt = np.log(np.asarray(self.times))
        inside = np.exp(np.interp(np.log(x), s, lt))
        beyond = self.times[-1] + self.beta * (x - self.sizes[-1])
        return np.where(x > self.sizes[-1], beyond, inside)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "sizes": list(self.sizes), "times": list(self.times),
                "beta": self.beta}


@dataclass(frozen=True)
class OffsetCost(AllreduceCost):
    """``base(n) + per_op`` for n > 0 bytes (:meth:`AllreduceCost.plus`)."""

    base: AllreduceCost
    per_op: float
    kind = "offset"

    def _positive(self, x):
        return self.base._positive(x) + self.per_op

    def as_dict(self) -> dict:
        return {"kind": self.kind, "base": self.base.as_dict(), "per_op": self.per_op}


def calibrate_per_op(t_f, t_b, m, cost: AllreduceCost, groups, measured: float,
                     rel_tol: float = 1e-4) -> float:
    """The per-operation cost ``d >= 0`` for which ``cost.plus(d)`` predicts the `measured`
    iteration time of the grouping `groups` (e.g. WFBP's, one all-reduce per layer: the
    grouping with the most operations, where a per-op cost shows most).  The prediction grows
    with ``d``, so this bisects; 0 when ``cost`` alone already predicts `measured` or more.
    """
    def pred(d):
        return predict_iteration(t_f, t_b, m, cost.plus(d), groups)

    if pred(0.0) >= measured:
        return 0.0
    lo, hi = 0.0, max(measured, 1e-9)
    while pred(hi) < measured:
        hi *= 2
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pred(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def _check_samples(sizes, times):
    n = np.asarray(sizes, dtype=float).ravel()
    t = np.asarray(times, dtype=float).ravel()
    if n.shape != t.shape or len(n) == 0:
        raise ValueError("sizes_bytes and times_s: one time per size, not empty")
    if not np.isfinite(n).all() or (n <= 0).any():
        raise ValueError("sizes_bytes must be positive and finite")
    if not np.isfinite(t).all() or (t <= 0).any():
        raise ValueError("times_s must be positive and finite")
    order = np.argsort(n, kind="stable")
    n, t = n[order], t[order]
    if (np.diff(n) == 0).any():
        raise ValueError("sizes_bytes: each size once")
    return n, t


def _wlstsq(x, t):
    """Weighted (1/t) least squares t ~ a x + b; returns (a, b, weighted SSE)."""
    w = 1.0 / t
    A = np.stack([x, np.ones_like(x)], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    r = (a * x + b - t) * w
    return float(a), float(b), float(r @ r)


def _fit_piecewise(n, t, threshold):
    if threshold is not None:
        k = int(np.searchsorted(n, float(threshold), side="left"))   # n[:k] < threshold
        if k < 2 or len(n) - k < 2:
            raise ValueError(f"piecewise fit: threshold {threshold} B leaves {k} size(s) below "
                             f"and {len(n) - k} from it on; each side needs at least two")
        splits = [k]
    else:
        if len(n) < 4:
            raise ValueError(f"piecewise fit: needs at least 4 sizes, got {len(n)}")
        splits = range(2, len(n) - 1)
    best = None
    for k in splits:
        a1, b1, e1 = _wlstsq(np.log2(n[:k]), t[:k])
        a2, b2, e2 = _wlstsq(n[k:], t[k:])
        if best is None or e1 + e2 < best[0] * (1 - 1e-9) - 1e-30:
            best = (e1 + e2, k, a1, b1, a2, b2)
    _, k, a1, b1, a2, b2 = best
    if threshold is None:
        lo, hi = float(n[k - 1]), float(n[k])
        threshold = hi

        def gap(d):
            return a1 * math.log2(d) + b1 - (a2 * d + b2)
        if gap(lo) * gap(hi) < 0:
            from scipy.optimize import brentq
            threshold = float(brentq(gap, lo, hi, xtol=1e-9 * hi))
    return PiecewiseCost(a1, b1, a2, b2, float(threshold))


def _update_times(cost, nbytes) -> np.ndarray:
    """t_update of each entry (seconds), with t_update(0) = 0; plain callables are called one
    value at a time (they need not be vectorised)."""
    x = np.asarray(nbytes, dtype=float)
    out = np.zeros(x.shape)
    pos = x > 0
    if pos.any():
        if isinstance(cost, AllreduceCost):
            out[pos] = cost(x[pos])
        else:
            out[pos] = [float(cost(float(v))) for v in x[pos]]
    if not np.isfinite(out).all() or (out < 0).any():
        raise ValueError("cost: all-reduce times must be finite and non-negative")
    return out


# ---------------------------------------------------------------------------------- layer inputs
def _layers(t_f, t_b, m):
    """Forward-order arrays (t_f, t_b, m), checked; t_b None -> 2 t_f (eq. 6)."""
    f = np.asarray(t_f, dtype=float)
    b = 2.0 * f if t_b is None else np.asarray(t_b, dtype=float)
    d = np.asarray(m, dtype=float)
    if f.ndim != 1 or len(f) == 0 or f.shape != b.shape or f.shape != d.shape:
        raise ValueError("t_f, t_b and m: one value per layer, same length, not empty")
    for name, v in (("t_f", f), ("t_b", b), ("m", d)):
        if not np.isfinite(v).all() or (v < 0).any():
            raise ValueError(f"{name} must be finite and non-negative")
    return f, b, d


def _backward_order(t_f, t_b, m, who):
    """(t_b, m) in backward order for the fusion planners, which do not need t_f."""
    if t_f is None:
        if t_b is None:
            raise ValueError(f"{who}: give t_b (or t_f, for t_b = 2 t_f)")
        t_f = np.zeros(np.shape(t_b))
    _, b, d = _layers(t_f, t_b, m)
    return b[::-1], d[::-1]


def _ready(b):
    """Paper's sum_{j=i}^{n-1} t_b(j) for each forward layer i (0 for layer n): when layer i's
    gradient exists, seconds after layer n's backward ended."""
    r = np.cumsum(b[:-1][::-1])[::-1]
    return np.concatenate([r, [0.0]])


@dataclass
class OSFTerms:
    """The terms of eq. 3 / eq. 11 (seconds) and the recursion behind T_update.

    Per-layer arrays are in forward order: ``tau[i]`` (eqs. 8, 15, seconds after layer n's
    backward), ``sent[i]`` bytes all-reduced right after layer i (m[i] without fusion, F^(i)
    of eq. 13 with it), ``wait[i]`` (eq. 14; zeros without fusion).
    """

    t_comp: float
    t_update: float
    t_overlap: float
    tau: np.ndarray
    sent: np.ndarray
    wait: np.ndarray

    @property
    def iteration_time(self) -> float:
        """``T_comp + T_update - T_overlap`` (seconds): forward, layer n's backward, then
        T_update."""
        return self.t_comp + self.t_update - self.t_overlap

    @property
    def scaling_factor(self) -> float:
        """``T_comp / (T_comp + T_update - T_overlap)`` (eq. 3 / 11); 1 for an empty iteration."""
        it = self.iteration_time
        return self.t_comp / it if it > 0 else 1.0


# ------------------------------------------------------------------------------ CSF, eqs. 2, 3-10
def csf(t_f, t_b, m, cost: Cost) -> float:
    """Eq. 2, C2C-based scaling factor ``T_comp / (T_comp + T_comm)`` with
    ``T_comp = sum(t_f) + sum(t_b)`` (eqs. 4-5, seconds) and ``T_comm = t_update(sum(m))``: every
    gradient in one all-reduce after all computation, no overlap (section 3.2's reading)."""
    f, b, d = _layers(t_f, t_b, m)
    t_comp = float(f.sum() + b.sum())
    t_comm = float(_update_times(cost, [d.sum()])[0])
    tot = t_comp + t_comm
    return t_comp / tot if tot > 0 else 1.0


def terms_no_fusion(t_f, t_b, m, cost: Cost) -> OSFTerms:
    """Eqs. 3-10 without fusion: one all-reduce per layer, started as soon as the layer's
    gradient exists and the previous all-reduce ended.

    ``tau(n) = 0``, ``tau(i) = max(tau(i+1) + t_update(m(i+1)), sum_{j=i}^{n-1} t_b(j))``
    (eq. 8 with the sum from j=i), ``T_update = tau(1) + t_update(m(1))`` (eq. 9),
    ``T_overlap = sum_{i=1}^{n-1} t_b(i)`` (eq. 10), ``T_comp = sum t_f + sum t_b`` (eqs. 4-5).
    Inputs in forward order (seconds, bytes).
    """
    f, b, d = _layers(t_f, t_b, m)
    u = _update_times(cost, d)
    r = _ready(b)
    n = len(d)
    tau = np.zeros(n)
    for i in range(n - 2, -1, -1):
        tau[i] = max(tau[i + 1] + u[i + 1], r[i])
    return OSFTerms(float(f.sum() + b.sum()), float(tau[0] + u[0]), float(b[:-1].sum()),
                    tau, d.copy(), np.zeros(n))


def iteration_time_no_fusion(t_f, t_b, m, cost: Cost) -> float:
    """Iteration time (seconds) without fusion: the denominator of eq. 3 (eqs. 4-10)."""
    return terms_no_fusion(t_f, t_b, m, cost).iteration_time


def scaling_factor_no_fusion(t_f, t_b, m, cost: Cost) -> float:
    """OSF (eq. 3) without fusion: ``T_comp / iteration time``, at most 1."""
    return terms_no_fusion(t_f, t_b, m, cost).scaling_factor


# ---------------------------------------------------------------------------- fusion, eqs. 11-16
def _buffer_recursion(b, d, buffer_bytes, timeout):
    """Eqs. 12-14 in backward order (index k is forward layer n-1-k).

    Returns (B, F, W, flushed): bytes buffered once layer k has joined (eq. 12), bytes sent
    after layer k (eq. 13), the wait before sending them (eq. 14, seconds), and whether the
    buffer is sent after layer k (kept apart from F > 0 because gradients may have 0 bytes).
    """
    Q, to = float(buffer_bytes), float(timeout)
    if not Q >= 0 or not to >= 0:
        raise ValueError("buffer_bytes and timeout must be non-negative (math.inf allowed)")
    tb, D = b[::-1], d[::-1]
    n = len(D)
    B, F, W = np.zeros(n), np.zeros(n), np.zeros(n)
    flushed = np.zeros(n, dtype=bool)
    for k in range(n):
        # eq. 12: a fresh buffer at layer n and after each send
        B[k] = D[k] if k == 0 or flushed[k - 1] else B[k - 1] + D[k]
        if k == n - 1:                              # eq. 13: layer 1, nothing left to wait for
            flushed[k] = True
        elif tb[k + 1] > to:                        # eqs. 13-14: timeout during the next backward
            flushed[k], W[k] = True, to
        elif B[k] + D[k + 1] > Q:                   # the next gradient does not fit
            flushed[k], W[k] = True, tb[k + 1]
        if flushed[k]:
            F[k] = B[k]
    return B, F, W, flushed


def terms_fusion(t_f, t_b, m, cost: Cost, buffer_bytes: float, timeout: float) -> OSFTerms:
    """Eqs. 11-16: tensor fusion with a buffer of ``buffer_bytes`` bytes (Q) and ``timeout``
    seconds (math.inf allowed for both).

    After layer i's backward its gradient joins the buffer (eq. 12); the buffer is all-reduced
    (eq. 13) after layer 1, when layer i-1's backward takes longer than the timeout (waiting
    ``timeout``), or when layer i-1's gradient would not fit (waiting ``t_b(i-1)`` to find out)
    (eq. 14).  ``tau(n) = 0``, ``tau(i) = max(tau(i+1) + t_wait(i+1) + t_update(F(i+1)),
    sum_{j=i}^{n-1} t_b(j))`` (eq. 15), ``T_update = tau(1) + t_update(F(1))`` (eq. 16), with
    ``t_update(0) = 0``.  See the module docstring for the repaired eqs. 12-13.  With an
    infinite buffer and timeout this is :func:`csf`'s single all-reduce after all computation.
    """
    f, b, d = _layers(t_f, t_b, m)
    _, F, W, _ = _buffer_recursion(b, d, buffer_bytes, timeout)
    u = _update_times(cost, F)
    r = _ready(b)[::-1]                                          # backward order
    n = len(d)
    tau = np.zeros(n)
    for k in range(1, n):
        tau[k] = max(tau[k - 1] + W[k - 1] + u[k - 1], r[k])
    return OSFTerms(float(f.sum() + b.sum()), float(tau[-1] + u[-1]), float(b[:-1].sum()),
                    tau[::-1].copy(), F[::-1].copy(), W[::-1].copy())


def iteration_time_fusion(t_f, t_b, m, cost: Cost, buffer_bytes: float,
                          timeout: float) -> float:
    """Iteration time (seconds) with fusion: the denominator of eq. 11 (eqs. 12-16)."""
    return terms_fusion(t_f, t_b, m, cost, buffer_bytes, timeout).iteration_time


def scaling_factor_fusion(t_f, t_b, m, cost: Cost, buffer_bytes: float,
                          timeout: float) -> float:
    """OSF_fusion (eq. 11): ``T_comp / iteration time``, at most 1."""
    return terms_fusion(t_f, t_b, m, cost, buffer_bytes, timeout).scaling_factor


def buffer_groups(t_b, m, buffer_bytes: float, timeout: float = math.inf):
    """The fusion groups eqs. 12-14 form, in BACKWARD order, with each group's wait (seconds
    between its last gradient being ready and its all-reduce being issued, eq. 14).

    Returns ``(groups, waits)``; ``predict_iteration(..., groups, delays=waits)`` times them
    from the gradients' ready times (never later than :func:`iteration_time_fusion`).  With
    ``timeout=math.inf`` this is fixed-threshold fusion with a buffer capacity of
    ``buffer_bytes`` (a gradient larger than the buffer travels alone).
    """
    b = np.asarray(t_b, dtype=float)
    _, b, d = _layers(b, b, m)
    _, _, W, flushed = _buffer_recursion(b, d, buffer_bytes, timeout)
    groups, waits, start = [], [], 0
    for k in np.flatnonzero(flushed):
        groups.append((start, int(k)))
        waits.append(float(W[k]))
        start = int(k) + 1
    return groups, waits


# --------------------------------------------------------------------- adaptive fusion, eq. 17
def adaptive_fusion(t_f, t_b, m, cost: Cost, *,
                    channel_aware: bool = False) -> list[tuple[int, int]]:
    """adaFusion (eq. 17): walking the gradients in backward order, layer i joins the pending
    group (B, the buffer B^(i+1)) only when
    ``t_update(B + m(i)) + t_b(i) < t_update(B) + t_update(m(i))``: the fused all-reduce plus
    the time the buffer waits for layer i's backward beats two separate all-reduces.
    With ``alpha + beta n`` costs the rule is ``t_b(i) < alpha``.

    Inputs in forward order (seconds, bytes; ``t_f`` is not used by the rule and may be None).
    Returns inclusive ``(first, last)`` groups in BACKWARD order (index k is forward layer
    n-1-k), for :func:`predict_iteration` and the gradient synchronizer.

    Guarantee (any cost with t(0) = 0, monotone or not): the grouping's
    :func:`predict_iteration` is never above WFBP's (:func:`iteration_time_no_fusion`).  Proof
    by induction over the layers in backward order: let E be when the pending group B would
    finish if sent now and e when WFBP has finished everything so far; E <= e holds at layer n.
    Not fusing layer i sends B (ending at E <= e) and starts a group that ends at most at
    ``max(E, r(i)) + t(m(i)) <= max(e, r(i)) + t(m(i))``, WFBP's new e.  Fusing gives
    ``max(c, r(i)) + t(B + m(i)) <= max(c, r(i+1)) + t_b(i) + t(B + m(i)) < E + t(m(i)) <= e_new``
    (c: when the previous group ended, r: when gradients are ready).  There is no such guarantee
    against one fused group (except for alpha-beta costs and positive sizes, where each later
    group starts at a layer with ``t_b >= alpha``), nor against a fixed fusion threshold: the
    rule charges the wait ``t_b(i)`` even when the channel is still busy with earlier groups and
    the wait would cost nothing.  The tests show both counterexamples.

    ``channel_aware=True`` (not in the paper) compares the two finish times with the channel's
    busy time: fuse when ``max(c, r(i)) + t(B + m(i)) < max(max(c, r(i+1)) + t(B), r(i)) +
    t(m(i))``.  For non-decreasing costs it is eq. 17 whenever the channel is idle when B is
    ready; it keeps the WFBP guarantee and fuses small gradients queued behind a long
    all-reduce.  It is still greedy (no optimality claim).
    """
    tb, D = _backward_order(t_f, t_b, m, "adaptive_fusion")
    r = np.cumsum(tb)                       # ready times (backward order, any origin)
    n = len(D)
    groups, start, buf = [], 0, float(D[0])
    t_buf = _update_times(cost, [buf])[0]
    free = 0.0                              # when the last sent group's all-reduce ends
    for k in range(1, n):
        t_sep, t_fused = _update_times(cost, [D[k], buf + D[k]])
        if channel_aware:
            sent_end = max(free, r[k - 1]) + t_buf
            fuse = max(free, r[k]) + t_fused < max(sent_end, r[k]) + t_sep
        else:
            fuse = t_fused + tb[k] < t_buf + t_sep
        if fuse:
            buf += float(D[k])
            t_buf = t_fused
        else:
            groups.append((start, k - 1))
            free = max(free, r[k - 1]) + t_buf
            start, buf, t_buf = k, float(D[k]), t_sep
    groups.append((start, n - 1))
    return groups


def optimal_groups(t_f, t_b, m, cost: Cost) -> list[tuple[int, int]]:
    """The fusion groups that minimise :func:`predict_iteration` (not in the paper): exact
    dynamic programming over the backward order.

    With one channel in order, a group's all-reduce starts at ``max(channel free, its last
    gradient ready)``; the rest of the timeline depends on a prefix of groups only through
    when the channel becomes free, and later finish times never decrease when it becomes free
    later, so the earliest free time per prefix is optimal:
    ``E[k] = min_j max(E[j], ready[k-1]) + t_update(bytes j..k-1)``, O(n^2) cost evaluations.
    Every other grouping -- WFBP, fixed thresholds, :func:`adaptive_fusion`, one group -- is
    predicted no faster.  Inputs and result as :func:`adaptive_fusion`.
    """
    tb, D = _backward_order(t_f, t_b, m, "optimal_groups")
    ready = np.cumsum(tb)
    csum = np.concatenate([[0.0], np.cumsum(D)])
    n = len(D)
    E = np.full(n + 1, -np.inf)
    E[0] = 0.0
    arg = np.zeros(n + 1, dtype=int)
    for k in range(1, n + 1):
        u = _update_times(cost, csum[k] - csum[:k])        # group j..k-1 for every j < k
        ends = np.maximum(E[:k], ready[k - 1]) + u
        j = int(np.argmin(ends))                           # ties: the fewest groups (smallest j)
        E[k], arg[k] = ends[j], j
    groups, k = [], n
    while k > 0:
        groups.append((int(arg[k]), k - 1))
        k = int(arg[k])
    return groups[::-1]


# ---------------------------------------------------------------------- explicit groupings
@dataclass
class IterationTimeline:
    """The timeline of one iteration for an explicit grouping (seconds from the start of the
    forward pass; per group, in BACKWARD order)."""

    groups: list
    nbytes: np.ndarray              # bytes all-reduced per group
    ready: np.ndarray               # when the group's last gradient exists
    start: np.ndarray               # when its all-reduce starts
    end: np.ndarray                 # when its all-reduce ends
    t_comp: float                   # sum(t_f) + sum(t_b)

    @property
    def iteration_time(self) -> float:
        return float(max(self.end[-1], self.t_comp))

    @property
    def scaling_factor(self) -> float:
        it = self.iteration_time
        return self.t_comp / it if it > 0 else 1.0


def _check_groups(groups, n):
    expect = 0
    out = []
    for g in groups:
        first, last = (int(x) for x in g)
        if first != expect or last < first:
            raise ValueError(f"groups: {list(groups)} do not cover 0..{n - 1} in backward order")
        out.append((first, last))
        expect = last + 1
    if expect != n:
        raise ValueError(f"groups: {list(groups)} do not cover 0..{n - 1} in backward order")
    return out


def schedule(t_f, t_b, m, cost: Cost, groups, delays=None) -> IterationTimeline:
    """Timeline for explicit fusion groups (inclusive ranges in BACKWARD order).

    A group's all-reduce starts when its last gradient exists plus its delay (``delays``,
    seconds per group, default 0: e.g. a fusion wait) and the previous group's all-reduce has
    ended (one communication channel, in order); it lasts ``t_update(group bytes)``.
    One group per layer is eqs. 8-9 (WFBP); one group of everything is CSF's single all-reduce.
    """
    f, b, d = _layers(t_f, t_b, m)
    n = len(d)
    groups = _check_groups(groups, n)
    tb, D = b[::-1], d[::-1]
    done = f.sum() + np.cumsum(tb)                  # gradient k exists (backward order)
    nb = np.array([D[a:z + 1].sum() for a, z in groups])
    dl = np.zeros(len(groups)) if delays is None else np.asarray(delays, dtype=float)
    if dl.shape != (len(groups),) or not np.isfinite(dl).all() or (dl < 0).any():
        raise ValueError("delays: one non-negative value per group")
    u = _update_times(cost, nb)
    ready = np.array([done[z] for _, z in groups])
    start, end = np.zeros(len(groups)), np.zeros(len(groups))
    free = 0.0
    for g in range(len(groups)):
        start[g] = max(free, ready[g] + dl[g])
        end[g] = free = start[g] + u[g]
    return IterationTimeline(groups, nb, ready, start, end, float(f.sum() + b.sum()))


def predict_iteration(t_f, t_b, m, cost: Cost, groups, delays=None) -> float:
    """Iteration time (seconds) for explicit fusion groups in BACKWARD order: forward, backward
    and the chain of group all-reduces of :func:`schedule`.  One group per layer equals
    :func:`iteration_time_no_fusion`; compare policies (WFBP, fixed thresholds via
    :func:`buffer_groups`, :func:`adaptive_fusion`, LIBRA's groups) under the same cost."""
    return schedule(t_f, t_b, m, cost, groups, delays).iteration_time


def scaling_factor_groups(t_f, t_b, m, cost: Cost, groups, delays=None) -> float:
    """``T_comp / predict_iteration(...)`` for explicit groups, at most 1."""
    return schedule(t_f, t_b, m, cost, groups, delays).scaling_factor
