"""``algorithms.shm_preferred``: the rule "auto" uses for Allgatherv, Alltoall and Alltoallv
(its figures: bench/results/issue29_vcollectives_lead.txt)."""
import pytest

from aluminum_py.algorithms import SHM_ALLTOALL_MAX_BYTES, SHM_VCOLLECTIVES, shm_preferred


def test_alltoall_up_to_the_threshold():
    for size in (2, 3, 4, 64):
        assert shm_preferred("alltoall", 0, size)
        assert shm_preferred("alltoall", SHM_ALLTOALL_MAX_BYTES, size)
        assert not shm_preferred("alltoall", SHM_ALLTOALL_MAX_BYTES + 1, size)
        assert not shm_preferred("alltoall", 16 << 20, size)
    assert shm_preferred("alltoall", 16 << 20, 1)         # one rank: a local copy


def test_v_collectives_never_by_size():
    """An erroneous v-collective (counts that differ between ranks) must not put ranks on
    different transports: Allgatherv always "shm" (its fingerprints catch the counts),
    Alltoallv always "mpi" where there is more than one rank."""
    sizes = (0, 1, 1 << 20, 16 << 20, 1 << 34)
    assert {shm_preferred("allgatherv", n, 4) for n in sizes} == {True}
    assert {shm_preferred("alltoallv", n, 4) for n in sizes} == {False}
    assert shm_preferred("alltoallv", 1 << 20, 1)


def test_unknown_collective():
    assert SHM_VCOLLECTIVES == ("allgatherv", "alltoall", "alltoallv")
    with pytest.raises(ValueError, match="collective: expected one of"):
        shm_preferred("allreduce", 4, 2)
