"""LIBRA: contention model, backward-time recursion, DP planner vs exhaustive search."""
import math

import numpy as np
import pytest

from aluminum_py.planning import libra
from aluminum_py.planning.contention import ContentionModel, Rate

M = ContentionModel.example(8)


def test_example_matches_the_paper_setting():
    assert M.g(25.7e-3, 2048) == pytest.approx(1.38 * 25.7e-3)      # +38% at 2048 threads
    assert M.g(1.0, 0) == pytest.approx(1.0)
    link = 50e9 / 8
    assert M.overlapped(512) == pytest.approx(0.9 * link)
    assert M.non_overlapped(128) == pytest.approx(0.9 * link)
    assert M.overlapped(4096) < link


@pytest.mark.parametrize("alg,n,steps,volume", [("ring", 8, 14, 2 * 7 / 8), ("ring", 2, 2, 1.0),
                                                ("recursive_doubling", 8, 3, 3.0),
                                                ("rabenseifner", 16, 8, 2 * 15 / 16)])
def test_allreduce_startup_and_volume(alg, n, steps, volume):
    m = ContentionModel.example(8, alg).with_nranks(n)
    assert m.startup == pytest.approx(steps * m.alpha)
    assert float(m.c_hat(1000.0)) == pytest.approx(volume * 1000.0)
    one = m.with_nranks(1)
    assert one.startup == 0 and float(one.c_hat(1e6)) == 0


def test_single_group_is_compute_then_communicate():
    c, b = [10e6, 20e6], [2e-3, 3e-3]
    t = libra.backward_time(c, b, M, [(0, 1)], [1024])
    assert t == pytest.approx(5e-3 + float(M.q(30e6, 1024)) + M.startup)


def test_two_groups_follow_the_recursion():
    c, b = [10e6, 20e6], [2e-3, 3e-3]
    r1, r2 = 512, 2048
    total, stages = libra.backward_time(c, b, M, [(0, 0), (1, 1)], [r1, r2], breakdown=True)
    comm = float(M.p(10e6, r1)) + M.startup
    comp = float(M.g(3e-3, r1))
    fo = min(comm, comp)
    fb = 3e-3 * (1 - fo / comp)
    fc = (float(M.q(10e6, r1)) + M.startup) * (1 - fo / comm)
    s2 = fb - max(0.0, fb - 0.0)          # nothing after group 2: t_b = fb, s_b^2 = 0
    last = float(M.q(20e6, r2)) + M.startup
    assert stages[1] == pytest.approx((fo, fb, fc))
    assert total == pytest.approx(2e-3 + fo + fb + fc + last)
    assert s2 == 0


def test_bad_plans_are_rejected():
    with pytest.raises(ValueError, match="groups"):
        libra.backward_time([1, 2, 3], [1, 1, 1], M, [(0, 0), (2, 2)], [128, 128])
    with pytest.raises(ValueError, match="threads"):
        libra.backward_time([1, 2], [1, 1], M, [(0, 1)], [128, 256])
    with pytest.raises(ValueError, match="comm_bytes"):
        libra.backward_time([1, 2], [1], M, [(0, 1)], [128])


def random_instance(rng, L):
    return rng.uniform(0.5e6, 40e6, L), rng.uniform(0.2e-3, 6e-3, L)


@pytest.mark.parametrize("seed", range(25))
def test_optimize_within_the_theorem_bound_of_exhaustive(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(2, 7))
    K = int(rng.integers(1, L + 1))
    Z = int(rng.integers(10, 60))
    threads = (128, 512, 2048)
    c, b = random_instance(rng, L)
    plan = libra.optimize(c, b, M, threads, max_groups=K, chunks=Z)
    best = libra.exhaustive(c, b, M, threads, max_groups=K)
    assert len(plan.groups) <= K and all(t in threads for t in plan.threads)
    assert plan.predicted_time == pytest.approx(libra.backward_time(c, b, M, plan.groups, plan.threads))
    assert plan.predicted_time <= best.predicted_time * (1 + (L - 1) / Z) + 1e-15
    assert plan.predicted_time >= best.predicted_time - 1e-15


@pytest.mark.parametrize("seed", range(10))
def test_allocate_threads_for_a_fixed_plan(seed):
    rng = np.random.default_rng(100 + seed)
    L = int(rng.integers(2, 7))
    c, b = random_instance(rng, L)
    cut = int(rng.integers(1, L))
    groups = [(0, cut - 1), (cut, L - 1)]
    threads = (128, 1024, 4096)
    plan = libra.allocate_threads(c, b, M, groups, threads, chunks=40)
    best = min(libra.backward_time(c, b, M, groups, [r1, r2]) for r1 in threads for r2 in threads)
    assert plan.groups == groups
    assert best - 1e-15 <= plan.predicted_time <= best * (1 + 1 / 40) + 1e-15


def test_baselines_ordering_on_a_model_sized_instance():
    rng = np.random.default_rng(7)
    c, b = random_instance(rng, 40)
    res = libra.baselines(c, b, M, max_groups=10, chunks=150)
    libra_t = res["libra"].predicted_time
    k = len(res["mgwfbp"].groups)
    assert res["libra-m"].predicted_time <= res["mgwfbp"].predicted_time * (1 + (k - 1) / 150)
    assert libra_t < res["se"].predicted_time
    assert libra_t <= res["horovod"].predicted_time * (1 + 39 / 150)
    assert res["se"].groups == [(0, 39)]


def test_plan_max_ctas():
    plan = libra.Plan([(0, 1), (2, 3)], [128, 2048], 1.0)
    assert plan.max_ctas(512) == [1, 4]
    assert plan.max_ctas(256) == [1, 8]
    assert plan.as_dict()["threads"] == [128, 2048]


def test_fit_recovers_a_known_model():
    truth = ContentionModel(1.0, 1.2e-4, Rate(6e9, 5.5e9, 0.05), Rate(6e9, 5.0e9, 0.12), 8e-6, 8)
    rs = [128, 256, 512, 1024, 2048, 4096]
    comp = [(b, r, float(truth.g(b, r))) for b in (1e-3, 5e-3) for r in rs]
    over = [(c, r, float(truth.p(c, r)) + truth.startup) for c in (1e6, 3e7) for r in rs]
    non = [(c, r, float(truth.q(c, r)) + truth.startup) for c in (1e5, 1e6, 3e7) for r in rs]
    fit = ContentionModel.fit({"computation": comp, "overlapped": over, "non_overlapped": non}, 8)
    assert all(e < 1e-3 for e in fit.fit_error.values()), fit.fit_error
    assert fit.a2 == pytest.approx(truth.a2, rel=1e-3)
    assert fit.alpha == pytest.approx(truth.alpha, rel=1e-2)
    for r in rs:
        assert float(fit.p(1e7, r)) == pytest.approx(float(truth.p(1e7, r)), rel=1e-3)
