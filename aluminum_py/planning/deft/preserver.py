"""DeFT's Preserver (section IV-C): the convergence check of a delayed-update schedule's
variable batch sequence (:func:`preserver_ok`, from the loss expectation :func:`expected_next_loss`
and :func:`preserver_ratio`) and its feedback loop that grows the knapsack capacities until the
check passes (:func:`tune_capacity`).

Eq. 1 as printed has ``(s_t - S* - eta Delta s_t)`` in its first term; ``Delta s_t`` is the
random step, the expectation needs its mean ``mu_t`` (the reflected Gaussian of Yin et al., ref.
[25], and the definition of ``a`` in the same equation).  :func:`expected_next_loss` uses
``mu_t``.
"""
from __future__ import annotations

import math

import numpy as np

from .model import MU_GLOO
from .scheduler import DelayedUpdateScheduler


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def expected_next_loss(s: float, grad_mean: float, grad_std: float, lr: float,
                       batch_size: float, target: float = 0.0) -> float:
    """Expected loss after one step of the Gaussian walk with rebound (paper eq. 1, ref. [25]).

    ``s_{t+1} = s_t - eta ds`` if that is ``>= S*``, else ``2 S* + eta ds - s_t``, with
    ``ds ~ N(mu_t, sigma_t^2 / B)``.  Hence ``s_{t+1} - S* = |s_t - S* - eta ds|`` and

        E_B(s_{t+1}) = (s_t - S* - eta mu_t) (Phi(a) - Phi(-a))
                       + (eta sigma_t / sqrt(B)) sqrt(2/pi) exp(-a^2/2) + S*,
        a = (s_t - S* - eta mu_t) sqrt(B) / (eta sigma_t)

    (the paper prints ``eta Delta s_t`` in the first term; the expectation has the mean
    ``mu_t``).  Args: ``s`` = s_t, ``grad_mean`` = mu_t, ``grad_std`` = sigma_t, ``lr`` = eta,
    ``batch_size`` = B, ``target`` = S*.
    """
    if batch_size <= 0 or lr < 0 or grad_std < 0:
        raise ValueError("batch_size must be positive, lr and grad_std non-negative")
    m = s - target - lr * grad_mean
    scale = lr * grad_std / math.sqrt(batch_size)
    if scale == 0:
        return target + abs(m)
    a = m / scale
    return m * (_phi(a) - _phi(-a)) + scale * math.sqrt(2 / math.pi) * math.exp(-a * a / 2) + target


def _per_iteration(x, n, name):
    if np.ndim(x) == 0:
        return [float(x)] * n
    xs = [float(v) for v in x]
    if len(xs) != n:
        raise ValueError(f"{name}: a scalar or one value per iteration ({n})")
    return xs


def preserver_ratio(batch_multipliers, s0: float, grad_mean, grad_std, lr: float,
                    batch_size: float, target: float = 0.0) -> float:
    """``E_B(s_{A+N}) / E_{k B}(s_{A+N})``: expected loss after N = sum(k) iterations of plain
    training (O_B: N steps of batch B) over that of DeFT's sequence (O_D: one step of batch
    k_j B per group), both iterating :func:`expected_next_loss` from ``s0`` (section IV-C2).
    ``grad_mean``/``grad_std`` are scalars or one value per iteration; a merged step uses the
    values of its first iteration (where it starts)."""
    ks = [int(k) for k in batch_multipliers]
    if not ks or any(k < 1 for k in ks):
        raise ValueError("batch_multipliers: positive integers, at least one")
    n = sum(ks)
    mu = _per_iteration(grad_mean, n, "grad_mean")
    sd = _per_iteration(grad_std, n, "grad_std")
    sb = s0
    for i in range(n):
        sb = expected_next_loss(sb, mu[i], sd[i], lr, batch_size, target)
    sd_, p = s0, 0
    for k in ks:
        sd_ = expected_next_loss(sd_, mu[p], sd[p], lr, k * batch_size, target)
        p += k
    if sd_ == 0:
        return 1.0 if sb == 0 else math.inf
    return sb / sd_


def preserver_ok(batch_multipliers, s0: float, grad_mean, grad_std, lr: float,
                 batch_size: float, target: float = 0.0, eps: float = 0.01) -> bool:
    """The Preserver's convergence check (section IV-C): accept DeFT's schedule when

        1 - eps <= E_B(s_{A+N}) / E_{k_m B}(s_{A+N}) <= 1 + eps

    where both expectations iterate eq. 1 (see :func:`expected_next_loss`)

        E_B(s_{t+1}) = (s_t - S* - eta mu_t)(Phi(a) - Phi(-a))
                       + (eta sigma_t / sqrt(B)) sqrt(2/pi) e^{-a^2/2} + S*,
        a = (s_t - S* - eta mu_t) sqrt(B) / (eta sigma_t),

    N times with batch B (plain training) and once per group with batch k_j B (DeFT's variable
    batch sequence ``batch_multipliers`` = k_1..k_m, sum N; e.g. from
    :meth:`DelayedUpdateScheduler.batch_multipliers`).  The paper uses eps = 0.01."""
    r = preserver_ratio(batch_multipliers, s0, grad_mean, grad_std, lr, batch_size, target)
    return 1 - eps <= r <= 1 + eps


def tune_capacity(comm, forward, backward, *, s0: float, grad_mean, grad_std, lr: float,
                  batch_size: float, target: float = 0.0, eps: float = 0.01, links: int = 1,
                  mu: float = MU_GLOO, growth: float = 1.1, max_tries: int = 10,
                  horizon: int = 64, resolution: float | None = None):
    """The Preserver's feedback loop (section IV-C3): build the scheduler, check its batch
    sequence over ``horizon`` iterations with :func:`preserver_ok`, and while it fails grow the
    knapsack capacities by ``growth`` (up to ``max_tries`` times, as the paper).  ``grad_mean``
    and ``grad_std`` must be scalars here.  Returns ``(scheduler, ratio, passed)``."""
    scale = 1.0
    sched = ratio = None
    for _ in range(max_tries + 1):
        sched = DelayedUpdateScheduler(comm, forward, backward, links=links, mu=mu,
                                       capacity_scale=scale, resolution=resolution)
        ks = sched.batch_multipliers(horizon)
        if not ks:
            ratio = 0.0
        else:
            ratio = preserver_ratio(ks, s0, grad_mean, grad_std, lr, batch_size, target)
        if 1 - eps <= ratio <= 1 + eps:
            return sched, ratio, True
        scale *= growth
    return sched, ratio, False

