"""``algorithms.shm_preferred``: the rule "auto" uses for Allgatherv, Alltoall and Alltoallv
(its figures: bench/results/issue29_vcollectives_lead.txt)."""
import pytest

from aluminum_py.algorithms import SHM_MAX_BYTES, SHM_VCOLLECTIVES, shm_preferred


@pytest.mark.parametrize("coll", ["allgatherv", "alltoall"])
def test_shm_up_to_the_threshold(coll):
    limit = SHM_MAX_BYTES[coll]
    for size in (2, 3, 4, 64):
        assert shm_preferred(coll, 0, size) and shm_preferred(coll, limit, size)
        assert not shm_preferred(coll, limit + 1, size)
        assert not shm_preferred(coll, 16 << 20, size)
    assert shm_preferred(coll, 16 << 20, 1)         # one rank: a local copy


def test_alltoallv_never_by_size():
    """No rank knows an Alltoallv's whole count matrix: the choice may not depend on it (and shm
    lost at 256 KiB and above in most runs): "mpi" wherever there is more than one rank."""
    assert {shm_preferred("alltoallv", n, 4) for n in (0, 1, 1 << 20, 1 << 34)} == {False}
    assert shm_preferred("alltoallv", 1 << 20, 1)


def test_unknown_collective():
    assert SHM_VCOLLECTIVES == ("allgatherv", "alltoall", "alltoallv")
    with pytest.raises(ValueError, match="collective: expected one of"):
        shm_preferred("allreduce", 4, 2)
