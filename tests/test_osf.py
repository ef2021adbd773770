"""OSF (eqs. 2-18): cost models and fits, the no-fusion and fusion recursions against hand
computations, CSF, adaptive fusion, explicit groupings; hypothesis properties."""
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from aluminum_py.planning import osf
from aluminum_py.planning.osf import AllreduceCost

INF = math.inf


# ------------------------------------------------------------------------------- strategies
@st.composite
def layers(draw, min_n=1, max_n=8, positive_bytes=False, positive_tb=False):
    """(t_f, t_b, m) in forward order: seconds, seconds, bytes."""
    n = draw(st.integers(min_n, max_n))
    time = st.floats(1e-7 if positive_tb else 0.0, 2e-2, allow_nan=False)
    t_f = draw(st.lists(st.floats(0.0, 1e-2, allow_nan=False), min_size=n, max_size=n))
    t_b = draw(st.lists(time, min_size=n, max_size=n))
    m = draw(st.lists(st.integers(1 if positive_bytes else 0, 10 ** 8), min_size=n, max_size=n))
    return t_f, t_b, m


alphas = st.floats(0.0, 1e-3, allow_nan=False)
betas = st.floats(0.0, 1e-8, allow_nan=False)
buffers = st.one_of(st.just(INF), st.floats(0.0, 2e8, allow_nan=False))
timeouts = st.one_of(st.just(INF), st.floats(0.0, 3e-2, allow_nan=False))


@st.composite
def piecewise_costs(draw):
    """A monotone eq.-18 cost continuous at the threshold (what a good fit looks like)."""
    a1 = draw(st.floats(1e-8, 1e-5))
    a2 = draw(st.floats(1e-12, 1e-8))
    b2 = draw(st.floats(1e-6, 1e-4))
    thr = draw(st.floats(1e3, 1e6))
    return AllreduceCost.piecewise(a1, a2 * thr + b2 - a1 * math.log2(thr), a2, b2, thr)


@st.composite
def any_costs(draw):
    """Arbitrary non-negative costs, not necessarily monotone (a lookup on log2 size)."""
    table = draw(st.lists(st.floats(0.0, 1e-2, allow_nan=False), min_size=28, max_size=28))
    return lambda x: table[min(27, int(math.log2(x)))] if x > 0 else 0.0


def per_layer(n):
    return [(k, k) for k in range(n)]


# --------------------------------------------------------------------------- cost functions
def test_alpha_beta_cost():
    c = AllreduceCost.alpha_beta(5e-6, 1e-9)
    assert c(0) == 0.0
    assert c(1000) == pytest.approx(5e-6 + 1e-6)
    np.testing.assert_allclose(c([0, 1000, 2000]), [0.0, 6e-6, 7e-6])
    assert isinstance(c(10), float) and c(np.array([1, 2])).shape == (2,)
    with pytest.raises(ValueError, match="non-negative"):
        c(-1)
    assert c.as_dict() == {"kind": "alpha_beta", "alpha": 5e-6, "beta": 1e-9}


def test_piecewise_cost_eq18():
    c = AllreduceCost.piecewise(2e-6, 1e-6, 1e-9, 3e-5, 1 << 16)
    assert c(0) == 0.0                                       # log2(0) is not used
    assert c(1 << 10) == pytest.approx(2e-6 * 10 + 1e-6)     # below D_Thresh: logarithmic
    assert c(1 << 16) == pytest.approx(1e-9 * 65536 + 3e-5)  # from D_Thresh on: linear
    np.testing.assert_allclose(c([0, 1 << 10]), [0.0, 21e-6])
    assert AllreduceCost.piecewise(1e-6, -1e-5, 1e-9, 0, 1e6)(2) == 0.0   # clamped at 0


@settings(max_examples=50, deadline=None)
@given(alphas, betas, piecewise_costs())
def test_t_update_of_zero_is_zero(alpha, beta, pw):
    assert AllreduceCost.alpha_beta(alpha, beta)(0) == 0.0
    assert pw(0) == 0.0
    assert AllreduceCost.fit([8, 64, 512, 4096], [1e-5, 2e-5, 4e-5, 9e-5], "table")(0) == 0.0


def test_plain_callables_get_t_update_of_zero():
    """A plain callable that would charge its overhead for 0 bytes is not asked about 0."""
    t_f, t_b, m = [1e-3] * 4, [2e-3, 1e-4, 3e-3, 1e-4], [4e6, 1e3, 2e5, 8e6]
    raw = lambda x: 1e-4 + 1e-9 * x                              # noqa: E731 (raw(0) = 1e-4)
    ab = AllreduceCost.alpha_beta(1e-4, 1e-9)
    for q, to in [(INF, INF), (1e6, 1e-3), (0, INF)]:
        assert osf.iteration_time_fusion(t_f, t_b, m, raw, q, to) == pytest.approx(
            osf.iteration_time_fusion(t_f, t_b, m, ab, q, to))
    assert osf.iteration_time_no_fusion(t_f, t_b, [0, 0, 0, 0], raw) == pytest.approx(
        sum(t_f) + sum(t_b))                                    # nothing to send: computation


# ---------------------------------------------------------------------------------- fitting
SIZES = np.array([2 ** k for k in range(2, 27)], dtype=float)       # 4 B .. 64 MiB


@pytest.mark.parametrize("alpha,beta", [(3e-6, 2e-10), (5e-5, 1e-9), (1e-6, 0.0)])
def test_fit_recovers_alpha_beta(alpha, beta):
    t = alpha + beta * SIZES
    c = AllreduceCost.fit(SIZES, t, kind="alpha_beta")
    assert c.kind == "alpha_beta"
    assert c.alpha == pytest.approx(alpha, rel=1e-6)
    assert c.beta == pytest.approx(beta, rel=1e-6, abs=1e-18)


def test_fit_alpha_beta_with_noise():
    rng = np.random.default_rng(7)
    t = (4e-6 + 5e-10 * SIZES) * rng.uniform(0.97, 1.03, len(SIZES))
    c = AllreduceCost.fit(SIZES, t)
    assert c.alpha == pytest.approx(4e-6, rel=0.1) and c.beta == pytest.approx(5e-10, rel=0.1)


def test_fit_recovers_a_discontinuous_piecewise_model():
    true = AllreduceCost.piecewise(1.5e-6, 2e-6, 8e-10, 6e-5, 45e3)     # BDP 45 KB as in §4.2
    c = AllreduceCost.fit(SIZES, true(SIZES), kind="piecewise")
    for k in ("a1", "b1", "a2", "b2"):
        assert getattr(c, k) == pytest.approx(getattr(true, k), rel=1e-6)
    assert 32768 < c.threshold <= 65536                       # the sizes bracket D_Thresh
    np.testing.assert_allclose(c(SIZES), true(SIZES), rtol=1e-9)


def test_fit_recovers_a_continuous_piecewise_model_and_its_threshold():
    a1, a2, b2, thr = 2e-6, 1e-9, 2e-5, 100e3
    true = AllreduceCost.piecewise(a1, a2 * thr + b2 - a1 * math.log2(thr), a2, b2, thr)
    c = AllreduceCost.fit(SIZES, true(SIZES), kind="piecewise")
    assert c.threshold == pytest.approx(thr, rel=1e-6)       # where the pieces meet
    for k in ("a1", "b1", "a2", "b2"):
        assert getattr(c, k) == pytest.approx(getattr(true, k), rel=1e-6)
    given_thr = AllreduceCost.fit(SIZES, true(SIZES), kind="piecewise", threshold=thr)
    assert given_thr.threshold == thr and given_thr.a2 == pytest.approx(a2, rel=1e-6)


def test_fit_rejects_bad_data():
    with pytest.raises(ValueError, match="one time per size"):
        AllreduceCost.fit([1, 2, 3], [1e-6, 2e-6])
    with pytest.raises(ValueError, match="positive"):
        AllreduceCost.fit([0, 2], [1e-6, 2e-6])
    with pytest.raises(ValueError, match="positive"):
        AllreduceCost.fit([1, 2], [1e-6, -2e-6])
    with pytest.raises(ValueError, match="at least 4"):
        AllreduceCost.fit([1, 2, 3], [1e-6, 2e-6, 3e-6], kind="piecewise")
    with pytest.raises(ValueError, match="two"):
        AllreduceCost.fit(SIZES, 1e-6 + SIZES * 1e-9, kind="piecewise", threshold=5)
    with pytest.raises(ValueError, match="kind"):
        AllreduceCost.fit(SIZES, 1e-6 + SIZES * 1e-9, kind="cubic")


def test_from_tuning_entry():
    sizes = [1 << k for k in range(3, 21)]
    n = np.array(sizes, dtype=float)
    ring = 40e-6 + 2e-10 * n                        # slow start, good bandwidth
    rd = 5e-6 + 1e-9 * n                            # fast start, poor bandwidth
    entry = {"comm_size": 4, "local_size": 4, "buffer": "host", "dtype_size": 4,
             "mpi": "test", "sizes": sizes,
             "times": {"ring": ring.tolist(), "recursive_doubling": rd.tolist()}}
    c = AllreduceCost.from_tuning_entry(entry, "ring", kind="alpha_beta")
    assert c.alpha == pytest.approx(40e-6, rel=1e-6) and c.beta == pytest.approx(2e-10, rel=1e-6)
    best = np.minimum(ring, rd)                     # auto's time: per-size minimum
    table = AllreduceCost.from_tuning_entry(entry, kind="table")
    np.testing.assert_allclose(table(n), best, rtol=1e-12)
    assert table(0) == 0.0 and table(4) == pytest.approx(best[0])
    pw = AllreduceCost.from_tuning_entry(entry)      # default: eq. 18 fitted to the minimum
    assert pw == AllreduceCost.fit(sizes, best, kind="piecewise")
    with pytest.raises(ValueError, match="nccl"):
        AllreduceCost.from_tuning_entry(entry, "nccl")


def test_table_cost_interpolates_and_extrapolates():
    c = AllreduceCost.fit([100, 10000], [1e-5, 1e-3], kind="table")
    assert c(1000) == pytest.approx(1e-4)            # log-log midpoint
    assert c(50) == pytest.approx(1e-5)              # below the smallest size: its time
    assert c(20000) == pytest.approx(1e-3 + c.beta * 10000)


# ----------------------------------------------------------------- no fusion, eqs. 3-10 by hand
def test_no_fusion_communication_bound_by_hand():
    # forward order: layers 1, 2, 3; t_update(m) = 1 + m
    t_f, t_b, m = [1, 1, 1], [2, 3, 4], [1, 2, 5]
    cost = AllreduceCost.alpha_beta(1.0, 1.0)
    terms = osf.terms_no_fusion(t_f, t_b, m, cost)
    # tau(3) = 0; tau(2) = max(0 + 6, 3) = 6; tau(1) = max(6 + 3, 3 + 2) = 9
    np.testing.assert_allclose(terms.tau, [9, 6, 0])
    assert terms.t_update == 11 and terms.t_overlap == 5 and terms.t_comp == 12
    assert osf.iteration_time_no_fusion(t_f, t_b, m, cost) == 18      # 3 + t_b(3) + 11
    assert osf.scaling_factor_no_fusion(t_f, t_b, m, cost) == pytest.approx(12 / 18)


def test_no_fusion_compute_bound_sums_from_j_equals_i():
    """Eq. 8 with the sum from j=i: layer i's gradient exists after its own backward.  The
    printed j=i+1 would give 10.5 s here, less than the 12 s of computation."""
    t_f, t_b, m = [1, 1, 1], [2, 3, 4], [1, 2, 5]
    cost = AllreduceCost.alpha_beta(0.5, 0.0)
    terms = osf.terms_no_fusion(t_f, t_b, m, cost)
    np.testing.assert_allclose(terms.tau, [5, 3, 0])          # = the backward ready times
    assert terms.iteration_time == pytest.approx(12.5)        # computation + last all-reduce
    assert osf.csf(t_f, t_b, m, cost) == pytest.approx(12 / 12.5)


def test_backward_times_default_to_twice_forward():
    cost = AllreduceCost.alpha_beta(1e-4, 1e-9)
    t_f, m = [1e-3, 2e-3, 5e-4], [1e6, 2e5, 3e6]
    assert osf.iteration_time_no_fusion(t_f, None, m, cost) == \
        osf.iteration_time_no_fusion(t_f, [2e-3, 4e-3, 1e-3], m, cost)


def test_layers_are_in_forward_order():
    """The last forward layer's gradient is all-reduced first, under the other backward passes;
    the first layer's is all-reduced after all computation."""
    cost = AllreduceCost.alpha_beta(0.0, 1.0)
    t_f, t_b = [0, 0, 0], [1, 1, 1]
    last = osf.iteration_time_no_fusion(t_f, t_b, [0, 0, 2], cost)
    first = osf.iteration_time_no_fusion(t_f, t_b, [2, 0, 0], cost)
    assert last == 3 and first == 5


# ------------------------------------------------------------------- fusion, eqs. 11-16 by hand
# forward layers 1..4; backward order: layer 4 (k=0), 3, 2, 1.  t_update(m) = 1 + m / 10
FT_F, FT_B, FT_M = [0, 0, 0, 0], [1, 5, 1, 1], [10, 10, 10, 10]
FT_COST = AllreduceCost.alpha_beta(1.0, 0.1)


def test_fusion_timeout_by_hand():
    # Q = 25, timeout 3: layers 4+3 fuse; layer 2's 5 s backward trips the timeout (wait 3);
    # layers 2+1 fuse and go after layer 1.  tau(3) = 1, tau(2) = max(1 + 3 + 3, 6) = 7,
    # tau(1) = 7, T_update = 7 + 3 = 10, iteration = t_b(4) + 10 = 11
    t = osf.terms_fusion(FT_F, FT_B, FT_M, FT_COST, 25, 3)
    np.testing.assert_allclose(t.sent, [20, 0, 20, 0])
    np.testing.assert_allclose(t.wait, [0, 0, 3, 0])
    np.testing.assert_allclose(t.tau, [7, 7, 1, 0])
    assert t.t_update == pytest.approx(10) and t.iteration_time == pytest.approx(11)
    assert osf.buffer_groups(FT_B, FT_M, 25, 3) == ([(0, 1), (2, 3)], [3.0, 0.0])


def test_fusion_small_buffer_by_hand():
    """Q below every gradient: each one goes alone, but eq. 14 still waits for the next
    backward to learn that it does not fit (the paper's model; WFBP here takes 11 s)."""
    t = osf.terms_fusion(FT_F, FT_B, FT_M, FT_COST, 15, 3)
    np.testing.assert_allclose(t.sent, FT_M)
    np.testing.assert_allclose(t.wait, [0, 1, 3, 1])           # forward order
    assert t.iteration_time == pytest.approx(14)
    assert osf.iteration_time_no_fusion(FT_F, FT_B, FT_M, FT_COST) == pytest.approx(11)
    groups, waits = osf.buffer_groups(FT_B, FT_M, 15, 3)
    assert groups == per_layer(4) and waits == [1.0, 3.0, 1.0, 0.0]
    # the same groups timed from the ready times (wait from readiness, not from tau)
    assert osf.predict_iteration(FT_F, FT_B, FT_M, FT_COST, groups, waits) == pytest.approx(12)


def test_fusion_bad_parameters():
    with pytest.raises(ValueError, match="non-negative"):
        osf.iteration_time_fusion(FT_F, FT_B, FT_M, FT_COST, -1, 1)
    with pytest.raises(ValueError, match="non-negative"):
        osf.iteration_time_fusion(FT_F, FT_B, FT_M, FT_COST, 1, float("nan"))


# ------------------------------------------------------------------------------ properties
@settings(max_examples=200, deadline=None)
@given(layers(), alphas, betas)
def test_fusion_with_infinite_buffer_and_timeout_is_csf(lay, alpha, beta):
    cost = AllreduceCost.alpha_beta(alpha, beta)
    t_f, t_b, m = lay
    assume(sum(t_f) + sum(t_b) > 0)
    assert osf.scaling_factor_fusion(*lay, cost, INF, INF) == pytest.approx(
        osf.csf(*lay, cost), rel=1e-9)
    # the single all-reduce after all computation
    assert osf.iteration_time_fusion(*lay, cost, INF, INF) == pytest.approx(
        sum(t_f) + sum(t_b) + cost(sum(m)), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(layers(), st.one_of(st.builds(AllreduceCost.alpha_beta, alphas, betas),
                           piecewise_costs()), buffers, timeouts)
def test_scaling_factors_at_most_one(lay, cost, q, to):
    n = len(lay[0])
    for sf in (osf.scaling_factor_no_fusion(*lay, cost),
               osf.scaling_factor_fusion(*lay, cost, q, to),
               osf.csf(*lay, cost),
               osf.scaling_factor_groups(*lay, cost, osf.adaptive_fusion(*lay, cost)),
               osf.scaling_factor_groups(*lay, cost, per_layer(n))):
        assert 0.0 <= sf <= 1.0 + 1e-12
    t = osf.terms_fusion(*lay, cost, q, to)
    assert t.t_update >= t.t_overlap - 1e-12       # communication ends after the backward


@settings(max_examples=200, deadline=None)
@given(layers(), alphas, betas, st.floats(0.0, 1.0), buffers, timeouts)
def test_scaling_factor_monotone_in_bandwidth(lay, alpha, beta, shrink, q, to):
    """More bandwidth (smaller beta) never lowers a scaling factor."""
    slow = AllreduceCost.alpha_beta(alpha, beta)
    fast = AllreduceCost.alpha_beta(alpha, beta * shrink)
    tol = 1e-12
    assert osf.scaling_factor_no_fusion(*lay, fast) >= \
        osf.scaling_factor_no_fusion(*lay, slow) - tol
    assert osf.scaling_factor_fusion(*lay, fast, q, to) >= \
        osf.scaling_factor_fusion(*lay, slow, q, to) - tol
    assert osf.csf(*lay, fast) >= osf.csf(*lay, slow) - tol


@settings(max_examples=100, deadline=None)
@given(layers(), piecewise_costs(), st.floats(0.0, 1.0), buffers, timeouts)
def test_scaling_factor_monotone_in_bandwidth_piecewise(lay, pw, shrink, q, to):
    """Eq. 18 with a smaller slope a2 (more bandwidth for large messages)."""
    fast = AllreduceCost.piecewise(pw.a1, pw.b1, pw.a2 * shrink, pw.b2, pw.threshold)
    tol = 1e-12
    assert osf.scaling_factor_no_fusion(*lay, fast) >= osf.scaling_factor_no_fusion(*lay, pw) - tol
    assert osf.scaling_factor_fusion(*lay, fast, q, to) >= \
        osf.scaling_factor_fusion(*lay, pw, q, to) - tol


@settings(max_examples=200, deadline=None)
@given(layers(positive_bytes=True), st.floats(1e-7, 1e-3), betas, st.floats(0.0, 1.0))
def test_adaptive_fusion_monotone_in_bandwidth_for_alpha_beta(lay, alpha, beta, shrink):
    """Eq. 17 with alpha-beta costs is ``t_b(i) < alpha``: beta does not change the groups, so
    adaFusion's scaling factor is monotone in bandwidth too (away from rounding ties)."""
    assume(all(abs(tb - alpha) > 1e-12 for tb in lay[1]))
    slow = AllreduceCost.alpha_beta(alpha, beta)
    fast = AllreduceCost.alpha_beta(alpha, beta * shrink)
    g = osf.adaptive_fusion(*lay, slow)
    assert osf.adaptive_fusion(*lay, fast) == g
    starts = [a for a, _ in g[1:]]
    tb_bw = lay[1][::-1]
    assert all(tb_bw[k] >= alpha for k in starts)
    assert all(tb_bw[k] < alpha for k in range(1, len(tb_bw)) if k not in starts)
    assert osf.scaling_factor_groups(*lay, fast, g) >= \
        osf.scaling_factor_groups(*lay, slow, g) - 1e-12


@settings(max_examples=200, deadline=None)
@given(layers(), st.one_of(st.builds(AllreduceCost.alpha_beta, alphas, betas),
                           piecewise_costs(), any_costs()))
def test_one_group_per_layer_is_no_fusion(lay, cost):
    n = len(lay[0])
    assert osf.predict_iteration(*lay, cost, per_layer(n)) == pytest.approx(
        osf.iteration_time_no_fusion(*lay, cost), rel=1e-9, abs=1e-15)
    assert osf.predict_iteration(*lay, cost, [(0, n - 1)]) == pytest.approx(
        osf.iteration_time_fusion(*lay, cost, INF, INF), rel=1e-9, abs=1e-15)


@settings(max_examples=200, deadline=None)
@given(layers(), st.builds(AllreduceCost.alpha_beta, alphas, betas), buffers, timeouts)
def test_fusion_sends_every_byte_once(lay, cost, q, to):
    t = osf.terms_fusion(*lay, cost, q, to)
    assert t.sent.sum() == pytest.approx(sum(lay[2]))
    groups, waits = osf.buffer_groups(lay[1], lay[2], q, to)
    n = len(lay[0])
    assert groups[0][0] == 0 and groups[-1][1] == n - 1
    assert all(a == z + 1 for (_, z), (a, _) in zip(groups, groups[1:]))
    # F (forward order) sits on each group's last layer in backward order
    m_bw = np.asarray(lay[2], dtype=float)[::-1]
    np.testing.assert_allclose([m_bw[a:z + 1].sum() for a, z in groups],
                               [t.sent[::-1][z] for _, z in groups])


@settings(max_examples=200, deadline=None)
@given(layers(), st.one_of(st.builds(AllreduceCost.alpha_beta, alphas, betas),
                           piecewise_costs()), buffers, timeouts)
def test_waiting_from_readiness_is_never_later_than_eq15(lay, cost, q, to):
    groups, waits = osf.buffer_groups(lay[1], lay[2], q, to)
    ready_based = osf.predict_iteration(*lay, cost, groups, waits)
    assert ready_based <= osf.iteration_time_fusion(*lay, cost, q, to) * (1 + 1e-12) + 1e-15
    if not any(waits):
        assert ready_based == pytest.approx(osf.iteration_time_fusion(*lay, cost, q, to),
                                            rel=1e-9, abs=1e-15)


@settings(max_examples=100, deadline=None)
@given(layers(positive_tb=True), st.builds(AllreduceCost.alpha_beta, alphas, betas), buffers)
def test_zero_timeout_is_no_fusion(lay, cost, q):
    assert osf.iteration_time_fusion(*lay, cost, q, 0.0) == pytest.approx(
        osf.iteration_time_no_fusion(*lay, cost), rel=1e-9, abs=1e-15)


# ------------------------------------------------------------------- adaptive fusion, eq. 17
def test_adaptive_fusion_alpha_beta_rule_is_tb_below_alpha():
    # forward t_b: layer 1 .. 4; backward order is layer 4, 3, 2, 1
    t_b, m = [5e-6, 1e-3, 2e-6, 7e-6], [1e6, 1e6, 1e6, 1e6]
    cost = AllreduceCost.alpha_beta(1e-5, 1e-9)
    # layer 3 (2 us) fuses into layer 4; layer 2 (1 ms) starts a group; layer 1 (5 us) joins it
    assert osf.adaptive_fusion(None, t_b, m, cost) == [(0, 1), (2, 3)]
    assert osf.adaptive_fusion(None, t_b, m, AllreduceCost.alpha_beta(0, 1e-9)) == per_layer(4)
    assert osf.adaptive_fusion(None, t_b, m, AllreduceCost.alpha_beta(1, 1e-9)) == [(0, 3)]
    with pytest.raises(ValueError, match="t_b"):
        osf.adaptive_fusion(None, None, m, cost)


@settings(max_examples=300, deadline=None)
@given(layers(), st.one_of(st.builds(AllreduceCost.alpha_beta, alphas, betas),
                           piecewise_costs(), any_costs()), st.booleans())
def test_adaptive_fusion_never_slower_than_wfbp(lay, cost, channel_aware):
    """What holds for any cost (even non-monotone): adaFusion's grouping is never predicted
    slower than WFBP, hence never slower than both WFBP and one fused group."""
    n = len(lay[0])
    g = osf.adaptive_fusion(*lay, cost, channel_aware=channel_aware)
    assert g[0][0] == 0 and g[-1][1] == n - 1
    t_ada = osf.predict_iteration(*lay, cost, g)
    t_wfbp = osf.iteration_time_no_fusion(*lay, cost)
    t_one = osf.predict_iteration(*lay, cost, [(0, n - 1)])
    assert t_ada <= t_wfbp * (1 + 1e-9) + 1e-15
    assert t_ada <= max(t_wfbp, t_one) * (1 + 1e-9) + 1e-15


@settings(max_examples=300, deadline=None)
@given(layers(positive_bytes=True), alphas, betas)
def test_adaptive_fusion_alpha_beta_never_slower_than_one_group(lay, alpha, beta):
    """With alpha-beta costs (positive sizes), eq. 17 also beats one fused group: every group
    after the first starts at a layer whose backward takes at least alpha."""
    cost = AllreduceCost.alpha_beta(alpha, beta)
    n = len(lay[0])
    t_ada = osf.predict_iteration(*lay, cost, osf.adaptive_fusion(*lay, cost))
    assert t_ada <= osf.predict_iteration(*lay, cost, [(0, n - 1)]) * (1 + 1e-9) + 1e-15


def test_adaptive_fusion_can_lose_to_one_group():
    """Not true in general: eq. 17 is greedy.  With t(x) = sqrt(x) s, layer 2 (1 s backward) is
    not fused into layer 3's 25 bytes; layer 1 then fuses into layer 2, and the chain of two
    all-reduces ends after one all-reduce of all 51 bytes would have."""
    cost = math.sqrt
    t_f, t_b, m = [0, 0, 0], [0, 1, 0], [25, 1, 25]
    g = osf.adaptive_fusion(t_f, t_b, m, cost)
    assert g == [(0, 0), (1, 2)]
    t_ada = osf.predict_iteration(t_f, t_b, m, cost, g)
    assert t_ada == pytest.approx(5 + math.sqrt(26))
    assert osf.predict_iteration(t_f, t_b, m, cost, [(0, 2)]) == pytest.approx(1 + math.sqrt(51))
    assert t_ada > 1 + math.sqrt(51)
    assert t_ada < osf.iteration_time_no_fusion(t_f, t_b, m, cost)


def test_adaptive_fusion_can_lose_to_a_fixed_threshold():
    """Eq. 17 charges the wait t_b(i) even while the channel is busy with a large all-reduce;
    then waiting costs nothing and a fixed 100 KB buffer that fuses the small gradients queued
    behind it wins.  The channel-aware variant sees it."""
    cost = AllreduceCost.alpha_beta(1e-4, 1e-9)
    # forward order; backward: a 3.8 MB gradient, then three small ones 0.2-1.6 ms apart
    t_b = [1.59e-3, 1.78e-4, 8.34e-4, 1.87e-4]
    m = [178, 62189, 108, 3791261]
    t_f = [0.0] * 4
    ada = osf.adaptive_fusion(t_f, t_b, m, cost)
    assert ada == per_layer(4)                              # every t_b >= alpha: no fusion
    fixed, _ = osf.buffer_groups(t_b, m, 100e3)
    assert fixed == [(0, 0), (1, 3)]
    t_ada = osf.predict_iteration(t_f, t_b, m, cost, ada)
    t_fixed = osf.predict_iteration(t_f, t_b, m, cost, fixed)
    assert t_fixed < t_ada
    aware = osf.adaptive_fusion(t_f, t_b, m, cost, channel_aware=True)
    assert osf.predict_iteration(t_f, t_b, m, cost, aware) <= t_fixed


# --------------------------------------------------------------------- explicit groupings
def test_schedule_timeline():
    cost = AllreduceCost.alpha_beta(1.0, 1.0)
    s = osf.schedule([1, 1, 1], [2, 3, 4], [1, 2, 5], cost, [(0, 0), (1, 2)])
    # backward order: layer 3 ready at 3 + 4 = 7, layers 2 and 1 at 10 and 12
    np.testing.assert_allclose(s.nbytes, [5, 3])
    np.testing.assert_allclose(s.ready, [7, 12])
    np.testing.assert_allclose(s.start, [7, 13])
    np.testing.assert_allclose(s.end, [13, 17])
    assert s.iteration_time == 17 and s.scaling_factor == pytest.approx(12 / 17)
    delayed = osf.predict_iteration([1, 1, 1], [2, 3, 4], [1, 2, 5], cost, [(0, 0), (1, 2)],
                                    delays=[0, 5])
    assert delayed == 21


@pytest.mark.parametrize("groups", [[(0, 0), (2, 2)], [(0, 1)], [(1, 2)], [(0, 2), (3, 3)],
                                    [(0, 1), (1, 2)]])
def test_bad_groups_rejected(groups):
    with pytest.raises(ValueError, match="groups"):
        osf.predict_iteration([1, 1, 1], None, [1, 1, 1], FT_COST, groups)


def test_bad_layers_rejected():
    with pytest.raises(ValueError, match="same length"):
        osf.iteration_time_no_fusion([1, 2], [1], [1, 2], FT_COST)
    with pytest.raises(ValueError, match="not empty"):
        osf.csf([], [], [], FT_COST)
    with pytest.raises(ValueError, match="m must be"):
        osf.iteration_time_no_fusion([1], [1], [-1], FT_COST)
    with pytest.raises(ValueError, match="delays"):
        osf.predict_iteration([1], [1], [1], FT_COST, [(0, 0)], delays=[-1])
    with pytest.raises(ValueError, match="cost"):
        osf.iteration_time_no_fusion([1], [1], [1], lambda x: -1.0)


def _all_groupings(n):
    """Every split of 0..n-1 (backward order) into consecutive groups."""
    for mask in range(1 << (n - 1)):
        groups, start = [], 0
        for k in range(n - 1):
            if mask >> k & 1:
                groups.append((start, k))
                start = k + 1
        groups.append((start, n - 1))
        yield groups


@given(layers(max_n=7), any_costs())
@settings(max_examples=150, deadline=None)
def test_optimal_groups_is_the_exhaustive_optimum(lay, cost):
    best = min(osf.predict_iteration(*lay, cost, g) for g in _all_groupings(len(lay[2])))
    g = osf.optimal_groups(*lay, cost)
    assert osf.predict_iteration(*lay, cost, g) <= best * (1 + 1e-12) + 1e-15
    for other in (osf.adaptive_fusion(*lay, cost), osf.buffer_groups(lay[1], lay[2], 4e6)[0],
                  [(0, len(lay[2]) - 1)]):
        assert osf.predict_iteration(*lay, cost, g) <= \
            osf.predict_iteration(*lay, cost, other) * (1 + 1e-12) + 1e-15


def test_optimal_groups_by_hand():
    # alpha 1 ms: fusing everything costs one alpha; gradients 1 ms apart, 1 byte each
    cost = AllreduceCost.alpha_beta(1e-3, 0.0)
    assert osf.optimal_groups(None, [1e-3] * 4, [1] * 4, cost) == [(0, 3)]    # ties: fewest
    # alpha 2 ms, 1 us per 1000 B, ready at 1..4 ms: layer 0 alone (ends 3.001 ms, before the
    # rest is ready) then layers 1-3 end at 6.003 ms; one group 6.004, two pairs 6.004,
    # per layer 9.004
    cost = AllreduceCost.alpha_beta(2e-3, 1e-9)
    assert osf.optimal_groups(None, [1e-3] * 4, [1000] * 4, cost) == [(0, 0), (1, 3)]
    # free communication: per layer is as good as anything; ties give the fewest groups
    assert osf.optimal_groups(None, [1e-3] * 3, [0, 0, 0], cost) == [(0, 2)]
    with pytest.raises(ValueError):
        osf.optimal_groups(None, None, [1], cost)


def test_per_op_cost_and_its_calibration():
    base = AllreduceCost.alpha_beta(1e-5, 1e-9)
    c = base.plus(2e-5)
    assert c(0) == 0 and c(1000) == pytest.approx(1e-5 + 1e-6 + 2e-5)
    assert c(np.array([0.0, 1000.0])).tolist() == pytest.approx([0.0, 3.1e-5])
    assert c.as_dict()["per_op"] == 2e-5 and c.as_dict()["base"]["kind"] == "alpha_beta"
    with pytest.raises(ValueError):
        base.plus(-1.0)
    # communication-bound WFBP: 4 layers ready 1 us apart, each all-reduce 10 us + d
    t_f, t_b, m = [0.0] * 4, [1e-6] * 4, [1] * 4
    per_layer = [(k, k) for k in range(4)]
    true_d = 7e-6
    measured = osf.predict_iteration(t_f, t_b, m, base.plus(true_d), per_layer)
    d = osf.calibrate_per_op(t_f, t_b, m, base, per_layer, measured)
    assert d == pytest.approx(true_d, rel=1e-3)
    assert osf.calibrate_per_op(t_f, t_b, m, base, per_layer, 1e-9) == 0.0
