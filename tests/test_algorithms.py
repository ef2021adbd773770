"""Algorithm names and the alpha-beta-gamma selection model."""
import pytest

import aluminum_py as al
from aluminum_py.algorithms import MODELLED, model_choice, model_time

import cost_reference


def test_names():
    host = al.algorithms("allreduce", "host")
    assert host == ("auto", "mpi", "recursive_doubling", "rabenseifner", "ring", "hierarchical", "shm",
                    "hierarchical_p2p")
    assert "nccl" in al.algorithms("allreduce", "cuda")
    assert set(host) <= set(al.algorithms("allreduce"))
    with pytest.raises(ValueError, match="op"):
        al.algorithms("recv")
    for op in ("allgather", "bcast", "reduce_scatter", "barrier"):
        assert al.algorithms(op, "host") == al.algorithms(op) == ("mpi", "shm")
        assert al.algorithms(op, "cuda") == ("mpi",)
    assert al.algorithms("alltoall", "host") == ("auto", "mpi", "shm")
    for op in ("allgatherv", "alltoallv"):
        assert al.algorithms(op, "host") == ("auto", "mpi", "shm")
        assert al.algorithms(op, "cuda") == ("auto", "nccl", "mpi")
    for op in ("gatherv", "scatterv", "reduce_scatterv", "scan", "exscan"):
        assert al.algorithms(op, "host") == ("auto", "mpi")
    assert al.algorithms("scan", "cuda") == ()
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


PARAMS = [(2e-6, 1.6e-10, 1e-10), (5e-5, 1e-11, 1e-12), (1e-7, 1e-9, 1e-9), (3e-6, 2e-10, 0.0)]
SIZES = [1, 4, 100, 1 << 10, 12345, 1 << 16, 1 << 20, 3 << 20, 1 << 26, 1 << 30]


def test_known_winners():
    """Cases worked out by hand from the formulas (docs/algorithms.md)."""
    params = (2e-6, 1.6e-10, 1e-10)
    assert model_choice(4, 8, params) == "recursive_doubling"       # log2(p) alphas, tiny n
    # p = 4: Rabenseifner moves what ring moves with 4 alphas instead of 6: strictly cheaper
    assert model_choice(4, 64 << 20, params) == "rabenseifner"
    # p = 2: Rabenseifner and ring cost the same; the tie goes to Rabenseifner
    assert model_choice(2, 64 << 20, params) == "rabenseifner"
    # p = 3: the fold costs Rabenseifner a full extra exchange; ring has none
    assert model_choice(3, 64 << 20, params) == "ring"
    assert model_choice(3, 8, params) == "recursive_doubling"
    assert model_choice(1, 1 << 20, params) == "recursive_doubling"  # all cost 0: the tie rule


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 64])
def test_model_choice_is_the_argmin_of_the_formulas(p, params):
    for n in SIZES:
        for alg in MODELLED:
            assert model_time(alg, p, n, params) == pytest.approx(cost_reference.cost(alg, p, n, params),
                                                                  rel=1e-12, abs=0.0), (alg, n)
        assert model_choice(p, n, params) == cost_reference.cheapest(p, n, params), n


def test_the_winner_changes_with_size_and_rank_count():
    """The grid above is not trivial: every modelled algorithm wins somewhere in it."""
    winners = {cost_reference.cheapest(p, n, prm) for p in (2, 3, 4, 8) for n in SIZES for prm in PARAMS}
    assert winners == set(MODELLED)


@pytest.mark.parametrize("params", PARAMS)
def test_selector_without_table_uses_the_model(params):
    from aluminum_py.tuning import Chooser, Model
    usable = ("mpi",) + MODELLED
    for p in (2, 3, 4, 6):
        s = Chooser(Model(p, p, usable, params, None), {}, usable)
        for n in SIZES:
            assert s.choose(n, 4) == cost_reference.cheapest(p, n, params), (p, n)
            assert s.explain(n, 4).source == "model"


# -- "shm": its own formula (synchronisations and memory traffic of ext/al_shm.h's protocols)

SMALL, SLOT = 64 << 10, 1 << 20


def test_shm_formula():
    from aluminum_py.algorithms import ShmCost, shm_terms, shm_time
    s, m = 3e-7, 2e-11
    shm = ShmCost(s, m, SMALL, SLOT)
    # symmetric: one synchronisation; copy in (n read, n written), reduce p slots (p n, n)
    assert shm_terms(4, 1000, SMALL, SLOT) == (1.0, 7 * 1000)
    assert shm_time(4, SMALL, shm) == pytest.approx(s + 7 * SMALL * m)
    # split, just above the limit: one round of two synchronisations, (5 - 2/p) n of traffic
    assert shm_terms(4, SMALL + 4, SMALL, SLOT) == (2.0, 4.5 * (SMALL + 4))
    # rounds of a slot: 64 MiB in 64 rounds, one byte more in 65
    assert shm_terms(2, 64 << 20, SMALL, SLOT) == (128.0, 4.0 * (64 << 20))
    assert shm_terms(2, (64 << 20) + 4, SMALL, SLOT)[0] == 130.0
    assert shm_time(2, 64 << 20, shm) == pytest.approx(128 * s + 4 * (64 << 20) * m)
    # rounds of `chunk` bytes under chunk_upto (al_shm_chunk), of a slot from there
    assert shm_terms(2, 4 << 20, SMALL, SLOT, 128 << 10, 8 << 20) == (64.0, 4.0 * (4 << 20))
    assert shm_terms(2, 8 << 20, SMALL, SLOT, 128 << 10, 8 << 20)[0] == 16.0
    assert shm_terms(2, 4 << 20, SMALL, SLOT, SLOT, 8 << 20)[0] == 8.0
    chunked = ShmCost(s, m, SMALL, SLOT, 128 << 10, 8 << 20)
    assert shm_time(2, 1 << 20, chunked) == pytest.approx(16 * s + 4 * (1 << 20) * m)
    # nothing to exchange
    assert shm_terms(1, 1 << 20, SMALL, SLOT) == (0.0, 0.0)
    assert shm_terms(4, 0, SMALL, SLOT) == (0.0, 0.0)


def test_model_choice_with_shm():
    """shm is a candidate of the model only when given (a communicator with a segment), and
    wins or loses by its predicted time against the alpha-beta-gamma algorithms."""
    from aluminum_py.algorithms import ShmCost, model_times, shm_time
    params = (2e-6, 1.6e-10, 1e-10)
    fast = ShmCost(2e-7, 2.7e-11, SMALL, SLOT)           # the defaults (config.py)
    slow = ShmCost(5e-5, 1e-9, SMALL, SLOT)              # slower than every other one
    for p in (2, 3, 4, 8):
        for n in SIZES:
            assert model_choice(p, n, params) != "shm"
            times = model_times(p, n, params, fast)
            assert times["shm"] == shm_time(p, n, fast)
            assert model_choice(p, n, params, fast) == min(times, key=times.get)
            assert model_choice(p, n, params, slow) == cost_reference.cheapest(p, n, params)
    assert {model_choice(2, n, params, fast) for n in SIZES} == {"shm"}
    # where the formulas cross: 1 KiB (symmetric) with a large synchronisation latency
    late = ShmCost(3e-6, 2.7e-11, SMALL, SLOT)
    assert model_choice(2, 1024, params, late) == "recursive_doubling"
    assert model_choice(2, 1 << 20, params, late) == "shm"
    # p = 1: everything costs 0, the tie goes to recursive doubling (shm comes last)
    assert model_choice(1, 1 << 20, params, fast) == "recursive_doubling"
