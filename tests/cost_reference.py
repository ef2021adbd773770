"""The allreduce cost model written out again, independently of aluminum_py.algorithms, so a
test can say which algorithm *should* win without asking the library.

Costs (alpha: latency per message, beta: seconds per byte sent, gamma: seconds per byte
reduced) from Thakur, Rabenseifner and Gropp, "Optimization of Collective Communication
Operations in MPICH" (2005), for p ranks and n bytes:

* ring: 2(p-1) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
* recursive doubling on the largest power of two p' <= p: log2(p') (alpha + n beta + n gamma)
* Rabenseifner (recursive halving + doubling) on p': 2 log2(p') alpha + 2 (p'-1)/p' n beta
  + (p'-1)/p' n gamma
* when p is not a power of two, the p - p' extra ranks fold in first and get the result last:
  one exchange of the whole vector each way plus one reduction, 2 (alpha + n beta) + n gamma.

Ties go to the earlier name in TIE_ORDER (the documented rule: docs/tuning.md).
"""

TIE_ORDER = ("recursive_doubling", "rabenseifner", "ring")


def pow2_below(p: int) -> int:
    q = 1
    while q * 2 <= p:
        q *= 2
    return q


def log2(q: int) -> int:
    return q.bit_length() - 1


def cost(algorithm: str, p: int, n: float, params) -> float:
    a, b, g = params
    if p == 1:
        return 0.0
    q = pow2_below(p)
    fold = 0.0 if q == p else 2 * (a + n * b) + n * g
    if algorithm == "ring":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    if algorithm == "recursive_doubling":
        return log2(q) * (a + n * b + n * g) + fold
    if algorithm == "rabenseifner":
        return 2 * log2(q) * a + 2 * (q - 1) / q * n * b + (q - 1) / q * n * g + fold
    raise AssertionError(algorithm)


def cheapest(p: int, n: float, params) -> str:
    """The algorithm the cost model says is fastest (ties: TIE_ORDER)."""
    best = None
    for alg in TIE_ORDER:
        if best is None or cost(alg, p, n, params) < cost(best, p, n, params):
            best = alg
    return best
