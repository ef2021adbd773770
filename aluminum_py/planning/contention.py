"""LIBRA's contention model (paper section III-A, eqs. 5-6, and the all-reduce costs of eq. 4).

Units: computation sizes ``b`` are seconds (the computation's time when it runs alone),
communication sizes ``c`` are bytes, thread counts ``r`` are GPU threads given to the
communication kernel, rates are bytes per second.

* ``g(b, r) = b / (a1 - a2 r)``: computation time when ``r`` communication threads contend
  (a1 = 1 means no slowdown without communication).
* ``p(c, r) = c_hat / (g1 - g2 exp(-g3 r^g4))``: overlapped transmission time;
  ``q(c, r)`` the same form with its own parameters, for non-overlapped transmission.
* ``c_hat`` and the startup ``a`` come from the all-reduce algorithm and the rank count N
  (ring: a = 2(N-1) alpha, c_hat = 2(N-1)/N c; recursive doubling: a = log2(N) alpha,
  c_hat = log2(N) c; Rabenseifner: a = 2 log2(N) alpha, c_hat = 2(N-1)/N c), so a model fitted at
  one rank count converts to another (:meth:`ContentionModel.with_nranks`, paper V-B).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner")


@dataclass(frozen=True)
class Rate:
    """Transmission rate ``g1 - g2 exp(-g3 r^g4)`` in bytes/s as a function of threads r."""

    g1: float
    g2: float
    g3: float
    g4: float = 0.6

    def __call__(self, r):
        return self.g1 - self.g2 * np.exp(-self.g3 * np.power(r, self.g4))


@dataclass(frozen=True)
class ContentionModel:
    """g, p, q of LIBRA plus the all-reduce startup/volume for `nranks` ranks (see module)."""

    a1: float
    a2: float
    overlapped: Rate
    non_overlapped: Rate
    alpha: float                     # seconds of startup per all-reduce step
    nranks: int = 8
    algorithm: str = "ring"
    fit_error: dict = field(default=None, compare=False, hash=False)

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: {self.algorithm!r} not in {ALGORITHMS}")
        if self.nranks < 1:
            raise ValueError(f"nranks: {self.nranks} is not a rank count")

    # all-reduce structure
    @property
    def startup(self) -> float:
        """a: the all-reduce startup overhead (seconds)."""
        n = self.nranks
        if n == 1:
            return 0.0
        if self.algorithm == "ring":
            return 2 * (n - 1) * self.alpha
        lg = math.ceil(math.log2(n))
        return (lg if self.algorithm == "recursive_doubling" else 2 * lg) * self.alpha

    def c_hat(self, c):
        """Bytes each rank transmits for a gradient of c bytes."""
        n = self.nranks
        if n == 1:
            return 0.0 * np.asarray(c, dtype=float)
        if self.algorithm == "recursive_doubling":
            return math.ceil(math.log2(n)) * np.asarray(c, dtype=float)
        return 2 * (n - 1) / n * np.asarray(c, dtype=float)

    def with_nranks(self, nranks: int) -> "ContentionModel":
        """The same fitted parameters at another rank count (only a and c_hat change)."""
        return replace(self, nranks=nranks)

    # the contention functions
    def g(self, b, r):
        """Computation time of size b (s) with r communication threads running beside it."""
        return np.asarray(b, dtype=float) / (self.a1 - self.a2 * np.asarray(r, dtype=float))

    def p(self, c, r):
        """Transmission time (s) of c bytes, overlapped with computation, r threads."""
        return self.c_hat(c) / self.overlapped(np.asarray(r, dtype=float))

    def q(self, c, r):
        """Transmission time (s) of c bytes, not overlapped, r threads."""
        return self.c_hat(c) / self.non_overlapped(np.asarray(r, dtype=float))

    # overlap and residual times, eqs. 8-11 (vectorised over any broadcastable arguments)
    def overlap(self, c, b, r):
        """(f_o, f_b, f_c): overlapped time, residual computation, residual communication."""
        c = np.asarray(c, dtype=float)
        b = np.asarray(b, dtype=float)
        comm = self.p(c, r) + self.startup
        comp = self.g(b, r)
        both = (c > 0) & (b > 0)
        fo = np.where(both, np.minimum(comm, comp), 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            db = np.where(b > 0, 1.0 - np.where(both, fo / comp, 0.0), 0.0)
            dc = np.where(c > 0, 1.0 - np.where(both, fo / comm, 0.0), 0.0)
        fb = b * db
        fc = (self.q(c, r) + self.startup) * dc
        return fo, fb, fc

    @classmethod
    def example(cls, nranks: int = 8, algorithm: str = "ring") -> "ContentionModel":
        """A documented model with plausible parameters derived from the paper's Fig. 1a setting
        (V100s, 50 Gb/s links, 8 nodes; 112.7 MB of gradients, 25.7 ms of computation alone):

        * computation +38% at 2048 communication threads: a1 = 1,
          a2 = (1 - 1/1.38) / 2048 = 1.344e-4 per thread;
        * transmission approaches the 50 Gb/s = 6.25 GB/s link rate with diminishing returns
          (g4 = 0.6 as in the paper): 5% of it with almost no threads (g2 = 0.95 g1) and 90% at
          512 threads (g3 = ln(9.5) / 512^0.6); non-overlapped transmission saturates sooner
          (90% at 128 threads);
        * alpha = 10 us per all-reduce step (RDMA latency plus kernel launch).
        """
        link = 50e9 / 8
        g3_over = math.log(9.5) / 512 ** 0.6
        g3_non = math.log(9.5) / 128 ** 0.6
        return cls(a1=1.0, a2=(1 - 1 / 1.38) / 2048, overlapped=Rate(link, 0.95 * link, g3_over),
                   non_overlapped=Rate(link, 0.95 * link, g3_non), alpha=10e-6, nranks=nranks,
                   algorithm=algorithm)

    @classmethod
    def fit(cls, samples: dict, nranks: int, algorithm: str = "ring", alpha: float | None = None,
            g4: float = 0.6) -> "ContentionModel":
        """Fit the model to profiled samples (scipy least squares).

        Args:
            samples: {"computation": [(b_alone_s, r, measured_s), ...],
                      "overlapped": [(c_bytes, r, measured_s), ...],
                      "non_overlapped": [(c_bytes, r, measured_s), ...]}
              (communication times include the startup a).
            nranks, algorithm: where the samples were measured (they define a and c_hat).
            alpha: the per-step startup; None fits it from the non-overlapped samples.
        Returns:
            the model; ``model.fit_error`` holds the relative RMS error of each part.
        """
        from scipy.optimize import curve_fit
        comp = np.asarray(samples["computation"], dtype=float)
        over = np.asarray(samples["overlapped"], dtype=float)
        non = np.asarray(samples["non_overlapped"], dtype=float)
        proto = cls(1.0, 0.0, Rate(1, 0, 0, g4), Rate(1, 0, 0, g4), alpha or 0.0, nranks, algorithm)
        steps = proto.startup / proto.alpha if proto.alpha else (
            replace(proto, alpha=1.0).startup)

        # computation: measured = b / (a1 - a2 r)  <=>  b / measured = a1 - a2 r (linear)
        A = np.stack([np.ones(len(comp)), -comp[:, 1]], axis=1)
        (a1, a2), *_ = np.linalg.lstsq(A, comp[:, 0] / comp[:, 2], rcond=None)

        def comm_model(with_alpha):
            def f(x, g1, g2, g3, al=None):
                c, r = x
                a = steps * (al if with_alpha else (alpha or 0.0))
                return proto.c_hat(c) / (g1 - g2 * np.exp(-g3 * np.power(r, g4))) + a
            return f

        def fit_rate(data, with_alpha):
            x = (data[:, 0], data[:, 1])
            rate_max = float(np.max(proto.c_hat(data[:, 0]) / data[:, 2])) * 1.2
            p0 = [rate_max, 0.9 * rate_max, 0.05] + ([1e-5] if with_alpha else [])
            lower = [0.0, 0.0, 0.0] + ([0.0] if with_alpha else [])
            upper = [np.inf, np.inf, np.inf] + ([np.inf] if with_alpha else [])
            popt, _ = curve_fit(comm_model(with_alpha), x, data[:, 2], p0=p0, bounds=(lower, upper),
                                sigma=data[:, 2], maxfev=20000)
            return popt

        fit_alpha = alpha is None
        pn = fit_rate(non, fit_alpha)
        al = float(pn[3]) if fit_alpha else float(alpha)
        alpha = al
        po = fit_rate(over, False)
        model = cls(float(a1), float(a2), Rate(*map(float, po[:3]), g4), Rate(*map(float, pn[:3]), g4),
                    al, nranks, algorithm)

        def rel_rms(pred, meas):
            return float(np.sqrt(np.mean(((pred - meas) / meas) ** 2)))

        err = {"computation": rel_rms(model.g(comp[:, 0], comp[:, 1]), comp[:, 2]),
               "overlapped": rel_rms(model.p(over[:, 0], over[:, 1]) + model.startup, over[:, 2]),
               "non_overlapped": rel_rms(model.q(non[:, 0], non[:, 1]) + model.startup, non[:, 2])}
        return replace(model, fit_error=err)
