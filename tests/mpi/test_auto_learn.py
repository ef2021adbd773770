"""auto's learning in use (AL_AUTO_LEARN, aluminum_py.learning) at every rank count: every call
of the schedule gives numpy's result whichever contender runs it, blocking and nonblocking; every
rank runs the same contender at every call and commits to the same choice; once committed, the
launcher's cache answers; AL_AUTO_LEARN=0 leaves the table's choice alone."""
import numpy as np
import pytest

import aluminum_py as al
from conftest import WORLD, all_ranks_ok, gather_all

pytestmark = pytest.mark.mpi


@pytest.fixture
def no_table(tmp_path_factory, monkeypatch):
    path = WORLD.bcast(str(tmp_path_factory.mktemp("none") / "missing.json"), root=0)
    monkeypatch.setenv("AL_TUNING_FILE", path)
    monkeypatch.delenv("AL_AUTO_LEARN", raising=False)


def inputs(nbytes, rank, dtype=np.float32):
    return (np.arange(nbytes // np.dtype(dtype).itemsize) % 97 + rank).astype(dtype)


@pytest.mark.parametrize("nbytes", [4, 4096, 96 << 10, 3 << 20])
def test_every_call_of_the_schedule_is_right_and_the_ranks_agree(no_table, nbytes):
    c = al.Communicator()
    x = inputs(nbytes, c.rank)
    want = gather_all(x).sum(axis=0)
    ran, problems = [], []
    # at most 3 contenders x (4 x AL_AUTO_LEARN + 1) rounds x RUN calls (4x as many rounds up
    # to 64 KiB; elsewhere the schedule may double twice: learning.MORE_ROUNDS)
    for i in range(200):
        y = np.empty_like(x)
        if i % 4 == 3:                      # nonblocking calls take part in the schedule too
            req = c.Iallreduce(x, y)
            req.Wait(timeout=60)
            ran.append(req.algorithm)
        else:
            c.Allreduce(x, y)
            ran.append(None)
        if not np.array_equal(y, want):
            problems.append(f"call {i}: wrong result")
    learned = c.learned()
    everyone = WORLD.allgather((ran, [(r["bytes"], r["choice"]) for r in learned]))
    assert all(e == everyone[0] for e in everyone), "the ranks differ"
    assert all_ranks_ok(not problems), problems
    if c.size > 1:
        (r,) = learned
        assert r["bytes"] >= nbytes and r["choice"] in r["medians"]
        assert sum(r["samples"].values()) > 0
        ex = c.explain(nbytes)
        assert ex.algorithm == r["choice"] and ex.source == "learned"
        # committed: nonblocking calls run the choice, and the launcher caches it
        req = c.Iallreduce(x, np.empty_like(x))
        req.Wait(timeout=60)
        assert req.algorithm == r["choice"]
        assert c._host.launcher.choose(nbytes, 4) == r["choice"]
    else:
        assert learned == []
    c.Free()


def test_learning_tries_more_than_one_contender(no_table):
    """During the schedule the contenders really run (Iallreduce reports which)."""
    c = al.Communicator()
    if c.size == 1:
        pytest.skip("one rank: nothing to learn")
    x = inputs(1 << 20, c.rank)
    algs = set()
    for _ in range(12):
        req = c.Iallreduce(x, np.empty_like(x))
        req.Wait(timeout=60)
        algs.add(req.algorithm)
    assert len(algs) >= 2, algs
    c.Free()


def test_size_classes_learn_apart_and_dtypes_too(no_table):
    c = al.Communicator()
    if c.size == 1:
        pytest.skip("one rank: nothing to learn")
    for dtype, n in ((np.float32, 1000), (np.float32, 1 << 16), (np.float64, 1000)):
        x = inputs(n, c.rank, dtype)
        want = gather_all(x).sum(axis=0)
        for _ in range(200):                # 4 x 5 + 1 rounds of 3 x RUN at most (the classes
            #                                     up to 64 KiB, and the schedule of 256 KiB
            #                                     doubled twice: learning.MORE_ROUNDS)
            y = np.empty_like(x)
            c.Allreduce(x, y)
            assert np.array_equal(y, want)
    classes = [(r["bytes"], r["itemsize"]) for r in c.learned()]
    assert classes == sorted([(1024, 4), (1 << 16, 4), (1024, 8)])
    c.Free()


def test_off(no_table, monkeypatch):
    monkeypatch.setenv("AL_AUTO_LEARN", "0")
    c = al.Communicator()
    x = inputs(1 << 20, c.rank)
    first = c.explain(1 << 20).algorithm
    for _ in range(20):
        req = c.Iallreduce(x, np.empty_like(x))
        req.Wait(timeout=60)
        assert req.algorithm == first
    assert c.learned() == [] and c._host.learning is None
    c.Free()


def test_rank_zeros_setting_is_used(no_table, monkeypatch):
    """AL_AUTO_LEARN differs between the ranks: rank 0's applies on every rank (the schedules
    cannot differ)."""
    monkeypatch.setenv("AL_AUTO_LEARN", "2" if WORLD.rank == 0 else "0")
    c = al.Communicator()
    if c.size == 1:
        pytest.skip("one rank: nothing to learn")
    x = inputs(4096, c.rank)
    for _ in range(300):                    # 4 x 2 + 1 rounds of at most 3 contenders x RUN,
        #                                     doubled twice at most (learning.MORE_ROUNDS)
        c.Allreduce(x, np.empty_like(x))
    got = WORLD.allgather([r["choice"] for r in c.learned()])
    assert all(g == got[0] for g in got) and len(got[0]) == 1
    c.Free()
