"""``algorithms.shm_preferred``: the rule "auto" uses for Allgatherv, Alltoall and Alltoallv
(its figures: bench/results/issue29_vcollectives_*.txt)."""
import pytest

from aluminum_py.algorithms import SHM_ALLTOALL_MAX_BYTES, SHM_VCOLLECTIVES, shm_preferred


def test_allgatherv_and_alltoallv_always_shm():
    for coll in ("allgatherv", "alltoallv"):
        for size in (1, 2, 3, 4, 64):
            for nbytes in (0, 4, 1 << 20, 16 << 20, 1 << 30):
                assert shm_preferred(coll, nbytes, size)


def test_alltoall_up_to_the_threshold():
    assert shm_preferred("alltoall", SHM_ALLTOALL_MAX_BYTES, 4)
    assert not shm_preferred("alltoall", SHM_ALLTOALL_MAX_BYTES + 1, 4)
    assert shm_preferred("alltoall", 0, 2) and not shm_preferred("alltoall", 16 << 20, 2)
    assert shm_preferred("alltoall", 16 << 20, 1)         # one rank: a local copy


def test_alltoallv_ignores_the_size():
    """No rank knows an Alltoallv's whole count matrix: the choice may not depend on it."""
    assert {shm_preferred("alltoallv", n, 4) for n in (0, 1, 1 << 20, 1 << 34)} == {True}


def test_unknown_collective():
    assert SHM_VCOLLECTIVES == ("allgatherv", "alltoall", "alltoallv")
    with pytest.raises(ValueError, match="collective: expected one of"):
        shm_preferred("allreduce", 4, 2)
