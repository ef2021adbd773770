"""auto's learning in use (AL_AUTO_LEARN, aluminum_py.learning) at every rank count: every call
of the schedule gives numpy's result whichever contender runs it, blocking and nonblocking; every
rank runs the same contender at every call and commits to the same choice; once committed, the
launcher's cache answers; AL_AUTO_LEARN=0 leaves the table's choice alone."""
import numpy as np
import pytest

import aluminum_py as al
from aluminum_py import learning
from conftest import WORLD, all_ranks_ok, gather_all

pytestmark = pytest.mark.mpi


@pytest.fixture
def no_table(tmp_path_factory, monkeypatch):
    path = WORLD.bcast(str(tmp_path_factory.mktemp("none") / "missing.json"), root=0)
    monkeypatch.setenv("AL_TUNING_FILE", path)
    monkeypatch.delenv("AL_AUTO_LEARN", raising=False)


def inputs(nbytes, rank, dtype=np.float32):
    return (np.arange(nbytes // np.dtype(dtype).itemsize) % 97 + rank).astype(dtype)


def longest_schedule(nbytes, rounds=5):
    """The calls a size class can take to commit with AL_AUTO_LEARN=`rounds`: its rounds (4x
    up to 64 KiB), doubled up to learning.MORE_ROUNDS times, twice over where the machine
    changed state on the way (learning.state_change: once per class, the rounds after it
    learn as long again), plus the warm-up round, each of at most CONTENDERS x RUN calls, and
    the call that commits."""
    r = rounds * (learning.CHEAP_ROUNDS if learning.size_class(nbytes) <= learning.CHEAP_BYTES
                  else 1) * learning.MORE_ROUNDS * 2
    return (r + 1) * learning.CONTENDERS * learning.RUN + 1


def committed(c, nbytes, itemsize=4):
    """Whether the class of `nbytes` (and `itemsize`) has committed (the same on every rank:
    decided from exchanged numbers at the same call)."""
    key = (learning.size_class(nbytes), itemsize)
    return any((r["bytes"], r["itemsize"]) == key for r in c.learned())


@pytest.mark.parametrize("nbytes", [4, 4096, 96 << 10, 3 << 20])
def test_every_call_of_the_schedule_is_right_and_the_ranks_agree(no_table, nbytes):
    c = al.Communicator()
    x = inputs(nbytes, c.rank)
    want = gather_all(x).sum(axis=0)
    ran, problems = [], []
    for i in range(longest_schedule(nbytes)):
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
        if committed(c, nbytes):
            break
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
        for _ in range(longest_schedule(x.nbytes)):
            y = np.empty_like(x)
            c.Allreduce(x, y)
            assert np.array_equal(y, want)
            if committed(c, x.nbytes, x.itemsize):
                break
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
    for _ in range(longest_schedule(x.nbytes, rounds=2)):
        c.Allreduce(x, np.empty_like(x))
        if committed(c, x.nbytes):
            break
    got = WORLD.allgather([r["choice"] for r in c.learned()])
    assert all(g == got[0] for g in got) and len(got[0]) == 1
    c.Free()


def test_a_committed_class_learns_again_after_its_calls(no_table, monkeypatch):
    """AL_AUTO_RECHECK: the class's calls are counted over all its sizes (here two), and the
    re-check starts at the same call on every rank: the call AL_AUTO_RECHECK after the one
    that committed.  Every call of the re-check gives numpy's result, and the ranks commit to
    the same choice again; the launcher's choose() (no call) does not count."""
    monkeypatch.setenv("AL_AUTO_LEARN", "1")
    monkeypatch.setenv("AL_AUTO_RECHECK", "40")
    c = al.Communicator()
    if c.size == 1:
        pytest.skip("one rank: nothing to learn")
    key = (1 << 20, 4)
    xs = [inputs(n, c.rank) for n in (1 << 20, (1 << 20) - 4096)]     # one size class
    wants = [gather_all(x).sum(axis=0) for x in xs]
    learners = c._host.learning.learners
    seen, problems = [], []
    for i in range(400):
        x, want = xs[i % 2], wants[i % 2]
        y = np.empty_like(x)
        if i % 5 == 4:
            req = c.Iallreduce(x, y)
            req.Wait(timeout=60)
        else:
            c.Allreduce(x, y)
        if not np.array_equal(y, want):
            problems.append(f"call {i}: wrong result")
        lr = learners[key]
        seen.append((lr.rechecks, lr.committed))
        for _ in range(3):
            c._host.launcher.choose(x.nbytes, 4)       # peeks: not calls of the class
        if lr.rechecks == 2:
            break
    assert all_ranks_ok(not problems), problems
    everyone = WORLD.allgather(seen)
    assert all(e == everyone[0] for e in everyone), "the ranks differ"
    # the call that committed (re-check k, k = 0 the first learning) and the first of re-check
    # k + 1: AL_AUTO_RECHECK calls apart the first time
    committed_at = [next(i for i, (k, ch) in enumerate(seen) if k == n and ch is not None)
                    for n in (0, 1)]
    started_at = [next(i for i, (k, ch) in enumerate(seen) if k == n) for n in (1, 2)]
    assert started_at[0] - committed_at[0] == 40, (committed_at, started_at)
    first, again = seen[committed_at[0]][1], seen[committed_at[1]][1]
    assert started_at[1] - committed_at[1] == (80 if again == first else 40)
    (r,) = c.learned()
    assert r["rechecks"] == 1 and r["prior"] == first and r["source"] == "learned"
    c.Free()


def test_rank_zeros_recheck_setting_is_used(no_table, monkeypatch):
    """AL_AUTO_RECHECK differs between the ranks: rank 0's applies on every rank (a count that
    differed would start the re-check at different calls, and the ranks would run different
    contenders)."""
    monkeypatch.setenv("AL_AUTO_RECHECK", "40" if WORLD.rank == 0 else "0")
    c = al.Communicator()
    if c.size == 1:
        pytest.skip("one rank: nothing to learn")
    x = inputs(1 << 20, c.rank)
    lr = c._host.learning(x.nbytes, 4)
    assert WORLD.allgather((c._host.learning.recheck, lr.recheck)) == [(40, 40)] * WORLD.size
    c.Free()
