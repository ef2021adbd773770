"""Algorithm names and the alpha-beta-gamma selection model."""
import pytest

import aluminum_py as al
from aluminum_py.algorithms import MODELLED, Selector, model_choice, model_time


def test_names():
    host = al.algorithms("allreduce", "host")
    assert host == ("auto", "mpi", "recursive_doubling", "rabenseifner", "ring")
    assert "nccl" in al.algorithms("allreduce", "cuda")
    assert set(host) <= set(al.algorithms("allreduce"))
    with pytest.raises(ValueError, match="op"):
        al.algorithms("bcast")
    with pytest.raises(ValueError, match="device"):
        al.algorithms("allreduce", "tpu")


def test_model_formulas():
    a, b, g = 1e-6, 1e-9, 5e-10
    n = 1 << 20
    assert model_time("ring", 4, n, (a, b, g)) == pytest.approx(6 * a + 1.5 * n * b + 0.75 * n * g)
    assert model_time("recursive_doubling", 4, n, (a, b, g)) == pytest.approx(2 * (a + n * b + n * g))
    assert model_time("rabenseifner", 4, n, (a, b, g)) == pytest.approx(4 * a + 1.5 * n * b + 0.75 * n * g)
    # p = 3 folds to 2: one extra exchange in and one out
    fold = 2 * (a + n * b) + n * g
    assert model_time("recursive_doubling", 3, n, (a, b, g)) == pytest.approx(a + n * b + n * g + fold)
    assert model_time("ring", 1, n, (a, b, g)) == 0.0


def test_model_choice_small_and_large():
    params = (2e-6, 1.6e-10, 1e-10)
    assert model_choice(4, 8, params) == "recursive_doubling"
    assert model_choice(4, 64 << 20, params) in ("rabenseifner", "ring")
    assert model_choice(2, 64 << 20, params) in ("rabenseifner", "ring")


def test_selector_without_table_uses_the_model():
    from aluminum_py.tuning import Decider
    params = (2e-6, 1.6e-10, 1e-10)
    s1 = Selector(4, Decider(4, {}, {}, params, ("mpi",) + MODELLED))
    s2 = Selector(4, Decider(4, {}, {}, params, ("mpi",) + MODELLED))
    sizes = [4, 1 << 10, 1 << 16, 1 << 20, 1 << 26]
    assert [s1.choose(n, 4) for n in sizes] == [model_choice(4, n, params) for n in sizes]
    assert [s1.choose(n, 4) for n in sizes] == [s2.choose(n, 4) for n in sizes]
    assert s1.explain(4, 4).source == "model"
